"""Batch-invariant CPU kernels: our compiled reductions (kernels/csrc/cpu_kernels.cpp) with
the pointwise rest in torch.

Why a row's bits cannot depend on the batch, whatever the CPU:
- Every reduction (the matmul's K, the RMSNorm statistic's hidden size, log_softmax's
  vocabulary, silu's exp) runs in our compiled code, whose order is fixed by the source and
  depends only on the reduction length: 8 lanes, each summing its elements in increasing
  index, then one fixed tree; each output element computed by one thread; IEEE arithmetic
  with no reassociation and no fused multiply-add but the explicit, exactly rounded ones.
  The full argument is at the top of the C++ source. No BLAS is called: MKL and oneDNN pick
  different code paths (gemv, small-M kernels, AMX tiles, per-thread row splits) by the
  number of rows and the CPU, which changed row bits at some row counts on every CPU
  measured (1-12 rows on an AVX-512 Xeon, 1-3 and 5-11 on an AMD EPYC).
- What torch still does here is pointwise with no transcendental function: widening (exact),
  rounding fp32 to bf16 (round to nearest even in every code path), +, *, of two tensors.
  Each of those is one correctly rounded IEEE operation per element, so it gives the same bits
  in torch's vectorised loop body and its scalar tail, for any tensor size and thread split.
- bf16 and fp16 inputs are widened to fp32 (exactly) and reduced in fp32, the result rounded
  once to the input's dtype, as a bf16 GEMM with an fp32 accumulator does.

The compiled build in use (`isa()`) does not change any bit either: the tests compare the
AVX2 build with the portable one.
"""

from __future__ import annotations

import torch

from detgate.kernels.cpu_ext import load
from detgate.kernels.quantised import QuantisedWeight

_REDUCED = (torch.float32, torch.bfloat16)  # weight dtypes the compiled matmul reads as is


def isa() -> str:
    """The instruction set of the compiled kernels this process runs."""
    return load().isa()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., H] as fp32 [R, H] with contiguous rows (a view when it already is one)."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32:
        x2 = x2.float()
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) -> [M, N] in a's dtype; row i's bits never depend on M.

    `b` is read in place when it is `W.t()` of a weight W [N, K] (as nn.Linear stores it) in
    fp32 or bf16; any other layout or dtype is copied into one first.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: bad shapes {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"matmul: dtypes differ: {a.dtype} vs {b.dtype}")
    w = b.t()  # [N, K]
    if w.dtype not in _REDUCED:
        w = w.float()
    if w.stride(-1) != 1:
        w = w.contiguous()
    out = load().matmul(_rows(a), w).to(a.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


def matmul_quantised(a: torch.Tensor, w: QuantisedWeight,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ w.T (+ bias [N]) -> [M, N] in a's dtype, w's GGUF blocks read in place: bit
    for bit `matmul(a, dequantise(w).t())` (fp32 a), so row i's bits never depend on M."""
    if a.dim() != 2 or a.shape[1] != w.k:
        raise ValueError(f"matmul_quantised: bad shapes {tuple(a.shape)} @ {w.shape}^T")
    out = load().matmul_quantised(_rows(a), w.blocks, w.type_id).to(a.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


def dequantise(w: QuantisedWeight) -> torch.Tensor:
    """w's fp32 values [N, K] as the compiled kernels compute them (the matmul's own code)."""
    return load().dequantise(w.blocks, w.type_id, w.k)


def _fp32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 for t in tensors)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] -> weight * (x * inv_rms(x)) with the statistic in fp32, result in x's dtype.
    fp32: one compiled call, the bits of `rms_norm_composed` (each product rounded once, in
    that order: csrc scale_row)."""
    if _fp32(x, weight):
        return load().rms_norm(_rows(x), weight.contiguous(), eps).view(x.shape)
    return rms_norm_composed(x, weight, eps)


def rms_norm_composed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm as the compiled statistic and torch's multiplies: the path of 16-bit inputs,
    and what the fused fp32 call is checked and timed against."""
    xf = x.float()
    inv = load().inv_rms(_rows(xf), eps).view(*x.shape[:-1], 1)
    return weight * (xf * inv).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum taken in x's dtype."""
    if _fp32(x, residual, weight):
        out, new_residual = load().add_rms_norm(_rows(x), _rows(residual),
                                                weight.contiguous(), eps)
        return out.view(x.shape), new_residual.view(x.shape)
    return add_rms_norm_composed(x, residual, weight, eps)


def add_rms_norm_composed(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """add_rms_norm as a torch add and `rms_norm_composed`."""
    new_residual = x + residual.to(x.dtype)
    return rms_norm_composed(new_residual, weight, eps), new_residual


def rotary(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> torch.Tensor | None:
    """Neox rotary of x [T, H, D] at positions [T] from the cos / sin tables [P, D / 2] in one
    compiled call (fp32, heads of D contiguous): the bits of worker/model/layers/rotary.py's
    torch composition. None where it does not apply (the caller runs that composition)."""
    if not (_fp32(x, cos, sin) and x.dim() == 3 and x.stride(2) == 1):
        return None
    return load().rotary(positions.to(torch.int64).contiguous(), x, cos.contiguous(),
                         sin.contiguous())


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log_softmax in fp32 (bf16/fp16 input is widened first); fp32 result."""
    moved = x.movedim(dim, -1)
    out = load().log_softmax(_rows(moved)).view(moved.shape)
    return out.movedim(-1, dim)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim in fp32 (widened first); the same bits on every CPU, where
    torch's own softmax sums in lanes of its vector width (AVX2 and AVX-512 differ)."""
    return load().softmax(_rows(x)).view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = (gate | up) -> silu(gate) * up [..., I] in x's dtype (fp32 inside)."""
    out = load().silu_and_mul(_rows(x))
    return out.view(*x.shape[:-1], x.shape[-1] // 2).to(x.dtype)
