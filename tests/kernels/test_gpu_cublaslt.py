"""cuBLASLt for large row counts (kernels/cublaslt.py) on a real GPU (skipped without CUDA).

A row count served by cuBLASLt must give every row the Triton kernel's bits; the check that
decides it must refuse an algorithm whose bits differ (the negative control: a reference one
bit off is caught and the shape falls back to Triton).
"""

from __future__ import annotations

from importlib import import_module

import pytest
import torch

from detgate.kernels.bits import same_bits

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# Qwen3-8B's fused projections, transformers' separate gate / up and k / v projections
SHAPES = [(4096, 4096), (4096, 12288), (6144, 4096), (24576, 4096), (12288, 4096), (1024, 4096)]
MS = (129, 200, 256, 257, 300, 512, 777, 1024, 1536, 2048)


@pytest.fixture()
def mods(monkeypatch):
    mm = import_module("detgate.kernels.matmul_triton")
    lt = import_module("detgate.kernels.cublaslt")
    monkeypatch.setattr(lt, "ENABLED", True)
    monkeypatch.setattr(lt, "_SHAPES", {})
    mm.clear_caches()
    yield mm, lt
    mm.clear_caches()


def _weights(n, k, m):
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    return torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16), w


@pytest.mark.parametrize("n,k", SHAPES)
def test_cublaslt_rows_have_the_triton_bits(mods, n, k):
    mm, lt = mods
    a, w = _weights(n, k, max(MS))
    info = mm.device_info(torch.cuda.current_device())
    full = mm.matmul(a, w.t())
    served = []
    for m in MS:
        out = mm.matmul(a[:m], w.t())
        jit = mm.matmul(a[:m], w.t(), config=mm.pick_config(m, n, k, torch.bfloat16, info))
        assert same_bits(out, jit), m
        assert same_bits(out, full[:m]), m
        (weight,) = [v for v in mm._WEIGHTS.values() if v is not None]
        if weight.by_m[m].gemm is not None:
            served.append(m)
    if not served:
        pytest.skip(f"cuBLASLt served no row count of {(n, k)} here (its bits differ or it "
                    "found no algorithm): Triton serves, so rows are invariant either way")


# An algorithm checked at one row count serves every other row count the heuristic gives it to
# without a check of its own (see the module doc): every row count of a decode batch, each
# against the Triton kernel at that M.
@pytest.mark.parametrize("n,k", [(151936, 4096), (4096, 12288)])
def test_every_row_count_up_to_1024_has_the_triton_bits(mods, n, k):
    mm, lt = mods
    a, w = _weights(n, k, 1024)
    info = mm.device_info(torch.cuda.current_device())
    served = 0
    for m in range(lt.MIN_ROWS, 1025):
        out = mm.matmul(a[:m], w.t())
        assert same_bits(out, mm.matmul(a[:m], w.t(),
                                        config=mm.pick_config(m, n, k, torch.bfloat16, info))), m
        (weight,) = [v for v in mm._WEIGHTS.values() if v is not None]
        served += weight.by_m[m].gemm is not None
    if not served:
        pytest.skip(f"cuBLASLt served no row count of {(n, k)} here")
    (shape,) = lt._SHAPES.values()
    print(f"{(n, k)}: {served} row counts served by {len(shape.verified)} checked algorithms")


def test_a_check_that_finds_other_bits_turns_the_shape_back_to_triton(mods):
    mm, lt = mods
    n, k, m = 4096, 4096, 512
    a, w = _weights(n, k, m)
    info = mm.device_info(torch.cuda.current_device())
    cfg = mm.pick_config(m, n, k, torch.bfloat16, info)

    def one_bit_off(x, b):
        out = mm.matmul(x, b, config=cfg)
        out.view(torch.int16)[0, 0] ^= 1
        return out

    assert lt.gemm_for(w, m, one_bit_off) is None
    assert lt.gemm_for(w, m + 1, lambda x, b: mm.matmul(x, b, config=cfg)) is None  # failed
    (shape,) = lt._SHAPES.values()
    assert shape.failed
    assert same_bits(mm.matmul(a, w.t()), mm.matmul(a, w.t(), config=cfg))


def test_the_lm_head_at_decode_batch_sizes_has_the_triton_bits(mods):
    mm, lt = mods
    n, k = 151936, 4096
    a, w = _weights(n, k, 256)
    info = mm.device_info(torch.cuda.current_device())
    full = mm.matmul(a, w.t(), config=mm.pick_config(256, n, k, torch.bfloat16, info))
    for m in (1, 129, 256):
        assert same_bits(mm.matmul(a[:m], w.t()), full[:m]), m


def test_a_check_too_large_for_its_memory_cap_leaves_the_rows_to_triton(mods, monkeypatch):
    mm, lt = mods
    n, k, m = 4096, 4096, 512
    monkeypatch.setattr(lt, "VERIFY_MAX_BYTES", m * (k + 2 * n) * 2 - 1)
    a, w = _weights(n, k, m)
    info = mm.device_info(torch.cuda.current_device())
    out = mm.matmul(a, w.t())
    (weight,) = [v for v in mm._WEIGHTS.values() if v is not None]
    assert weight.by_m[m].gemm is None
    assert not lt._SHAPES  # never checked
    cfg = mm.pick_config(m, n, k, torch.bfloat16, info)
    assert same_bits(out, mm.matmul(a, w.t(), config=cfg))


def _counting_gemm(mm, n, k, m):
    """(a, w, the served call's output, the calls cuBLASLt got since) after one served call at
    a row count cuBLASLt serves, its plan's gemm wrapped to count calls; skips elsewhere."""
    a, w = _weights(n, k, m)
    served = mm.matmul(a, w.t())
    (weight,) = [v for v in mm._WEIGHTS.values() if v is not None]
    plan = weight.by_m[m]
    if plan.gemm is None:
        pytest.skip(f"cuBLASLt does not serve {(n, k)} at {m} rows here")
    calls = []
    gemm = plan.gemm
    plan.gemm = lambda x, stream: calls.append(m) or gemm(x, stream)
    return a, w, served, calls


# set_batch_invariant_mode's calls are host-bound: outside a capture they skip cuBLASLt; inside
# one (a graph replays without host cost) they take it. The bits are the same either way.
@pytest.mark.parametrize("n,k", [(1024, 4096), (12288, 4096)])
@pytest.mark.parametrize("m", [129, 512])
def test_a_host_bound_call_takes_the_triton_launch_with_the_served_bits(mods, n, k, m):
    mm, _ = mods
    a, w, served, calls = _counting_gemm(mm, n, k, m)
    assert same_bits(mm.matmul(a, w.t(), host_bound=True), served)
    assert not calls


def test_a_host_bound_call_inside_a_graph_capture_takes_cublaslt_with_the_served_bits(mods):
    mm, _ = mods
    m = 512
    a, w, served, calls = _counting_gemm(mm, 12288, 4096, m)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mm.matmul(a, w.t(), host_bound=True)
    graph.replay()
    torch.cuda.synchronize()
    assert calls == [m]
    assert same_bits(captured, served)
