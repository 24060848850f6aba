"""`set_batch_invariant_mode()`: run any PyTorch model's reductions through the kernels API.

Inside the context, aten mm, addmm, bmm (so nn.Linear, F.linear and torch.matmul, which
decompose into them), _log_softmax and mean.dim go to `kernels.matmul` / `kernels.log_softmax`,
which dispatch by device (Triton on CUDA, the CPU implementation on CPU); a CUDA mean is a
fixed-order row sum (`kernels.rmsnorm_triton.row_sum`), a CPU one a matmul with ones.
Everything else runs unchanged. Leaving the context restores the normal kernels.

The routing is a `torch.library` registration of those five ops for the CPU and CUDA keys,
made when the first thread enters the context and removed when the last one leaves. Only the
routed ops pay for a Python call: a TorchDispatchMode would run Python for every op of the
model (views, adds, rotary embeddings...), 3-4x an eager forward at small batch. Still:
- it is scoped to the thread that entered it: other threads, and a routed op called while an
  override runs (the CPU path may call torch.mm), reach the normal kernel (the op's out=
  variant, a separate registration that this one does not replace), so nothing recurses;
- it sees the ops under `torch.inference_mode()` too (they are registered below autograd);
- it is undone on exit, even by an exception.
Ops outside what the kernels accept (other dtypes, alpha/beta scaling folded in pointwise)
still run in a batch-invariant way or fall through to the normal kernel unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Iterator
from importlib import import_module

import torch

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_SUM_COLUMNS = 8
_DEVICE_KEYS = ("CPU", "CUDA")
aten = torch.ops.aten


class _ThreadState(threading.local):
    depth = 0  # contexts this thread is inside
    routing = False  # depth > 0 and no override running on this thread


_STATE = _ThreadState()
_LOCK = threading.Lock()
_library: torch.library.Library | None = None
_threads_inside = 0
# (length, device) -> ones [length, _SUM_COLUMNS] fp32, the right operand of every CPU mean.
_ONES: dict[tuple[int, torch.device], torch.Tensor] = {}


@functools.cache
def _kernels():
    # Late import: kernels/__init__ exports this module's context manager. Cached: a
    # `from ... import` in a function runs importlib's fromlist handling on every routed call.
    return import_module("detgate.kernels")


@functools.cache
def _rmsnorm_triton():
    # Resolved once: import_module costs microseconds on every call of an eager mean.
    return import_module("detgate.kernels.rmsnorm_triton")


@functools.cache
def _matmul_triton():
    return import_module("detgate.kernels.matmul_triton")


def _matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None
            ) -> torch.Tensor:
    """kernels.matmul; a CUDA call marked host-bound: a model run in this mode launches one op
    at a time, so the Triton launch serves where cuBLASLt would (matmul_triton.matmul's
    host_bound; the same bits either way)."""
    if a.is_cuda:
        return _matmul_triton().matmul(a, b, bias, host_bound=True)
    return _kernels().matmul(a, b, bias)


def _outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A product over K = 1 (a rotary embedding's positions x frequencies): each element is
    one product rounded once, with no sum whose order could depend on the batch, so the
    broadcast multiply gives the bits any matmul does (a zero-padded dot adds exact zeros)
    without a launch per batch entry."""
    return a * b


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    if a.dtype not in _FLOATS or b.dtype != a.dtype:
        return None
    if a.shape[1] == 1:
        return _outer(a, b)
    return _matmul(a, b)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta=1, alpha=1
           ) -> torch.Tensor | None:
    if a.dtype not in _FLOATS or b.dtype != a.dtype or bias.dtype != a.dtype:
        return None
    n = b.shape[1]
    if beta == 1 and alpha == 1 and bias.numel() == n and bias.shape[-1] == n:
        return _matmul(a, b, bias.reshape(n))
    # General form: the product is the invariant part; scaling and adding are pointwise.
    prod = _matmul(a, b)
    if alpha != 1:
        prod = prod * alpha
    return prod + bias * beta if beta != 0 else prod


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    if a.dtype not in _FLOATS or b.dtype != a.dtype:
        return None
    if a.shape[2] == 1:
        return _outer(a, b)
    # One matmul per batch entry: each entry's rows reduce exactly as a lone matmul would.
    return torch.stack([_matmul(a[i], b[i]) for i in range(a.shape[0])]) \
        if a.shape[0] else a.new_empty((0, a.shape[1], b.shape[2]))


def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor | None:
    if x.dtype not in _FLOATS:
        return None
    out = _kernels().log_softmax(x, dim)  # fp32
    return out if half_to_float or x.dtype == torch.float32 else out.to(x.dtype)


