"""Linear layers whose matmul goes through the model's ops (plain torch or batch-invariant)."""

from __future__ import annotations

import torch
from torch import nn

from detgate.kernels.quantised import QuantisedWeight
from detgate.worker.model.ops import Ops


class Linear(nn.Module):
    """y = x W^T + b. Weights are left uninitialised: the loader (or make-model) fills them.

    `shard_sizes` lists the output widths of the checkpoint tensors packed into this one (q, k, v
    or gate, up): one wider matmul instead of several, with the same per-element reduction.
    `quantised`, when set (worker/model/quantised_weights.py), holds the same weight as GGUF
    blocks, which the matmul then reads instead of `weight`: the same bits, fewer bytes read.
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: list[int],
        ops: Ops,
        dtype: torch.dtype,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.shard_sizes = list(shard_sizes)
        out_features = sum(shard_sizes)
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)
            if bias
            else None
        )
        self.quantised: QuantisedWeight | None = None

    def shard_offset(self, index: int) -> tuple[int, int]:
        """(start, size) of checkpoint shard `index` along the output dimension."""
        return sum(self.shard_sizes[:index]), self.shard_sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.quantised is None else self.quantised
        return self.ops.linear(x, weight, self.bias)
