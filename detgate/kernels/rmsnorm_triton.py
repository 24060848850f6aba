"""Batch-invariant RMSNorm in Triton, optionally fused with the residual add.

Invariant: one program per row, the whole row in that program, one fixed reduction tree for the
sum of squares (set by BLOCK = next power of two >= H). The row count never changes how a row
is reduced: there is no split reduction for small batches.

`row_sum` is the same kind of reduction on its own (one program per row, fixed chunks in
order, one fixed tree): `set_batch_invariant_mode()` computes aten mean with it on CUDA, the
division folded into the same launch (`row_sum(x, mean=True)`).

Numerics follow the Hugging Face / vLLM RMSNorm: new_residual = x + residual in x's dtype; the
statistics in fp32; the normalised row rounded to x's dtype before the weight multiplies it.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from detgate.kernels import pdl
from detgate.kernels.triton_launch import Launcher, Unsupported, raw_stream

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, H, stride_x, stride_res,
                     stride_out, stride_res_out, eps,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    dtype = out_ptr.dtype.element_ty
    # 16-bit arithmetic runs as fp32 rounded once to x's dtype, as torch computes it.
    xf = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        x = (xf + r).to(dtype)
        tl.store(res_out_ptr + row * stride_res_out + offs, x, mask=mask)
        xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # Normalised row rounded to x's dtype, then weighted (the product of two 16-bit values is
    # exact in fp32, so this equals the 16-bit multiply).
    y = (xf * rstd).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + offs, y.to(dtype), mask=mask)


@triton.jit
def _row_sum_kernel(x_ptr, out_ptr, L, stride_x, scale, BLOCK: tl.constexpr,
                    MEAN: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    # Lane j adds elements j, j + BLOCK, ... in increasing order; then one fixed tree.
    for start in range(0, L, BLOCK):
        mask = start + offs < L
        acc += tl.load(x_ptr + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    if MEAN:  # torch's `total / L` on CUDA: a multiply by the fp32 reciprocal, then the cast
        total = (total * scale).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row, total)


ROW_SUM_BLOCK = 2048


def row_sum(x2: torch.Tensor, mean: bool = False) -> torch.Tensor:
    """x2 [R, L] (fp32/bf16/fp16) -> fp32 [R]: each row's sum in one order set by L alone.

    `mean`: each row's mean in x2's dtype instead, the bits of `(row_sum(x2) / L).to(dtype)`
    as torch computes that division on CUDA (times the fp32 reciprocal of L, rounded once)."""
    if x2.dim() != 2 or x2.dtype not in _SUPPORTED:
        raise ValueError(f"row_sum wants a 2-D float tensor, got {tuple(x2.shape)} {x2.dtype}")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows, length = x2.shape
    out = torch.empty((rows,), dtype=x2.dtype if mean else torch.float32, device=x2.device)
    if rows == 0:
        return out
    fast = x2.is_cuda and x2.stride(0) == length and x2.data_ptr() % 16 == 0
    launch = _row_sum_launch(x2, out, mean) if fast else None
    if launch is not None:
        launcher, scale = launch
        launcher(rows, 1, 1, raw_stream(x2.get_device()), x2.data_ptr(), out.data_ptr(), length,
                 length, scale)
        return out
    block, num_warps, scale = _row_sum_shape(length, mean)
    _row_sum_kernel[(rows,)](x2, out, length, x2.stride(0), scale, BLOCK=block, MEAN=mean,
                             num_warps=num_warps, **pdl.options(x2))
    return out


def mean_last_dim(x: torch.Tensor, keepdim: bool) -> torch.Tensor:
    """x [..., L] (CUDA, contiguous, L > 0) -> its mean over the last dim in x's dtype: the
    bits of `row_sum(x.view(-1, L), mean=True)`, written straight into the result's shape.
    set_batch_invariant_mode routes every RMSNorm's mean of a Hugging Face model here, where
    host time is the forward's cost: one dict lookup, one allocation, one C launch."""
    length = x.shape[-1]
    shape = x.shape[:-1] + (1,) if keepdim else x.shape[:-1]
    launch = _ROW_SUM_LAUNCHERS.get((x.get_device(), x.dtype, length, True))
    if launch is None or x.data_ptr() % 16:
        # compiles and caches the launcher
        return row_sum(x.view(-1, length), mean=True).view(shape)
    out = x.new_empty(shape)
    rows = out.numel()
    if rows:
        launcher, scale = launch
        launcher(rows, 1, 1, raw_stream(x.get_device()), x.data_ptr(), out.data_ptr(), length,
                 length, scale)
    return out


def _row_sum_shape(length: int, mean: bool) -> tuple[int, int, float]:
    """(BLOCK, warps, scale) for rows of `length`."""
    scale = float(np.float32(1.0) / np.float32(length)) if mean and length else 1.0
    block = min(ROW_SUM_BLOCK, triton.next_power_of_2(max(length, 1)))
    return block, 4 if block <= 1024 else 8, scale


