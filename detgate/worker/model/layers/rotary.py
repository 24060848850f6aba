"""Rotary position embedding from a precomputed table, so a position's rotation is one fixed
row whatever the batch, the chunking or the device that computed the table.

The table's transcendental functions (pow, cos, sin) come from the C library through Python's
math module, never from torch's vectorised kernels: torch computes them with SLEEF or libm by
its CPU capability, and its float64 pow gave other bits under its default and AVX2 kernels
(rope theta 1e6, measured), which would tie the table to a CPU family. libm's version and
instruction-set class are in the worker's fingerprint (worker/model/numerics.py)."""

from __future__ import annotations

import math
from importlib import import_module

import torch
from torch import nn

from detgate.worker.model.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """[head_dim / 2] float64 on the CPU (pow from libm; the rest one IEEE operation each)."""
    inv_freq = torch.tensor([1.0 / math.pow(theta, i / head_dim) for i in range(0, head_dim, 2)],
                            dtype=torch.float64, device="cpu")
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # Llama 3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (the two halves of each head), as Qwen and Llama checkpoints expect."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None
    ) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        # One IEEE product per angle, [max_positions, head_dim / 2] float64.
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64, device="cpu"),
                             inv_freq)
        device = torch.get_default_device()
        # cos and sin in float64 from libm, rounded once to float32.
        for name, fn in (("cos", math.cos), ("sin", math.sin)):
            table = torch.tensor(list(map(fn, angles.view(-1).tolist())), dtype=torch.float64,
                                 device="cpu")
            self.register_buffer(name, table.view(angles.shape).to(device=device,
                                 dtype=torch.float32), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]
        if q.is_cuda:  # the same arithmetic, bit for bit, in one launch instead of ~16
            fused = import_module("detgate.kernels.rotary_triton")
            if fused.supported(q, k, self.cos):
                return fused.rotary(positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
