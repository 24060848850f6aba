"""Negative controls that are batch-variant by construction, on every CPU.

Default mode's batch dependence comes from MKL's and torch's choices on the machine at hand;
a control must find a difference on any machine. `SplitKOps` is batch_invariant mode except
for one op: below 16 rows a matmul reduces K in two halves added afterwards (as a split-K
GEMM chosen by row count does), so the same row gets other bits in a batch of 3 than in one
of 16 on every CPU.
"""

from __future__ import annotations

import torch

from detgate import kernels
from detgate.worker.model.ops import BatchInvariantOps

SPLIT_BELOW_ROWS = 16


class SplitKOps(BatchInvariantOps):
    mode = "split_k_control"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
               ) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] >= SPLIT_BELOW_ROWS:
            return super().linear(x, weight, bias)
        h = rows.shape[1] // 2
        out = kernels.matmul(rows[:, :h], weight[:, :h].t()) \
            + kernels.matmul(rows[:, h:], weight[:, h:].t())
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], weight.shape[0])


def use_ops(model: torch.nn.Module, ops) -> torch.nn.Module:
    """`model` with every module's ops replaced by `ops` (the weights stay)."""
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops
    return model
