"""The engine on CUDA with the tiny model (skipped without CUDA): batch invariance end to end,
with decode steps replayed from CUDA graphs.

- needle in a batch: one prompt alone, then among concurrent requests of random lengths that
  join step by step, gives the same token ids and bitwise-equal logprobs;
- CUDA graphs change nothing: the same traffic run eagerly gives the same bits (decode-only
  steps and steps that mix prefill chunks and decodes are both replayed from graphs);
- a worker's warm-up leaves no graph capture to the requests that follow, and changes no bit;
- asynchronous scheduling changes nothing: steps launched before the previous step's ids
  reach the host give the bits of steps that wait;
- mixed steps captured vs eager, at the forward level: steps of prefill chunks and decodes,
  each replayed from its token bucket's graph (padding tokens, empty sequences), give the eager
  forward's hidden bits; on the Qwen3-8B-wide model too, where default mode (cuBLAS picks its
  kernel by M) must differ (negative control);
- the trainer's view: teacher-forced scoring (one pass, no KV reuse) equals the sampled
  logprobs bitwise;
- negative control: default mode (cuBLAS, SDPA) shows differences on the same traffic, on a
  model as wide as Qwen3-8B (two layers), where the batch-invariant engine is checked too.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from detgate.contract.compare import logprob_bits
from detgate.kernels.bits import same_bits
from detgate.worker.engine import offline as wl
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.cuda_graphs import MixedGraphs
from detgate.worker.engine.engine import Engine
from detgate.worker.model.loader import load
from detgate.worker.tools.make_model import PRESETS
from detgate.worker.tools.random_model import load_random
from tests.worker.paged_forward import make_caches, mixed_steps
from tests.worker.test_async_scheduling import traffic as async_traffic

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NEEDLE_TOKENS = 48
_loaded: dict = {}


def engine(tiny_model, mode: str, dtype: str, **overrides) -> Engine:
    if (mode, dtype) not in _loaded:
        _loaded[mode, dtype] = load(tiny_model, dtype=dtype, device="cuda", mode=mode)
    loaded = _loaded[mode, dtype]
    limits = {"max_num_seqs": 64, "max_num_batched_tokens": 1024, "kv_cache_mb": 256,
              **overrides}
    config = EngineConfig(model=str(tiny_model), mode=mode, device="cuda", dtype=dtype,
                          **limits)
    return Engine(config, loaded.model, loaded.config)


def traffic(vocab_size: int) -> list[wl.Request]:
    """Six copies of one prompt among 60 requests of random lengths, shuffled."""
    return wl.determinism_workload(needles=6, fillers=60, prompt_len=37,
                                   needle_tokens=NEEDLE_TOKENS, filler_prompt=(1, 200),
                                   filler_tokens=(1, 64), vocab_size=vocab_size, seed=7)


def results(out: dict[str, wl.Completion]) -> dict[str, tuple[list[int], tuple]]:
    """Token ids and logprob bit patterns (-0.0 is not 0.0) per request."""
    return {rid: (c.token_ids, logprob_bits(c.logprobs)) for rid, c in out.items()}


def needle_results(out: dict[str, wl.Completion]) -> list[tuple[list[int], tuple]]:
    return [r for rid, r in sorted(results(out).items()) if rid.startswith("needle")]


def alone_and_crowded(eng: Engine):
    reqs = traffic(eng.runner.model_config.vocab_size)
    needle = next(r for r in reqs if r.request_id.startswith("needle"))
    alone, _ = wl.run(eng, [needle], arrival_seed=None)
    crowded, stats = wl.run(eng, reqs, arrival_seed=3)
    return alone[needle.request_id], crowded, stats


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_needle_in_batch_is_bit_identical_with_cuda_graphs(tiny_model, dtype):
    eng = engine(tiny_model, "batch_invariant", dtype)
    alone, crowded, stats = alone_and_crowded(eng)
    assert stats.max_batch_size > 16 and stats.decode_only_steps > 0
    assert eng.runner.graphs is not None and eng.runner.graphs.graphs  # graphs were replayed
    assert eng.runner.mixed_graphs is not None and eng.runner.mixed_graphs.graphs
    assert not eng.runner.graphs.failed and not eng.runner.mixed_graphs.failed
    assert len(alone.token_ids) == NEEDLE_TOKENS
    assert needle_results(crowded) == [(alone.token_ids, logprob_bits(alone.logprobs))] * 6


def test_cuda_graphs_equal_eager(tiny_model):
    reqs = traffic(_vocab(tiny_model))
    graph_engine = engine(tiny_model, "batch_invariant", "bfloat16")
    graphs, _ = wl.run(graph_engine, reqs, arrival_seed=3)
    assert graph_engine.runner.graphs.graphs and graph_engine.runner.mixed_graphs.graphs
    assert not graph_engine.runner.mixed_graphs.failed
    eager_engine = engine(tiny_model, "batch_invariant", "bfloat16", enforce_eager=True)
    assert eager_engine.runner.graphs is None and eager_engine.runner.mixed_graphs is None
    eager, _ = wl.run(eager_engine, reqs, arrival_seed=11)  # other arrivals too
    assert results(graphs) == results(eager)


def test_warm_up_leaves_no_capture_to_the_requests(tiny_model):
    """A worker's warm-up captures every graph that traffic of contexts within its widths
    replays, and runs the eager lm_head at every row count: serving then captures nothing, and
    its answers have the bits of an engine that did not warm up."""
    reqs = wl.determinism_workload(needles=6, fillers=60, prompt_len=37,
                                   needle_tokens=NEEDLE_TOKENS, filler_prompt=(1, 150),
                                   filler_tokens=(1, 64), vocab_size=_vocab(tiny_model), seed=7)
    warm = engine(tiny_model, "batch_invariant", "bfloat16")
    info = warm.warm_up()
    assert info["decode_graphs"] > 0 and info["mixed_graphs"] > 0
    assert info["logits_rows"] == warm.config.max_num_seqs
    decode, mixed = set(warm.runner.graphs.graphs), set(warm.runner.mixed_graphs.graphs)
    served, stats = wl.run(warm, reqs, arrival_seed=3)
    assert stats.decode_only_steps > 0 and stats.max_batch_size > 16
    assert set(warm.runner.graphs.graphs) == decode
    assert set(warm.runner.mixed_graphs.graphs) == mixed
    cold, _ = wl.run(engine(tiny_model, "batch_invariant", "bfloat16"), reqs, arrival_seed=3)
    assert results(served) == results(cold)


def test_async_scheduling_equals_sync(tiny_model):
    """Steps launched before the previous step's ids are on the host (--async-scheduling), with
    early stops on the token in flight, seeded sampling, prompt scoring and preemptions, give
    the bits of steps that wait (tests/worker/test_async_scheduling.py runs the same on the
    CPU, with its negative control)."""
    reqs = async_traffic(_vocab(tiny_model))
    overlapped_engine = engine(tiny_model, "batch_invariant", "bfloat16", kv_cache_mb=None,
                               num_kv_blocks=16, max_num_seqs=24, max_num_batched_tokens=64,
                               async_scheduling=True)
    overlapped, stats = wl.run(overlapped_engine, reqs, arrival_seed=13)
    sync_engine = engine(tiny_model, "batch_invariant", "bfloat16", kv_cache_mb=None,
                         num_kv_blocks=16, max_num_seqs=24, max_num_batched_tokens=64,
                         async_scheduling=False)
    sync, sync_stats = wl.run(sync_engine, reqs, arrival_seed=13)
    assert results(overlapped) == results(sync)
    assert {k: logprob_bits(c.prompt_logprobs or []) for k, c in overlapped.items()} == \
           {k: logprob_bits(c.prompt_logprobs or []) for k, c in sync.items()}
    assert overlapped_engine.scheduler.num_preemptions > 0
    assert (stats.steps, stats.mean_batch_size) != (sync_stats.steps, sync_stats.mean_batch_size)


def test_score_equals_sampled_logprobs(tiny_model):
    eng = engine(tiny_model, "batch_invariant", "bfloat16")
    reqs = traffic(_vocab(tiny_model))
    sampled, _ = wl.run(eng, reqs, arrival_seed=3)
    chosen = [r for r in reqs if sampled[r.request_id].token_ids][:12]
    pairs = wl.score_requests(sampled, chosen, len(chosen))
    scored, _ = wl.run(eng, [p for p, _ in pairs], arrival_seed=None)
    result = wl.compare_scores([sampled[r.request_id] for r in chosen],
                               [scored[p.request_id] for p, _ in pairs], [n for _, n in pairs])
    assert result["positions"] > 100
    assert result["all_equal"], result


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory) -> dict:
    """Two layers of Qwen3-8B's width, random weights on the GPU, in both modes: the tiny
    model's matmuls are too small for cuBLAS to change its reduction with the batch (its default
    mode showed no difference on an H200); o_proj and down_proj at width 4096 do."""
    preset = dataclasses.replace(PRESETS["qwen3-8b-shape"], name="qwen3-8b-width-2-layers",
                                 num_layers=2)
    folder = tmp_path_factory.mktemp("wide")
    return {mode: load_random(preset, folder, seed=0, device="cuda", mode=mode)
            for mode in ("default", "batch_invariant")}


def wide_engine(loaded) -> Engine:
    config = EngineConfig(model="wide", mode=loaded.fingerprint_parts["mode"], device="cuda",
                          dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=1024,
                          kv_cache_mb=256)
    return Engine(config, loaded.model, loaded.config)


def test_wide_model_needle_in_batch_is_bit_identical(wide_models):
    alone, crowded, _ = alone_and_crowded(wide_engine(wide_models["batch_invariant"]))
    assert needle_results(crowded) == [(alone.token_ids, logprob_bits(alone.logprobs))] * 6


def test_negative_control_default_mode_differs(wide_models):
    alone, crowded, _ = alone_and_crowded(wide_engine(wide_models["default"]))
    # Exact float comparison: the differences may be a few bits of some logprobs.
    want = (alone.token_ids, logprob_bits(alone.logprobs))
    assert any(r != want for r in needle_results(crowded))


def _vocab(tiny_model) -> int:
    return engine(tiny_model, "batch_invariant", "bfloat16").runner.model_config.vocab_size


MIXED_MAX_TOKENS = 256  # token buckets 16, 32, 64, 128, 256


def captured_vs_eager(loaded, seed: int) -> tuple[list[bool], MixedGraphs]:
    """Random mixed steps (prefill chunks + decodes, up to 256 tokens) run eagerly on one
    cache, and replayed from captured mixed-step graphs on another: per step, whether the
    hidden states are bit-identical."""
    model = loaded.model
    rng = random.Random(seed)
    vocab = loaded.config.vocab_size
    prompts = [[rng.randrange(100, min(vocab, 100_000)) for _ in range(rng.randint(5, 200))]
               for _ in range(12)]
    eager = mixed_steps(model, make_caches(model, 256, "cuda"), prompts, seed,
                        MIXED_MAX_TOKENS, device="cuda")
    caches = make_caches(model, 256, "cuda")
    graphs = MixedGraphs(model, caches, max_seqs=16, max_tokens=MIXED_MAX_TOKENS,
                         block_size=16, max_model_len=1024, padding_block=255,
                         hidden_size=loaded.config.hidden_size, dtype=loaded.config.dtype)
    captured = mixed_steps(model, caches, prompts, seed, MIXED_MAX_TOKENS, graphs.forward,
                           device="cuda")
    assert not graphs.failed and all(g.graph is not None for g in graphs.graphs.values())
    assert len({t for t, _ in graphs.graphs}) >= 3  # several token buckets were replayed
    return [same_bits(a, b) for a, b in zip(eager, captured, strict=True)], graphs


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mixed_steps_captured_equal_eager(tiny_model, dtype):
    engine(tiny_model, "batch_invariant", dtype)  # loads the model
    same, _ = captured_vs_eager(_loaded["batch_invariant", dtype], seed=21)
    assert all(same), f"{same.count(False)} of {len(same)} steps differ"


def test_wide_model_mixed_steps_captured_equal_eager(wide_models):
    same, _ = captured_vs_eager(wide_models["batch_invariant"], seed=22)
    assert all(same), f"{same.count(False)} of {len(same)} steps differ"


def test_negative_control_default_mode_mixed_steps_captured_differ(wide_models):
    same, _ = captured_vs_eager(wide_models["default"], seed=22)
    assert not all(same)
