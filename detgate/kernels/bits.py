"""The contract's bit rule (detgate/contract/compare.py) for tensors: two tensors are the same
numbers when their bit patterns are, so -0.0 differs from 0.0 and a NaN equals the same NaN
(`torch.equal` says the opposite of both). Every "bitwise" check of kernels, models, tests and
benchmarks goes through `same_bits`."""

from __future__ import annotations

import torch

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_pattern(x: torch.Tensor) -> torch.Tensor:
    """x's elements as integers of the same width (a view of a contiguous copy)."""
    return x.contiguous().view(_INTS[x.element_size()]) if x.is_floating_point() else x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, same dtype and equal bit patterns."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(bit_pattern(a), bit_pattern(b))
