"""Batch-invariant log_softmax in Triton (for logits: rows of a vocabulary, V up to ~256k).

Invariant: a row is cut into chunks of CHUNK positions, a size fixed in this file, never a
number of chunks. `_chunk_stats_kernel` gives each (row, chunk) one program: it reads its chunk
in steps of BLOCK, in order, into per-lane running max and running sum-of-exp (online
softmax), then combines the lanes by one fixed tree into the chunk's (max, sum). Then
`_chunk_write_kernel`, again one program per (row, chunk), combines the row's chunk results by
one fixed tree into the row's logsumexp (every program of a row computes it from the same
values with the same code, so they agree) and writes x - logsumexp for its chunk. Chunks,
steps and trees depend on V only, never on the number of rows. Computed in fp32; the result is
fp32 whatever the input dtype. The lane tree is the compiled layout's, which Triton picks from
the input's element size: a bf16 row and its fp32 copy may differ in the last bit (3 rows of
257 on an H200), while rows of one dtype never depend on the batch. The engine feeds the
lm_head's bf16 logits as they are, sampled and scored rows alike.

Why chunks: one program per row left a decode step's few rows of 151,936 logits to a few SMs
(35 us for one row on an H200, 70 us for 64); the chunks spread a row over ~19 programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detgate.kernels import pdl
from detgate.kernels.triton_launch import Launcher, Unsupported, raw_stream

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
CHUNK = 8192  # positions per program (a multiple of BLOCK)
BLOCK = 2048  # lanes: positions read per step
NUM_WARPS = 8


@triton.jit
def _chunk_stats_kernel(x_ptr, stats_ptr, V, stride_x, num_chunks, CHUNK: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    x_row = x_ptr + row * stride_x
    offs = tl.arange(0, BLOCK)
    run_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK,), tl.float32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        mask = start + offs < V
        x = tl.load(x_row + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, x)
        # Lanes that have seen only -inf keep a zero sum (avoid inf - inf).
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(x - safe)
        run_max = new_max
    chunk_max = tl.max(run_max, axis=0)
    chunk_sum = tl.sum(tl.where(run_max == float("-inf"), 0.0,
                                run_sum * tl.exp(run_max - chunk_max)), axis=0)
    stats = stats_ptr + (row * num_chunks + chunk) * 2
    tl.store(stats, chunk_max)
    tl.store(stats + 1, chunk_sum)


@triton.jit
def _chunk_write_kernel(x_ptr, stats_ptr, out_ptr, V, stride_x, stride_out, num_chunks,
                        CHUNK: tl.constexpr, BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr,
                        PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cs = tl.arange(0, CHUNKS_PAD)
    stats = stats_ptr + row * num_chunks * 2 + cs * 2
    maxes = tl.load(stats, mask=cs < num_chunks, other=float("-inf"))
    sums = tl.load(stats + 1, mask=cs < num_chunks, other=0.0)
    row_max = tl.max(maxes, axis=0)
    total = tl.sum(tl.where(maxes == float("-inf"), 0.0, sums * tl.exp(maxes - row_max)), axis=0)
    lse = row_max + tl.log(total)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    offs = tl.arange(0, BLOCK)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        mask = start + offs < V
        x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + start + offs, x - lse, mask=mask)


# (device, dtype, V, CHUNK, BLOCK) -> (stats Launcher, write Launcher); the fast path takes
# contiguous rows, aligned.
_LAUNCHERS: dict[tuple, tuple[Launcher, Launcher] | None] = {}


def _shape(v: int) -> tuple[int, int, int, int]:
    """(chunk, block, chunks, chunks padded to a power of two) for rows of v."""
    key = (v, CHUNK, BLOCK)
    shape = _SHAPES.get(key)
    if shape is None:
        block = min(BLOCK, triton.next_power_of_2(v))
        chunk = max(CHUNK, block)
        chunks = triton.cdiv(v, chunk)
        shape = _SHAPES[key] = (chunk, block, chunks, triton.next_power_of_2(chunks))
    return shape


_SHAPES: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}


def _launch_fast(rows: torch.Tensor, stats: torch.Tensor, out: torch.Tensor,
                 shape: tuple[int, int, int, int]) -> bool:
    n_rows, v = rows.shape
    x_ptr = rows.data_ptr()
    if x_ptr % 16 or rows.stride(0) != v:
        return False
    device = rows.get_device()
    chunk, block, chunks, chunks_pad = shape
    key = (device, rows.dtype, v, chunk, block)
    launchers = _LAUNCHERS.get(key, False)
    if launchers is False:
        on = pdl.on(rows)
        try:
            launchers = (
                Launcher(_chunk_stats_kernel, (n_rows, chunks),
                         (rows, stats, v, v, chunks, chunk, block, on), num_warps=NUM_WARPS,
                         launch_pdl=on),
                Launcher(_chunk_write_kernel, (n_rows, chunks),
                         (rows, stats, out, v, v, v, chunks, chunk, block, chunks_pad, on),
                         num_warps=NUM_WARPS, launch_pdl=on))
        except Unsupported:
            launchers = None
        _LAUNCHERS[key] = launchers
    if launchers is None:
        return False
    stream, stats_ptr = raw_stream(device), stats.data_ptr()
    launchers[0](n_rows, chunks, 1, stream, x_ptr, stats_ptr, v, v, chunks)
    launchers[1](n_rows, chunks, 1, stream, x_ptr, stats_ptr, out.data_ptr(), v, v, v, chunks)
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
    if not (n_rows and v):
        out = torch.empty((n_rows, v), dtype=torch.float32, device=x.device)
    else:
        shape = chunk, block, chunks, chunks_pad = _shape(v)
        # One allocation for the result and the chunk statistics behind it (16-byte aligned):
        # an eager call on a few rows is bound by its host work.
        size = -(-n_rows * v // 4) * 4
        buf = torch.empty(size + n_rows * chunks * 2, dtype=torch.float32, device=x.device)
        out, stats = buf[:n_rows * v].view(n_rows, v), buf[size:]
        if not (rows.is_cuda and _launch_fast(rows, stats, out, shape)):
            grid = (n_rows, chunks)
            launch = pdl.options(rows)
            _chunk_stats_kernel[grid](rows, stats, v, rows.stride(0), chunks, CHUNK=chunk,
                                      BLOCK=block, num_warps=NUM_WARPS, **launch)
            _chunk_write_kernel[grid](rows, stats, out, v, rows.stride(0), out.stride(0), chunks,
                                      CHUNK=chunk, BLOCK=block, CHUNKS_PAD=chunks_pad,
                                      num_warps=NUM_WARPS, **launch)
    out = out.view(moved.shape)
    return out if moved is x else out.movedim(-1, dim)
