"""A tl.dot for Triton's interpreter with one summation order per element.

The interpreter's tl.dot is numpy's matmul (OpenBLAS), which gives a row other bits depending
on where it sits in the tile; a GPU's MMA does not (the GPU tests check that). With this
product the interpreter tests check the kernels' own reduction order (tiles, splits, masks,
merges): each element is one fixed-order sum of its chunk, added to the accumulator. bf16
operands (kept as raw uint16 by the interpreter) are taken at their exact fp32 values.
"""

from __future__ import annotations

import contextlib

import numpy as np
import triton.language as tl
from triton.runtime import interpreter


def _values(h) -> np.ndarray:
    if h.dtype.scalar == tl.bfloat16:
        return (h.data.astype(np.uint32) << 16).view(np.float32)
    return h.data.astype(np.float32)


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    product = (_values(a)[:, :, None] * _values(b)[None, :, :]).sum(axis=1, dtype=np.float32)
    return interpreter.TensorHandle(product + d.data, d.dtype.scalar)


@contextlib.contextmanager
def fixed_order_dot():
    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    builder.create_dot = _create_dot
    try:
        yield
    finally:
        builder.create_dot = original
