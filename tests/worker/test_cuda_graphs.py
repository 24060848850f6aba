"""Decode-step padding of worker/engine/cuda_graphs.py, on the CPU: the graphs' static buffers,
padding rows and padding block, run eagerly (capture=False); the capture itself is covered on
CUDA by tests/worker/test_gpu_engine.py.

Padding a decode batch up to a graph's batch size, and its block table up to the graph's width,
must leave every real row's bits unchanged in batch_invariant mode; in default mode the padded
batch size moves the numbers (negative control).
"""

from __future__ import annotations

from worker.engine import offline as wl
from worker.engine.config import EngineConfig
from worker.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from worker.engine.engine import Engine
from worker.model.loader import load

_loaded: dict = {}


def run(tiny_model, mode: str, padded: bool) -> tuple[dict, Engine]:
    if mode not in _loaded:
        _loaded[mode] = load(tiny_model, dtype="float32", device="cpu", mode=mode)
    loaded = _loaded[mode]
    eng = Engine(EngineConfig(model=str(tiny_model), mode=mode, max_num_seqs=24,
                              num_kv_blocks=256), loaded.model, loaded.config)
    runner = eng.runner
    if padded:
        runner.graphs = DecodeGraphs(
            loaded.model, runner.kv_caches, max_seqs=24, block_size=runner.block_size,
            max_model_len=runner.max_model_len, padding_block=runner.num_kv_blocks,
            capture=False)
    reqs = wl.cost_workload(requests=11, prompt=(3, 40), output=(5, 14),
                            vocab_size=loaded.config.vocab_size, seed=1)
    out, _ = wl.run(eng, reqs, arrival_seed=2)
    return {k: (c.token_ids, c.logprobs) for k, c in out.items()}, eng


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


def test_negative_control_default_mode_padding_differs(tiny_model):
    eager, _ = run(tiny_model, "default", padded=False)
    padded, _ = run(tiny_model, "default", padded=True)
    assert padded != eager
