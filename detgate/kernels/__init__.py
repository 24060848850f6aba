"""Batch-invariant kernels: one reduction order per output element, whatever the batch.

Each op dispatches on the device of its first tensor: CPU tensors go to `kernels.cpu`, CUDA
tensors to the Triton kernels (imported on first use, so this package imports without triton).
"""

from __future__ import annotations

import functools
from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["add_rms_norm", "log_softmax", "matmul", "rms_norm", "set_batch_invariant_mode",
           "silu_and_mul"]

# op name -> module holding its CUDA (Triton) implementation, under the same name.
_CUDA_MODULES = {
    "matmul": "detgate.kernels.matmul_triton",
    "rms_norm": "detgate.kernels.rmsnorm_triton",
    "add_rms_norm": "detgate.kernels.rmsnorm_triton",
    "log_softmax": "detgate.kernels.log_softmax_triton",
    "silu_and_mul": "detgate.kernels.activation_triton",
}


@functools.cache
def _attr(module: str, name: str):
    return getattr(import_module(module), name)


def by_device(x: torch.Tensor, name: str, cuda_module: str, cpu_module: str):
    """`name` from cuda_module or cpu_module, by x's device. On every eager call's host path:
    `is_cuda` / `is_cpu` are flag reads, where `x.device` builds a device object and
    import_module walks importlib (2-6 us a call on an H200 host, against a decode-sized
    matmul's 12-18 us on the GPU)."""
    if x.is_cuda:
        return _attr(cuda_module, name)
    if x.is_cpu:
        return _attr(cpu_module, name)
    raise NotImplementedError(f"{name}: no kernel for device {x.device}")


def _impl(name: str, x: torch.Tensor):
    return by_device(x, name, _CUDA_MODULES[name], "detgate.kernels.cpu")


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]); row i's bits do not depend on M."""
    return _impl("matmul", a)(a, b, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, one fixed reduction order per row."""
    return _impl("rms_norm", x)(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    return _impl("add_rms_norm", x)(x, residual, weight, eps)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """log_softmax computed in fp32, one fixed reduction order per row."""
    return _impl("log_softmax", x)(x, dim)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = (gate | up) -> silu(gate) * up [..., I], the same bits for an element
    wherever it sits (pointwise, one exp and one division per element). CUDA: one Triton
    launch, bit for bit torch's F.silu(gate) * up; CPU: ours, since torch's vectorised body and
    scalar tail compute exp differently."""
    return _impl("silu_and_mul", x)(x)


def set_batch_invariant_mode(enabled: bool = True):
    """Context manager routing aten matmuls, _log_softmax and mean.dim through these kernels."""
    return import_module("detgate.kernels.mode").set_batch_invariant_mode(enabled)
