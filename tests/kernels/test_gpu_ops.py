"""The Triton kernels at Qwen3-8B sizes on a real GPU (skipped without CUDA).

Bitwise batch invariance over M (rows of a large batch equal the same rows computed in any
smaller batch), equality of every tile config's bits (so the shape-dependent tile choice can
never change a result), and the negative control: cuBLAS is not invariant on these shapes.
The full M = 1..8192 sweep of every projection runs in detgate/bench/kernels_proof.py.
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

# (N, K): o_proj and down_proj, where cuBLAS was measured not invariant; qkv for odd N tiles.
SHAPES = [(4096, 4096), (4096, 12288), (6144, 4096)]
M_SAMPLE = sorted(set(range(1, 130)) | {191, 255, 256, 257, 511, 512, 513, 1000, 1023, 2048,
                                        3001, 4096, 8191, 8192})


@pytest.fixture(scope="module")
def mm():
    return import_module("detgate.kernels.matmul_triton")


def _weights(n, k, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.float32) * 0.02
    a = torch.randn(max(M_SAMPLE), k, device="cuda", generator=g, dtype=torch.float32)
    return a.to(dtype), w.to(dtype)


def _mismatched_ms(fn, a, b, ms) -> list[int]:
    full = fn(a, b)
    flags = torch.stack([(fn(a[:m], b) != full[:m]).any() for m in ms])
    return [m for m, bad in zip(ms, flags.tolist(), strict=True) if bad]


@pytest.mark.parametrize("n,k", SHAPES)
def test_matmul_rows_do_not_depend_on_m(mm, n, k):
    a, w = _weights(n, k)
    assert _mismatched_ms(mm.matmul, a, w.t(), M_SAMPLE) == []


@pytest.mark.parametrize("n,k", SHAPES[:2])
def test_negative_control_cublas_rows_depend_on_m(n, k):
    a, w = _weights(n, k)
    assert _mismatched_ms(torch.mm, a, w.t(), list(range(1, 65))) != []


@pytest.mark.parametrize("n,k", SHAPES)
def test_every_tile_config_gives_the_same_bits(mm, n, k):
    a, w = _weights(n, k)
    # 1250 rows: more tiles than SMs for every shape, so the tail configs cut their last wave
    for m in (1, 7, 64, 100, 300, 1250):
        outs = {name: mm.matmul(a[:m], w.t(), config=cfg)
                for name, cfg in mm.CONFIGS_16BIT.items()}
        # The pointer path: an activation 2 bytes past a 16-byte boundary cannot be a TMA
        # descriptor, so the same reduction runs from plain loads.
        shifted = torch.empty(m * k + 1, device="cuda", dtype=a.dtype)[1:].view(m, k)
        shifted.copy_(a[:m])
        outs["pointer"] = mm.matmul(shifted, w.t())
        # A by descriptor and by masked loads, whatever the row count.
        for name, cfg in (("m64n32k256", mm.CONFIGS_16BIT["m64n32k256"]),
                          ("m128n256", mm.CONFIGS_16BIT["m128n256"])):
            for a_desc in (False, True):
                outs[f"{name} a_desc={a_desc}"] = mm.matmul(a[:m], w.t(), config=cfg,
                                                            a_desc=a_desc)
        # The default call: the fast launch with the per-weight cached state.
        outs["fast launch"] = mm.matmul(a[:m], w.t())
        ref = outs.pop("m128n256")
        assert [name for name, out in outs.items() if not same_bits(out, ref)] == [], m


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 2e-3),
                                       (torch.float32, 2e-5)])
def test_matmul_accuracy_and_no_tf32(mm, dtype, tol):
    # fp32 over K = 4096: IEEE lands near 3e-6, TF32 (10 mantissa bits) near 5e-4.
    a, w = _weights(1024, 4096, dtype)
    a = a[:300]
    bias = torch.randn(1024, device="cuda").to(dtype)
    out = mm.matmul(a, w.t(), bias)
    ref = a.double() @ w.double().t() + bias.double()
    assert ((out.double() - ref).norm() / ref.norm()).item() < tol
    assert _mismatched_ms(lambda x, y: mm.matmul(x, y, bias), a, w.t(), [1, 3, 17, 64, 299]) == []


def test_rms_norm_and_add_rms_norm_rows_do_not_depend_on_batch():
    rn = import_module("detgate.kernels.rmsnorm_triton")
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    full = rn.rms_norm(x, w, 1e-6)
    fused, summed = rn.add_rms_norm(x, r, w, 1e-6)
    ref = torch.nn.functional.rms_norm(x.double(), (4096,), w.double(), 1e-6)
    assert ((full.double() - ref).norm() / ref.norm()).item() < 1e-2
    assert same_bits(summed, x + r)
    for m in (1, 2, 3, 31, 128, 1000):
        assert same_bits(rn.rms_norm(x[:m], w, 1e-6), full[:m])
        out, res = rn.add_rms_norm(x[:m], r[:m], w, 1e-6)
        assert same_bits(out, fused[:m]) and same_bits(res, summed[:m])


def test_fast_launch_equals_the_jit_launch_and_keeps_no_weight_alive():
    mm = import_module("detgate.kernels.matmul_triton")
    rn = import_module("detgate.kernels.rmsnorm_triton")
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(700, 4096, device="cuda", dtype=torch.bfloat16)
    info = mm.device_info(torch.cuda.current_device())
    for m in (1, 2, 16, 17, 63, 64, 65, 129, 700):
        cfg = mm.pick_config(m, 4096, 4096, torch.bfloat16, info)
        assert same_bits(mm.matmul(x[:m], w.t(), bias),
                           mm.matmul(x[:m], w.t(), bias, config=cfg)), m
    held = torch.cuda.memory_allocated()
    del w
    assert torch.cuda.memory_allocated() < held  # the cache kept an address, not the tensor
    xs = torch.randn(300, 4096, device="cuda")
    sums = rn.row_sum(xs)
    assert ((sums.double() - xs.double().sum(-1)).abs().max()).item() < 1e-2
    for m in (1, 3, 64, 299):
        assert same_bits(rn.row_sum(xs[:m]), sums[:m])


def test_every_tile_config_through_the_fast_launch_gives_the_jit_bits(mm, monkeypatch):
    # The path a table's choice takes (per-weight launch state, cached descriptors), for every
    # config, A below and above one row tile.
    # (No bias: the kernels test_every_tile_config_gives_the_same_bits compiled serve here.)
    a, w = _weights(4096, 4096)
    for name, cfg in mm.CONFIGS_16BIT.items():
        monkeypatch.setattr(mm, "pick_config", lambda *_, cfg=cfg: cfg)
        mm.clear_caches()
        for m in (1, 65, 300):
            jit = mm.matmul(a[:m], w.t(), config=cfg)
            assert same_bits(mm.matmul(a[:m], w.t()), jit), (name, m)
            (weight,) = mm._WEIGHTS.values()
            assert weight is not None and m in weight.by_m, (name, m)  # the fast launch ran
    mm.clear_caches()


def test_log_softmax_rows_do_not_depend_on_batch():
    ls = import_module("detgate.kernels.log_softmax_triton")
    x = torch.randn(257, 151936, device="cuda") * 4
    full = ls.log_softmax(x)
    assert (full - torch.log_softmax(x.double(), -1)).abs().max().item() < 1e-4
    for m in (1, 2, 5, 64, 256):
        assert same_bits(ls.log_softmax(x[:m]), full[:m])
    # The engine's logits are the lm_head's bf16 (not necessarily the bits of their fp32 copy:
    # the lane layout follows the element size), invariant over the batch all the same.
    xb = x.bfloat16()
    full_b = ls.log_softmax(xb).view(torch.int32)
    for m in (1, 3, 64, 256):
        assert same_bits(ls.log_softmax(xb[:m]).view(torch.int32), full_b[:m])
