"""Quantised weights as a GGUF file stores them (Q8_0, Q4_0, Q4_1), for the CPU matmul.

A weight [N, K] is N rows of K / 32 blocks; `QuantisedWeight` holds those bytes untouched
(uint8 [N, K / 32 * block bytes]) and the ggml type that says how to read them.
`kernels.cpu.matmul_quantised` reads them in place and gives, bit for bit, what
`kernels.cpu.matmul` gives on the dequantised fp32 weight (the argument is in the C++ source,
above `matmul_quantised`). `dequantise` below is the pure-torch reference of the dequantisation:
the formulas of gguf's and llama.cpp's, evaluated in fp32 the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block, all three types
# ggml type name -> (ggml type id, bytes per block)
TYPES = {"Q8_0": (8, 2 + BLOCK), "Q4_0": (2, 2 + BLOCK // 2), "Q4_1": (3, 4 + BLOCK // 2)}


@dataclass(frozen=True)
class QuantisedWeight:
    """A weight [N, K] as GGUF blocks: blocks uint8 [N, K / 32 * bytes per block]."""

    blocks: torch.Tensor
    qtype: str  # a key of TYPES
    k: int

    def __post_init__(self) -> None:
        if self.qtype not in TYPES:
            raise ValueError(f"quantised weight: unsupported type {self.qtype!r} "
                             f"(supported: {', '.join(TYPES)})")
        if (self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or self.k % BLOCK
                or self.blocks.shape[1] != self.k // BLOCK * TYPES[self.qtype][1]):
            raise ValueError(f"quantised weight: blocks {tuple(self.blocks.shape)} "
                             f"{self.blocks.dtype} do not hold {self.qtype} rows of K={self.k}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.k

    @property
    def type_id(self) -> int:
        return TYPES[self.qtype][0]

    def narrow(self, start: int, rows: int) -> QuantisedWeight:
        """Rows [start, start + rows) of the weight (a view)."""
        return QuantisedWeight(self.blocks.narrow(0, start, rows), self.qtype, self.k)


def dequantise(w: QuantisedWeight) -> torch.Tensor:
    """The fp32 weight [N, K] the blocks stand for (reference; the kernels have their own)."""
    n, k = w.shape
    blocks = w.blocks.reshape(n * (k // BLOCK), -1)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [B, 1], exact
    if w.qtype == "Q8_0":
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        return (q * d).reshape(n, k)
    qs = blocks[:, 4:] if w.qtype == "Q4_1" else blocks[:, 2:]
    q = torch.cat([qs & 15, qs >> 4], dim=1).float()  # element j < 16: low nibble of byte j
    if w.qtype == "Q4_0":
        return (d * (q - 8)).reshape(n, k)
    m = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return (d * q + m).reshape(n, k)  # two roundings' worth: d * q is exact, + m rounds once