def _row_sum_launch(x2: torch.Tensor, out: torch.Tensor, mean: bool
                    ) -> tuple[Launcher, float] | None:
    """The fast path's (Launcher, scale) for x2's device, dtype and row length: found by one
    dict lookup per call (an eager norm's mean is bound by host work: set_batch_invariant_mode
    routes every aten mean here). None where the C launcher is unsupported."""
    key = (x2.get_device(), x2.dtype, x2.shape[1], mean)
    launch = _ROW_SUM_LAUNCHERS.get(key, False)
    if launch is False:
        length = x2.shape[1]
        block, num_warps, scale = _row_sum_shape(length, mean)
        on = pdl.on(x2)
        try:
            launch = (Launcher(_row_sum_kernel, (1,),
                               (x2, out, length, length, scale, block, mean, on),
                               num_warps=num_warps, launch_pdl=on), scale)
        except Unsupported:
            launch = None
        _ROW_SUM_LAUNCHERS[key] = launch
    return launch


# (device, dtype, L, mean) -> (Launcher, scale); the fast path takes rows L apart, aligned.
_ROW_SUM_LAUNCHERS: dict[tuple, tuple[Launcher, float] | None] = {}


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm wants x [..., H] and weight [H], got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    if x.dtype not in _SUPPORTED or weight.dtype != x.dtype:
        raise TypeError(f"rms_norm supports {_SUPPORTED} with weight in x's dtype, "
                        f"got {x.dtype}, {weight.dtype}")
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"rms_norm keeps a whole row in one program: H <= {MAX_HIDDEN}")


def _config(h: int) -> tuple[int, int]:
    block = triton.next_power_of_2(h)
    return block, 4 if block <= 1024 else 8 if block <= 4096 else 16


# (device, dtype, H, has residual, weight aligned) -> Launcher. The fast path takes rows H
# apart and 16-byte aligned pointers only, so each key fixes every specialization.
_LAUNCHERS: dict[tuple, Launcher | None] = {}


def _launch_fast(x2: torch.Tensor, res2: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, out: torch.Tensor, res_out: torch.Tensor | None) -> bool:
    rows, h = x2.shape
    x_ptr, w_ptr = x2.data_ptr(), weight.data_ptr()
    res_ptr = res2.data_ptr() if res2 is not None else x_ptr
    if (x_ptr | res_ptr) % 16 or x2.stride(0) != h or (res2 is not None and res2.stride(0) != h):
        return False
    device = x2.get_device()
    key = (device, x2.dtype, h, res2 is not None, w_ptr % 16 == 0)
    launcher = _LAUNCHERS.get(key, False)
    if launcher is False:
        block, num_warps = _config(h)
        res_arg = res2 if res2 is not None else x2
        on = pdl.on(x2)
        try:
            launcher = Launcher(_rms_norm_kernel, (rows,), (
                x2, res_arg, weight, out, res_out if res_out is not None else out, h, h,
                h if res2 is not None else 0, h, h if res_out is not None else 0, eps,
                block, res2 is not None, on), num_warps=num_warps, launch_pdl=on)
        except Unsupported:
            launcher = None
        _LAUNCHERS[key] = launcher
    if launcher is None:
        return False
    out_ptr = out.data_ptr()
    if res2 is None:
        launcher(rows, 1, 1, raw_stream(device), x_ptr, x_ptr, w_ptr, out_ptr, out_ptr, h, h, 0,
                 h, 0, eps)
    else:
        launcher(rows, 1, 1, raw_stream(device), x_ptr, res_ptr, w_ptr, out_ptr,
                 res_out.data_ptr(), h, h, h, h, h, eps)
    return True


def _launch(x2: torch.Tensor, res2: torch.Tensor | None, weight: torch.Tensor, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, h = x2.shape
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if res2 is not None else None
    if rows == 0:
        return out, res_out
    if x2.is_cuda and _launch_fast(x2, res2, weight, eps, out, res_out):
        return out, res_out
    block, num_warps = _config(h)
    _rms_norm_kernel[(rows,)](
        x2, res2 if res2 is not None else x2, weight, out,
        res_out if res_out is not None else out, h, x2.stride(0),
        res2.stride(0) if res2 is not None else 0, out.stride(0),
        res_out.stride(0) if res_out is not None else 0, eps,
        BLOCK=block, HAS_RESIDUAL=res2 is not None, num_warps=num_warps, **pdl.options(x2))
    return out, res_out


def _rows(t: torch.Tensor) -> torch.Tensor:
    if t.dim() == 2 and t.stride(1) == 1:  # the engine's [T, H]: no view to build per call
        return t
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> RMSNorm(x) * weight, same shape and dtype."""
    _check(x, weight)
    out, _ = _launch(_rows(x), None, weight.contiguous(), eps)
    return out if x.dim() == 2 else out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual), the sum in x's dtype."""
    _check(x, weight)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"residual must match x: {tuple(residual.shape)} {residual.dtype}")
    out, res_out = _launch(_rows(x), _rows(residual), weight.contiguous(), eps)
    if x.dim() == 2:
        return out, res_out
    return out.view(x.shape), res_out.view(x.shape)
