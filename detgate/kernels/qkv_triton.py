"""An attention layer's q/k RMSNorm, rotary embedding and K/V store in one Triton launch (CUDA).

Unfused, a layer runs these as six launches: a copy of q's strided view and its norm, the same
for k, the rotary kernel and store_kv. At one decode token they are all launch latency.

One program per (token, block of BLOCK_H heads) of q, k or v; per (token, head) row the
arithmetic is the unfused code's:
- RMSNorm (kernels/rmsnorm_triton.py's numerics, Hugging Face's q_norm / k_norm): the fp32 sum
  of squares of the head's D values, rstd = 1 / sqrt(ss / D + eps), the normalised row rounded
  to the model's dtype, times the weight, rounded again;
- rotary (kernels/rotary_triton.py): x1 * cos - x2 * sin and x2 * cos + x1 * sin in fp32, each
  product and sum rounded once (no FMA), rounded to the model's dtype;
- q is written to a new contiguous [T, Hq, D] tensor, k and v to their cache slot (negative
  slots skipped).

Invariant: the one reduction, a head's sum of squares, runs inside one program over the rows of
a [BLOCK_H, D / 2] tile per half, in a tree fixed by D, BLOCK_H and the warp count, none of
which depends on the number of tokens; everything else is pointwise. So a token's q, k and v
bits depend on its qkv row and position alone, whatever the batch. That tree is not the
unfused norm kernel's (a [D] vector), so the two paths may differ by a rounding; on CUDA both
modes and every step (eager, decode and mixed graphs) take this one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detgate.kernels import pdl

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_H = 8  # heads per program
NUM_WARPS = 4


@triton.jit
def _qkv_kernel(qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cos_ptr,
                sin_ptr, qw_ptr, kw_ptr, stride_t, stride_slot, stride_table, eps,
                HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                HAS_NORM: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    D: tl.constexpr = 2 * HALF
    Q_BLOCKS: tl.constexpr = (HQ + BLOCK_H - 1) // BLOCK_H
    KV_BLOCKS: tl.constexpr = (HKV + BLOCK_H - 1) // BLOCK_H
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)  # head blocks: q's, then k's, then v's
    dtype = q_out_ptr.dtype.element_ty
    d = tl.arange(0, HALF)[None, :]
    row = qkv_ptr + t * stride_t
    slot = tl.load(slot_ptr + t)
    if hb >= Q_BLOCKS + KV_BLOCKS:  # v: into its cache slot as it is
        heads = (hb - Q_BLOCKS - KV_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        mask = (heads < HKV) & (slot >= 0)
        src = row + (HQ + HKV) * D + heads * D
        dst = v_cache_ptr + slot * stride_slot + heads * D
        tl.store(dst + d, tl.load(src + d, mask=mask), mask=mask)
        tl.store(dst + HALF + d, tl.load(src + HALF + d, mask=mask), mask=mask)
    else:
        is_q = hb < Q_BLOCKS
        heads = (hb - tl.where(is_q, 0, Q_BLOCKS)) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
        mask = heads < tl.where(is_q, HQ, HKV)
        src = row + tl.where(is_q, 0, HQ * D) + heads * D
        x1 = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + d, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            if is_q:  # noqa: SIM108 (a runtime branch: no conditional expression in Triton)
                w_ptr = qw_ptr
            else:
                w_ptr = kw_ptr
            ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
            rstd = (1.0 / tl.sqrt(ss / D + eps))[:, None]
            # Normalised, rounded to the model's dtype, weighted (a product of two 16-bit
            # values is exact in fp32), rounded again: the norm's output.
            w1 = tl.load(w_ptr + d).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + d).to(tl.float32)
            x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        pos = tl.load(pos_ptr + t)
        c = tl.load(cos_ptr + pos * stride_table + d)
        s = tl.load(sin_ptr + pos * stride_table + d)
        o1 = (x1 * c - x2 * s).to(dtype)
        o2 = (x2 * c + x1 * s).to(dtype)
        if is_q:
            dst = q_out_ptr + t * (HQ * D) + heads * D
        else:
            dst = k_cache_ptr + slot * stride_slot + heads * D
            mask = mask & (slot >= 0)
        tl.store(dst + d, o1, mask=mask)
        tl.store(dst + HALF + d, o2, mask=mask)


def supported(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
              cos: torch.Tensor, k_cache: torch.Tensor) -> bool:
    half = head_dim // 2
    return (qkv.is_cuda and qkv.dim() == 2 and qkv.dtype in _SUPPORTED and qkv.stride(1) == 1
            and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
            and half >= 1 and half & (half - 1) == 0 and head_dim == 2 * half
            and cos.dtype == torch.float32 and cos.stride(-1) == 1 and cos.shape[-1] == half
            and k_cache.dtype == qkv.dtype and k_cache.is_contiguous()
            and tuple(k_cache.shape[2:]) == (num_kv_heads, head_dim))


def norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, q_weight: torch.Tensor | None,
                    k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                    num_kv_heads: int) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] (rows may be strided), positions [T], cos/sin tables
    [max_positions, D / 2] fp32, q/k norm weights [D] (both None: no q/k norm), caches
    [num_blocks, block_size, Hkv, D], slot_mapping [T] -> q [T, Hq, D], normed and rotated;
    k (normed, rotated) and v are written to their slots."""
    t = qkv.shape[0]
    head_dim = cos.shape[-1] * 2
    q_out = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q_out
    has_norm = q_weight is not None
    if has_norm != (k_weight is not None):
        raise ValueError("norm_rope_store: q and k norm weights come together")
    q_w = q_weight if has_norm else cos  # unread without the norm
    k_w = k_weight if has_norm else cos
    blocks = triton.cdiv(num_heads, BLOCK_H) + 2 * triton.cdiv(num_kv_heads, BLOCK_H)
    _qkv_kernel[(t, blocks)](
        qkv, q_out, k_cache, v_cache, positions, slot_mapping, cos, sin, q_w, k_w,
        qkv.stride(0), k_cache.stride(1), cos.stride(0), eps, HQ=num_heads, HKV=num_kv_heads,
        HALF=head_dim // 2, BLOCK_H=BLOCK_H, HAS_NORM=has_norm, num_warps=NUM_WARPS,
        enable_fp_fusion=False, **pdl.options(qkv))
    return q_out
