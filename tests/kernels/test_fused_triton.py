"""The fused per-head and pointwise Triton kernels: q/k norm + rotary + K/V store
(kernels/qkv_triton.py) and silu-and-mul (kernels/activation_triton.py).

Without CUDA they run under Triton's interpreter (TRITON_INTERPRET=1, set before the kernel
modules are imported) on small CPU tensors; with CUDA, natively. The fused store must give
what the unfused layer computes (q_norm / k_norm, rotary, store_kv) up to the rounding of a
differently ordered sum of squares, and a token's bits must not depend on the other tokens of
the call; silu-and-mul must be torch's F.silu(gate) * up bit for bit on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import torch.nn.functional as F  # noqa: E402

from detgate.kernels import activation_triton, qkv_triton  # noqa: E402
from detgate.kernels.bits import same_bits  # noqa: E402
from detgate.worker.model.layers.rotary import RotaryEmbedding, _rotate  # noqa: E402
from tests.kernels.test_triton_ops import _interpreter_bf16  # noqa: E402, F401

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if ON_GPU else [])
EPS = 1e-6


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    return (y.float() * w.float()).to(x.dtype)


class World:
    """A layer's shapes (Hq = 5, Hkv = 3: a partial head block, GQA), its tables and caches."""

    def __init__(self, dtype: torch.dtype, t: int, norm: bool = True, hq=5, hkv=3, d=32):
        g = torch.Generator().manual_seed(t * 7 + d)
        self.hq, self.hkv, self.d, self.dtype = hq, hkv, d, dtype
        with torch.device(DEVICE):
            self.rot = RotaryEmbedding(d, 4096, 1e6, None)
        self.qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype).to(DEVICE)
        self.pos = torch.randint(0, 4096, (t,), generator=g).to(DEVICE)
        self.qw = (torch.rand(d, generator=g) + 0.5).to(dtype).to(DEVICE) if norm else None
        self.kw = (torch.rand(d, generator=g) + 0.5).to(dtype).to(DEVICE) if norm else None
        self.slots = torch.randperm(4 * 16, generator=g)[:t].to(DEVICE)
        self.k_cache = torch.zeros(4, 16, hkv, d, dtype=dtype, device=DEVICE)
        self.v_cache = torch.zeros_like(self.k_cache)

    def fused(self, rows=slice(None), slots=None) -> torch.Tensor:
        return qkv_triton.norm_rope_store(
            self.qkv[rows], self.pos[rows], self.rot.cos, self.rot.sin, self.qw, self.kw, EPS,
            self.k_cache, self.v_cache, self.slots[rows] if slots is None else slots,
            self.hq, self.hkv)

    def unfused(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = self.qkv.shape[0]
        q, k, v = self.qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        q, k = q.reshape(t, self.hq, self.d), k.reshape(t, self.hkv, self.d)
        if self.qw is not None:
            q, k = _rms(q, self.qw), _rms(k, self.kw)
        cos, sin = self.rot.cos[self.pos].unsqueeze(1), self.rot.sin[self.pos].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v.reshape(t, self.hkv, self.d)

    def cached(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.view(-1, self.hkv, self.d)[self.slots]


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm", [True, False])
def test_norm_rope_store_matches_the_unfused_layer(dtype, norm):
    w = World(dtype, t=9, norm=norm)
    assert ON_GPU or not qkv_triton.supported(w.qkv, w.hq, w.hkv, w.d, w.rot.cos, w.k_cache)
    q = w.fused()
    want_q, want_k, want_v = w.unfused()
    torch.testing.assert_close(q.float(), want_q.float(), **TOL[dtype])
    torch.testing.assert_close(w.cached(w.k_cache).float(), want_k.float(), **TOL[dtype])
    assert same_bits(w.cached(w.v_cache), want_v)  # v is copied as it is
    if not norm:  # without the norm it is the rotary kernel's arithmetic exactly
        assert same_bits(q, want_q) and same_bits(w.cached(w.k_cache), want_k)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rope_store_token_bits_do_not_depend_on_the_batch(dtype):
    w = World(dtype, t=9)
    q_all = w.fused()
    k_all, v_all = w.cached(w.k_cache).clone(), w.cached(w.v_cache).clone()
    for i in (0, 4, 8):
        w.k_cache.zero_()
        w.v_cache.zero_()
        q_one = w.fused(rows=slice(i, i + 1))
        assert same_bits(q_one[0], q_all[i])
        assert same_bits(w.cached(w.k_cache)[i], k_all[i])
        assert same_bits(w.cached(w.v_cache)[i], v_all[i])


def _sequential_norm_q(w: World, rows: slice) -> torch.Tensor:
    """Negative control: the q norm with its sum of squares in an order that follows the call's
    size, as a split reduction chosen by row count would: left to right over the head below 4
    tokens, each half left to right and then added from 4 on. Both orders are explicit fp32
    additions, one element-wise add at a time (a cumsum is a parallel scan on CUDA), so they
    differ on some heads on any device."""
    x = w.qkv[rows, :w.hq * w.d].reshape(-1, w.hq, w.d).float()
    sq = x * x

    def left_to_right(cols: range) -> torch.Tensor:
        total = sq[..., cols[0]]
        for j in cols[1:]:
            total = total + sq[..., j]
        return total

    if x.shape[0] < 4:
        ss = left_to_right(range(w.d))
    else:
        ss = left_to_right(range(w.d // 2)) + left_to_right(range(w.d // 2, w.d))
    return x * torch.rsqrt(ss / w.d + EPS)[..., None]


def test_negative_control_a_size_dependent_norm_is_caught():
    """The alone-vs-in-the-call comparison above finds the difference that a norm whose
    reduction order follows the call's size makes."""
    w = World(torch.float32, t=9)
    q_all = _sequential_norm_q(w, slice(None))
    differing = [i for i in range(9)
                 if not same_bits(_sequential_norm_q(w, slice(i, i + 1))[0], q_all[i])]
    assert differing


def test_norm_rope_store_skips_negative_slots():
    w = World(torch.float32, t=3)
    slots = torch.tensor([5, -1, 7], device=DEVICE)
    q = w.fused(slots=slots)
    want_q, want_k, _ = w.unfused()
    torch.testing.assert_close(q, want_q, **TOL[torch.float32])  # q is written for every row
    flat = w.k_cache.view(-1, w.hkv, w.d)
    torch.testing.assert_close(flat[[5, 7]], want_k[[0, 2]], **TOL[torch.float32])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[[5, 7]] = False
    assert not flat[untouched].any()


def test_norm_rope_store_wants_both_norm_weights():
    w = World(torch.float32, t=2)
    w.kw = None
    with pytest.raises(ValueError, match="come together"):
        w.fused()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_torchs_arithmetic(dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 2 * 1500, generator=g) * 6).to(dtype).to(DEVICE)
    x[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.0, -88.0, 1e-3, -1e-3])
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = activation_triton.silu_and_mul(x)
    if ON_GPU:  # libdevice's expf and an IEEE division, as torch's CUDA kernel
        assert same_bits(got, want)
    else:  # the interpreter's exp is numpy's
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    # One row alone gives that row's bits (pointwise).
    assert same_bits(activation_triton.silu_and_mul(x[3:4])[0], got[3])
    assert activation_triton.silu_and_mul(x[:0]).shape == (0, 1500)