def _mean_dim(x: torch.Tensor, dim=None, keepdim: bool = False, dtype=None
              ) -> torch.Tensor | None:
    if (dtype is None and x.is_cuda and dim is not None and len(dim) == 1 and x.dim() > 0
            and dim[0] % x.dim() == x.dim() - 1 and x.dtype in _FLOATS and x.is_contiguous()
            and x.shape[-1]):
        # The common case (a norm's mean over the last dim): one launch, the sum and the
        # division of the general path below, bit for bit.
        return _rmsnorm_triton().mean_last_dim(x, keepdim)
    out_dtype = dtype or x.dtype
    if x.dtype not in _FLOATS or out_dtype not in _FLOATS:
        return None
    dims = sorted({d % x.dim() for d in dim}) if dim else list(range(x.dim()))
    kept = [d for d in range(x.dim()) if d not in dims]
    length = 1
    for d in dims:
        length *= x.shape[d]
    trailing = dims == list(range(len(kept), x.dim()))
    rows = (x if trailing else x.permute(*kept, *dims)).reshape(-1, length)
    if not length:
        return torch.full(_mean_shape(x, dims, kept, keepdim), float("nan"), dtype=out_dtype,
                          device=x.device)
    if rows.is_cuda:
        # One program per row, one fixed order set by the length (kernels/rmsnorm_triton.py).
        total = _rmsnorm_triton().row_sum(rows)
    else:
        # The sum of each row is a fp32 matmul with ones: one fixed K order per row, whatever
        # the number of rows. Eight columns, not one: a single column takes GEMV paths on CPU
        # (not invariant).
        key = (length, x.device)
        ones = _ONES.get(key)
        if ones is None:
            ones = _ONES[key] = torch.ones((length, _SUM_COLUMNS), dtype=torch.float32,
                                           device=x.device)
        total = _kernels().matmul(rows.to(torch.float32), ones)[:, 0]
    mean = total / length
    if mean.dtype != out_dtype:
        mean = mean.to(out_dtype)
    return mean.reshape(_mean_shape(x, dims, kept, keepdim))


def _mean_shape(x: torch.Tensor, dims: list[int], kept: list[int], keepdim: bool) -> list[int]:
    return [1 if d in dims else x.shape[d] for d in range(x.dim())] if keepdim \
        else [x.shape[d] for d in kept]


def _empty(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return x.new_empty((0,), dtype=dtype or x.dtype)


# op name -> (override, the normal kernel through the op's out= variant)
_OVERRIDES = {
    "mm": (_mm, lambda a, b: aten.mm.out(a, b, out=_empty(a))),
    "addmm": (_addmm, lambda bias, a, b, beta=1, alpha=1: aten.addmm.out(
        bias, a, b, beta=beta, alpha=alpha, out=_empty(a))),
    "bmm": (_bmm, lambda a, b: aten.bmm.out(a, b, out=_empty(a))),
    "_log_softmax": (_log_softmax, lambda x, dim, half_to_float: aten._log_softmax.out(
        x, dim, half_to_float, out=_empty(x, torch.float32 if half_to_float else x.dtype))),
    "mean.dim": (_mean_dim, lambda x, dim=None, keepdim=False, dtype=None: aten.mean.out(
        x, dim, keepdim, dtype=dtype, out=_empty(x, dtype))),
}


def _routed(override, normal):
    def kernel(*args, **kwargs):
        state = _STATE
        if state.routing:
            state.routing = False  # an op the override itself calls takes the normal kernel
            try:
                out = override(*args, **kwargs)
            finally:
                state.routing = True
            if out is not None:
                return out
        return normal(*args, **kwargs)
    return kernel


def _register() -> torch.library.Library:
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": intended
        warnings.simplefilter("ignore")
        for name, (override, normal) in _OVERRIDES.items():
            for key in _DEVICE_KEYS:
                library.impl(name, _routed(override, normal), key)
    return library


@contextlib.contextmanager
def set_batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Context manager: inside it (if `enabled`), matmuls, log_softmax and mean are
    batch-invariant. `enabled=False` makes it a no-op, for the negative control."""
    global _library, _threads_inside
    if not enabled:
        yield
        return
    state = _STATE
    if state.depth == 0:
        with _LOCK:
            if _threads_inside == 0:
                _library = _register()
            _threads_inside += 1
    state.depth += 1
    outer_routing, state.routing = state.routing, True
    try:
        yield
    finally:
        state.routing = outer_routing
        state.depth -= 1
        if state.depth == 0:
            with _LOCK:
                _threads_inside -= 1
                if _threads_inside == 0:
                    _library._destroy()
                    _library = None
