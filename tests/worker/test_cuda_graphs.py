"""Step padding of worker/engine/cuda_graphs.py, on the CPU: the graphs' static buffers,
padding rows, empty and padding sequences and the padding block, run eagerly (capture=False);
the capture itself is covered on CUDA by tests/worker/test_gpu_engine.py.

Padding a decode batch up to a graph's batch size, a mixed prefill + decode step up to a token
bucket (padding tokens in a padding sequence, empty sequences up to the graph's sequence count),
and block tables up to the graph's width, must leave every real row's bits unchanged in
batch_invariant mode; in default mode, and with the split-K control matmul on any CPU
(tests/support/controls.py), the padding moves the numbers (negative controls).
"""

from __future__ import annotations

import random

import pytest

from detgate.contract.compare import logprob_bits
from detgate.kernels.bits import same_bits
from detgate.worker.engine import offline as wl
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.cuda_graphs import (
    DecodeGraphs,
    MixedGraphs,
    graph_batch_sizes,
    token_buckets,
    widths_covering,
)
from detgate.worker.engine.engine import Engine
from detgate.worker.model.loader import load
from tests.support.controls import SplitKOps, use_ops
from tests.worker.paged_forward import make_caches, mixed_steps

_loaded: dict = {}
MAX_TOKENS = 64  # mixed steps: token buckets 16, 32, 64


def loaded_model(tiny_model, mode: str):
    """The demo model in `mode`, or (mode "split_k") in batch_invariant mode with the split-K
    control's matmul (tests/support/controls.py)."""
    if mode not in _loaded:
        if mode == "split_k":
            loaded = load(tiny_model, dtype="float32", device="cpu", mode="batch_invariant")
            use_ops(loaded.model, SplitKOps())
        else:
            loaded = load(tiny_model, dtype="float32", device="cpu", mode=mode)
        _loaded[mode] = loaded
    return _loaded[mode]


def run(tiny_model, mode: str, padded: bool, mixed: bool = False) -> tuple[dict, Engine]:
    """The same traffic through an engine, eagerly (padded False) or through the graphs'
    static buffers: decode steps only, or (mixed) every step."""
    loaded = loaded_model(tiny_model, mode)
    engine_mode = "batch_invariant" if mode == "split_k" else mode
    eng = Engine(EngineConfig(model=str(tiny_model), mode=engine_mode, max_num_seqs=24,
                              max_num_batched_tokens=MAX_TOKENS if mixed else 2048,
                              num_kv_blocks=256), loaded.model, loaded.config)
    runner = eng.runner
    if padded:
        runner.graphs = DecodeGraphs(
            loaded.model, runner.kv_caches, max_seqs=24, block_size=runner.block_size,
            max_model_len=runner.max_model_len, padding_block=runner.num_kv_blocks,
            capture=False)
        if mixed:
            runner.mixed_graphs = mixed_graphs(loaded, runner.kv_caches, runner.block_size,
                                               runner.max_model_len, runner.num_kv_blocks)
    reqs = wl.cost_workload(requests=11, prompt=(3, 40), output=(5, 14),
                            vocab_size=loaded.config.vocab_size, seed=1)
    out, _ = wl.run(eng, reqs, arrival_seed=2)
    return {k: (c.token_ids, logprob_bits(c.logprobs)) for k, c in out.items()}, eng


def mixed_graphs(loaded, kv_caches, block_size, max_model_len, padding_block) -> MixedGraphs:
    return MixedGraphs(loaded.model, kv_caches, max_seqs=24, max_tokens=MAX_TOKENS,
                       block_size=block_size, max_model_len=max_model_len,
                       padding_block=padding_block, hidden_size=loaded.config.hidden_size,
                       dtype=loaded.config.dtype, capture=False)


def test_graph_batch_sizes():
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 32]
    assert graph_batch_sizes(256)[-1] == 256
    assert graph_batch_sizes(24) == [1, 2, 4, 8, 16, 24]
    assert graph_batch_sizes(1) == [1]


def test_padded_decode_is_bit_identical(tiny_model):
    eager, _ = run(tiny_model, "batch_invariant", padded=False)
    padded, eng = run(tiny_model, "batch_invariant", padded=True)
    assert eng.runner.graphs.graphs  # decode steps went through the padded path
    assert padded == eager


@pytest.mark.parametrize("mode", ["default", "split_k"])
def test_negative_control_padding_differs(tiny_model, mode):
    eager, _ = run(tiny_model, mode, padded=False)
    padded, _ = run(tiny_model, mode, padded=True)
    assert padded != eager


def test_token_buckets():
    assert token_buckets(8192)[:6] == [16, 32, 64, 128, 256, 384]
    assert token_buckets(8192)[-1] == 8192 and len(token_buckets(8192)) == 3 + 64
    assert token_buckets(1000) == [16, 32, 64, *range(128, 1000, 128), 1000]
    assert token_buckets(64) == [16, 32, 64]
    assert token_buckets(10) == [10]
    assert token_buckets(1024, step=256) == [16, 32, 64, 128, 256, 512, 768, 1024]


def test_mixed_steps_padded_are_bit_identical(tiny_model):
    eager, _ = run(tiny_model, "batch_invariant", padded=False, mixed=True)
    padded, eng = run(tiny_model, "batch_invariant", padded=True, mixed=True)
    graphs = eng.runner.mixed_graphs
    assert {t for t, _ in graphs.graphs} >= {32, 64}  # mixed steps ran padded, several buckets
    assert padded == eager


@pytest.mark.parametrize("mode", ["default", "split_k"])
def test_negative_control_mixed_padding_differs(tiny_model, mode):
    eager, _ = run(tiny_model, mode, padded=False, mixed=True)
    padded, _ = run(tiny_model, mode, padded=True, mixed=True)
    assert padded != eager


@pytest.mark.parametrize("mode", ["batch_invariant", "default", "split_k"])
def test_mixed_forward_bits(tiny_model, mode):
    """Forward level: steps mixing prefill chunks and decodes, eager against the padded
    static-buffer path, hidden states compared as bit patterns; default mode and the split-K
    control (batch-variant by construction, on any CPU) must differ somewhere."""
    loaded = loaded_model(tiny_model, mode)
    rng = random.Random(4)
    vocab = loaded.config.vocab_size
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(5, 60))] for _ in range(9)]
    eager = mixed_steps(loaded.model, make_caches(loaded.model, 64), prompts, 5, MAX_TOKENS)
    caches = make_caches(loaded.model, 64)
    graphs = mixed_graphs(loaded, caches, 16, 2048, 63)
    padded = mixed_steps(loaded.model, caches, prompts, 5, MAX_TOKENS, graphs.forward)
    assert len({t for t, _ in graphs.graphs}) >= 2
    same = [same_bits(a, b) for a, b in zip(eager, padded, strict=True)]
    assert all(same) if mode == "batch_invariant" else not all(same)


def test_capture_all_takes_the_widths_up_to_the_first_that_covers():
    assert widths_covering([256, 512, 1024], 300) == [256, 512]
    assert widths_covering([256, 512, 1024], 512) == [256, 512]
    assert widths_covering([256, 512, 1024], 5000) == [256, 512, 1024]
