"""SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up in one matmul."""

from __future__ import annotations

import torch
from torch import nn

from detgate.worker.model.config import ModelConfig
from detgate.worker.model.layers.linear import Linear
from detgate.worker.model.ops import Ops


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, [size, size], ops, config.dtype)
        self.down_proj = Linear(size, [config.hidden_size], ops, config.dtype)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
