"""Batch-invariant log_softmax in Triton (for logits: rows of a vocabulary, V up to ~256k).

Invariant: one program per row; the row is read in fixed chunks of BLOCK, in order, into
per-lane running max and running sum-of-exp (online softmax), then the lanes are combined by one
fixed tree. Chunking and tree depend on V only, never on the number of rows. A second pass
writes x - logsumexp. Computed in fp32; the result is fp32 whatever the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_launch import Launcher, Unsupported, raw_stream

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = 4096


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, V, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    offs = tl.arange(0, BLOCK)
    run_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, V, BLOCK):
        mask = start + offs < V
        x = tl.load(x_row + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, x)
        # Lanes that have seen only -inf keep a zero sum (avoid inf - inf).
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(x - safe)
        run_max = new_max
    row_max = tl.max(run_max, axis=0)
    scale = tl.where(run_max == float("-inf"), 0.0, tl.exp(run_max - row_max))
    lse = row_max + tl.log(tl.sum(run_sum * scale, axis=0))
    for start in range(0, V, BLOCK):
        mask = start + offs < V
        x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + start + offs, x - lse, mask=mask)


# (device, dtype, V, BLOCK) -> Launcher; the fast path takes contiguous rows, aligned.
_LAUNCHERS: dict[tuple, Launcher | None] = {}


def _launch_fast(rows: torch.Tensor, out: torch.Tensor, block: int, num_warps: int) -> bool:
    n_rows, v = rows.shape
    x_ptr = rows.data_ptr()
    if x_ptr % 16 or rows.stride(0) != v:
        return False
    device = rows.get_device()
    key = (device, rows.dtype, v, block)
    launcher = _LAUNCHERS.get(key, False)
    if launcher is False:
        try:
            launcher = Launcher(_log_softmax_kernel, (n_rows,), (rows, out, v, v, v, block),
                                num_warps=num_warps)
        except Unsupported:
            launcher = None
        _LAUNCHERS[key] = launcher
    if launcher is None:
        return False
    launcher(n_rows, 1, 1, raw_stream(device), x_ptr, out.data_ptr(), v, v, v)
    return True


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log_softmax over `dim`, fp32 result (bf16/fp16 inputs are computed in fp32)."""
    if x.dtype not in _SUPPORTED:
        raise TypeError(f"log_softmax supports {_SUPPORTED}, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("log_softmax wants at least one dimension")
    moved = x.movedim(dim, -1) if dim not in (-1, x.dim() - 1) else x
    rows = moved.reshape(-1, moved.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n_rows, v = rows.shape
    out = torch.empty((n_rows, v), dtype=torch.float32, device=x.device)
    if n_rows and v:
        block = min(BLOCK, triton.next_power_of_2(v))
        num_warps = 4 if block <= 1024 else 16
        if not (rows.is_cuda and _launch_fast(rows, out, block, num_warps)):
            _log_softmax_kernel[(n_rows,)](rows, out, v, rows.stride(0), out.stride(0),
                                           BLOCK=block, num_warps=num_warps)
    out = out.view(moved.shape)
    return out if moved is x else out.movedim(-1, dim)
