"""Batch-invariant CPU kernels (plain torch on top of MKL), measured rather than assumed.

What was measured (torch 2.13 CPU, MKL 2024.2, AVX2), and what each function relies on:

- fp32 `torch.mm`: MKL takes gemv or small-M code paths for M in {1, 2, 3, 5, 6, 7, 9, 10,
  11}, which reduce K in another order. With many threads it splits M among them, and a
  thread's share of such a size takes the same paths (seen at 16 threads: M = 17-19, 25-27
  differ). Row counts that are multiples of 4 give each row the same bits at every M, at any
  row offset, on 1 to 64 threads. So fp32 calls are padded with zero rows to a multiple of 4.
  The cheapest invariant choice: fixed-shape row tiles cost 1.5-10x at prefill sizes, padding
  to 16 rows costs more at M = 1 than padding to 4.
- bf16/fp16 `torch.mm`: on this CPU (no native bf16 dot product) every row is reduced on
  its own, so rows are invariant at every M without padding (and padding would cost in
  proportion to the added rows).
- Bias: added after the product (addmm would start the K reduction from the bias).
- Row reductions (`sum`/`mean` over the last dim) run whole rows on one thread, except when
  the iterator has fewer outer rows than threads and enough elements to parallelise: then it
  splits the row itself (seen: a single 151936-wide row). `_row_sum` reduces in two fixed
  levels whose inner level is short, so no row is ever split, whatever the thread count.
- `torch.log_softmax` over the last dim uses a kernel that gives each row to one thread and
  reduces it in one vectorised order: invariant by construction (checked up to V = 151936).
"""

from __future__ import annotations

import math

import torch

# MKL's fp32 GEMM gives each row the same bits at every row count that is a multiple of this.
_ROW_MULTIPLE = 4
# Inner chunk of the two-level row sum: short enough that no iterator splits it.
_ROW_CHUNK = 64


def invariant_rows(m: int) -> int:
    """Row count to hand MKL's fp32 GEMM so that each row's bits do not depend on `m`."""
    return -(-m // _ROW_MULTIPLE) * _ROW_MULTIPLE


def pad_rows(x: torch.Tensor, rows: int, dim: int = -2) -> torch.Tensor:
    """`x` with zero rows appended along `dim` up to `rows`."""
    extra = rows - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) -> [M, N] in a's dtype; row i's bits never depend on M.

    `b` may be `W.t()` of an nn.Linear weight: MKL reads the transposed layout, no copy.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: bad shapes {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"matmul: dtypes differ: {a.dtype} vs {b.dtype}")
    m = a.shape[0]
    if a.dtype == torch.float32 and m % _ROW_MULTIPLE:
        out = torch.mm(pad_rows(a, invariant_rows(m)), b)[:m]
    else:
        out = torch.mm(a, b)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


def _row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim, keepdim, in one order per row whatever the number of rows."""
    h = x.shape[-1]
    chunk = math.gcd(h, _ROW_CHUNK)
    return x.unflatten(-1, (h // chunk, chunk)).sum(-1).sum(-1, keepdim=True)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> weight * (x / rms(x)) with the statistics in fp32, result in x's dtype."""
    xf = x.float()
    mean_sq = _row_sum(xf * xf) / xf.shape[-1]
    return weight * (xf * torch.rsqrt(mean_sq + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum taken in x's dtype."""
    new_residual = x + residual.to(x.dtype)
    return rms_norm(new_residual, weight, eps), new_residual


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log_softmax in fp32 (bf16/fp16 input is widened first); fp32 result."""
    return torch.log_softmax(x.float(), dim=dim)
