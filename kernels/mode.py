"""`set_batch_invariant_mode()`: run any PyTorch model's reductions through the kernels API.

Inside the context, aten mm, addmm, bmm (so nn.Linear, F.linear and torch.matmul, which
decompose into them), _log_softmax and mean.dim go to `kernels.matmul` / `kernels.log_softmax`,
which dispatch by device (Triton on CUDA, the CPU implementation on CPU). Everything else runs
unchanged. Leaving the context restores the normal kernels.

The routing is a TorchDispatchMode rather than a process-wide `torch.library` registration:
- it is re-entrant: while an override runs, the mode is off, so an implementation that itself
  calls torch.mm (the CPU path does) reaches the real aten kernel instead of recursing;
- it sees the ops under `torch.inference_mode()` too (it sits below autograd);
- it is scoped to the thread that entered it and undone on exit, even by an exception.
Ops outside what the kernels accept (other dtypes, alpha/beta scaling folded in pointwise)
still run in a batch-invariant way or fall through to aten unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_SUM_COLUMNS = 8
aten = torch.ops.aten


def _kernels():
    # Late import: kernels/__init__ exports this module's context manager.
    import kernels

    return kernels


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    if a.dtype not in _FLOATS or b.dtype != a.dtype:
        return None
    return _kernels().matmul(a, b)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta=1, alpha=1
           ) -> torch.Tensor | None:
    if a.dtype not in _FLOATS or b.dtype != a.dtype or bias.dtype != a.dtype:
        return None
    n = b.shape[1]
    if beta == 1 and alpha == 1 and bias.numel() == n and bias.shape[-1] == n:
        return _kernels().matmul(a, b, bias.reshape(n))
    # General form: the product is the invariant part; scaling and adding are pointwise.
    prod = _kernels().matmul(a, b)
    if alpha != 1:
        prod = prod * alpha
    return prod + bias * beta if beta != 0 else prod


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    if a.dtype not in _FLOATS or b.dtype != a.dtype:
        return None
    # One matmul per batch entry: each entry's rows reduce exactly as a lone matmul would.
    return torch.stack([_kernels().matmul(a[i], b[i]) for i in range(a.shape[0])]) \
        if a.shape[0] else a.new_empty((0, a.shape[1], b.shape[2]))


def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor | None:
    if x.dtype not in _FLOATS:
        return None
    out = _kernels().log_softmax(x, dim)  # fp32
    return out if half_to_float or x.dtype == torch.float32 else out.to(x.dtype)


def _mean_dim(x: torch.Tensor, dim=None, keepdim: bool = False, dtype=None
              ) -> torch.Tensor | None:
    out_dtype = dtype or x.dtype
    if x.dtype not in _FLOATS or out_dtype not in _FLOATS:
        return None
    dims = sorted({d % x.dim() for d in dim}) if dim else list(range(x.dim()))
    kept = [d for d in range(x.dim()) if d not in dims]
    length = 1
    for d in dims:
        length *= x.shape[d]
    rows = x.permute(*kept, *dims).reshape(-1, length).to(torch.float32)
    # The sum of each row is a fp32 matmul with ones: one fixed K order per row, whatever the
    # number of rows. Eight columns, not one: a single column takes GEMV paths on CPU (not
    # invariant) and gives 4-byte output rows that TMA cannot address on GPU.
    ones = torch.ones((length, _SUM_COLUMNS), dtype=torch.float32, device=x.device)
    total = _kernels().matmul(rows, ones)[:, 0] if length else rows.new_zeros(rows.shape[0])
    mean = (total / length).to(out_dtype)
    shape = [1 if d in dims else x.shape[d] for d in range(x.dim())] if keepdim \
        else [x.shape[d] for d in kept]
    return mean.reshape(shape)


_OVERRIDES = {
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.bmm.default: _bmm,
    aten._log_softmax.default: _log_softmax,
    aten.mean.dim: _mean_dim,
}


class BatchInvariantMode(TorchDispatchMode):
    """Routes the reducing aten ops to the kernels API; everything else runs as usual."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        override = _OVERRIDES.get(func)
        if override is not None:
            out = override(*args, **kwargs)
            if out is not None:
                return out
            return func(*args, **kwargs)
        # Under inference_mode, composite ops (linear, matmul, log_softmax.int, einsum...)
        # arrive whole: decompose them, as autograd would, so their mm/addmm/_log_softmax
        # come back through this mode.
        with self:
            out = func.decompose(*args, **kwargs)
        return func(*args, **kwargs) if out is NotImplemented else out


@contextlib.contextmanager
def set_batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Context manager: inside it (if `enabled`), matmuls, log_softmax and mean are
    batch-invariant. `enabled=False` makes it a no-op, for the negative control."""
    if not enabled:
        yield
        return
    with BatchInvariantMode():
        yield
