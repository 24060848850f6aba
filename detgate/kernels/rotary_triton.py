"""Neox-style rotary embedding of q and k in one Triton launch (CUDA), bit for bit the torch
code it replaces (worker/model/layers/rotary.py `_rotate`):

    x1, x2 = x.float().chunk(2, dim=-1)
    out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin).to(x.dtype)

Every element is two fp32 products and one fp32 sum or difference, each rounded once as torch
rounds it (floating-point contraction is off: no FMA), then rounded to x's dtype (round to
nearest even, as torch). Pointwise, so one element's bits never depend on the batch. It only
saves launches and memory passes: torch runs that line as ~8 kernels per tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detgate.kernels import pdl

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, pos_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh,
                   stride_kot, stride_koh, stride_table, HQ: tl.constexpr, HKV: tl.constexpr,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)  # head blocks: q's first, then k's
    q_blocks = tl.cdiv(HQ, BLOCK_H)
    is_q = hb < q_blocks
    heads = tl.where(is_q, hb, hb - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    num_heads = tl.where(is_q, HQ, HKV)
    mask = (heads < num_heads)[:, None]
    d = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t)
    c = tl.load(cos_ptr + pos * stride_table + d)[None, :]
    s = tl.load(sin_ptr + pos * stride_table + d)[None, :]
    if is_q:
        src = q_ptr + t * stride_qt + heads[:, None] * stride_qh
        dst = q_out_ptr + t * stride_qot + heads[:, None] * stride_qoh
    else:
        src = k_ptr + t * stride_kt + heads[:, None] * stride_kh
        dst = k_out_ptr + t * stride_kot + heads[:, None] * stride_koh
    x1 = tl.load(src + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    # A narrowing cast rounds to nearest even by default, as torch's .to() does (Triton's CPU
    # interpreter truncates instead: check these bits on a GPU).
    tl.store(dst + d[None, :], o1.to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF + d[None, :], o2.to(q_out_ptr.dtype.element_ty), mask=mask)


def supported(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor) -> bool:
    half = q.shape[-1] // 2
    return (q.is_cuda and q.dim() == 3 and k.dim() == 3 and q.dtype in _SUPPORTED
            and k.dtype == q.dtype and q.shape[-1] == k.shape[-1] and q.shape[0] == k.shape[0]
            and half >= 1 and half & (half - 1) == 0 and q.stride(-1) == 1 and k.stride(-1) == 1
            and cos.dtype == torch.float32 and cos.stride(-1) == 1 and cos.shape[-1] == half)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] (rows may be strided), positions [T], cos/sin tables
    [max_positions, D/2] fp32 -> rotated (q, k), new contiguous tensors in q's dtype."""
    t, hq, dim = q.shape
    hkv = k.shape[1]
    q_out = torch.empty((t, hq, dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, dim), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    block_h = min(triton.next_power_of_2(max(hq, hkv)), 16)
    grid = (t, triton.cdiv(hq, block_h) + triton.cdiv(hkv, block_h))
    _rotary_kernel[grid](q, k, q_out, k_out, cos, sin, positions, q.stride(0), q.stride(1),
                         k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
                         k_out.stride(0), k_out.stride(1), cos.stride(0), HQ=hq, HKV=hkv,
                         HALF=dim // 2, BLOCK_H=block_h, num_warps=4,
                         enable_fp_fusion=False, **pdl.options(q))
    return q_out, k_out
