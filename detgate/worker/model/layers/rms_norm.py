"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from detgate.worker.model.ops import Ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: Ops, dtype: torch.dtype) -> None:
        super().__init__()
        self.ops = ops
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
