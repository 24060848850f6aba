"""CPU matmul over GGUF blocks (Q8_0, Q4_0, Q4_1): bit for bit the fp32 matmul on the
dequantised weight, at every row count 1..33 (batch invariance), at 1, 2 and all threads, and on
both kernel builds.

Blocks are random bytes with chosen fp16 scales (negative, subnormal, large, zero) rather than
quantised floats only, so every quant value and nibble is met; gguf's own numpy dequantisation
is the reference the fp32 path loads. The negative control: the same K reduced in another order
(its two halves swapped: the same sum in exact arithmetic) must differ in bits, so equality
here is not the comparison failing to see an order change.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from detgate.kernels import cpu
from detgate.kernels.bits import same_bits
from detgate.kernels.cpu_ext import load
from detgate.kernels.quantised import BLOCK, TYPES, QuantisedWeight, dequantise

ROWS = range(1, 34)
# fp16 scales met by the blocks: ordinary, negative, subnormal (2^-24 and 1023 x 2^-24), zero,
# the largest finite.
SCALES = np.array([0.0123, -0.5, 2.0**-24, 1023 * 2.0**-24, 0.0, 65504.0, -3.0e-3],
                  dtype=np.float16)


def random_blocks(qtype: str, n: int, k: int, seed: int = 0) -> QuantisedWeight:
    rng = np.random.default_rng(seed)
    size = TYPES[qtype][1]
    blocks = rng.integers(0, 256, (n * k // BLOCK, size), dtype=np.uint8)
    heads = 2 if qtype == "Q4_1" else 1  # Q4_1: a scale and a minimum
    for h in range(heads):
        picked = SCALES[rng.integers(0, len(SCALES), n * k // BLOCK)]
        # mostly small scales, so that sums stay finite and round
        picked = np.where(rng.random(len(picked)) < 0.9, np.float16(0.01), picked)
        blocks[:, 2 * h:2 * h + 2] = picked.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return QuantisedWeight(torch.from_numpy(blocks.reshape(n, -1)), qtype, k)


def gguf_dequantised(w: QuantisedWeight) -> torch.Tensor:
    qtype = getattr(gguf.GGMLQuantizationType, w.qtype)
    values = gguf.quants.dequantize(w.blocks.numpy(), qtype).reshape(w.shape)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


@pytest.mark.parametrize("qtype", list(TYPES))
def test_dequantisation_equals_gguf(qtype):
    w = random_blocks(qtype, 40, 256)
    expected = gguf_dequantised(w)
    assert same_bits(dequantise(w), expected)  # the pure-torch reference
    for build in ("native", "baseline"):  # F16C and the portable fp16 conversion
        assert same_bits(load(build).dequantise(w.blocks, w.type_id, w.k), expected), build


@pytest.mark.parametrize("qtype", list(TYPES))
@pytest.mark.parametrize("k", [32, 576])
def test_matmul_equals_the_fp32_path_at_every_row_count(qtype, k, threads):
    w = random_blocks(qtype, 67, k, seed=k)  # 67 columns: a whole tile, blocks of 4, singles
    dequantised = gguf_dequantised(w)
    x = torch.randn(max(ROWS) + 3, k, generator=torch.Generator().manual_seed(1))
    full = cpu.matmul_quantised(x, w)
    assert same_bits(full, cpu.matmul(x, dequantised.t()))
    for m in ROWS:
        for off in (0, 3):
            rows = x[off:off + m]
            got = cpu.matmul_quantised(rows, w)
            assert same_bits(got, full[off:off + m]), (m, off)  # batch invariance
            assert same_bits(got, cpu.matmul(rows, dequantised.t())), (m, off)


@pytest.mark.parametrize("qtype", list(TYPES))
def test_thread_count_changes_no_bit(qtype):
    w = random_blocks(qtype, 300, 576, seed=3)  # 5 column tiles
    x = torch.randn(50, 576, generator=torch.Generator().manual_seed(4))  # 2 row tiles
    saved = torch.get_num_threads()
    try:
        results = []
        for n in sorted({1, 2, 3, os.cpu_count() or 1}):  # 3: more threads than tiles' split
            torch.set_num_threads(n)
            results.append(cpu.matmul_quantised(x, w))
    finally:
        torch.set_num_threads(saved)
    assert all(same_bits(r, results[0]) for r in results[1:])


def test_builds_give_the_same_bits():
    x = torch.randn(17, 576, generator=torch.Generator().manual_seed(5))
    for qtype in TYPES:
        w = random_blocks(qtype, 70, 576, seed=6)
        native = load("native").matmul_quantised(x, w.blocks, w.type_id)
        assert same_bits(native, load("baseline").matmul_quantised(x, w.blocks, w.type_id))


def test_bias_and_packed_rows():
    """A bias is added after the product, as `cpu.matmul` adds it; rows of a weight (a shard
    of a packed q/k/v) are a weight of their own."""
    w = random_blocks("Q4_1", 96, 64, seed=7)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(8))
    bias = torch.randn(96, generator=torch.Generator().manual_seed(9))
    dequantised = gguf_dequantised(w)
    assert same_bits(cpu.matmul_quantised(x, w, bias), cpu.matmul(x, dequantised.t(), bias))
    part = w.narrow(32, 40)
    assert same_bits(cpu.matmul_quantised(x, part), cpu.matmul(x, dequantised[32:72].t()))


def test_control_another_k_order_differs():
    """The same products summed in another order (K's halves swapped) must change bits: the
    comparison above can see an order change."""
    w = random_blocks("Q8_0", 64, 576, seed=10)
    dequantised = gguf_dequantised(w)
    x = torch.randn(33, 576, generator=torch.Generator().manual_seed(11))
    swap = torch.cat([torch.arange(288, 576), torch.arange(0, 288)])
    reordered = cpu.matmul(x[:, swap].contiguous(), dequantised[:, swap].t())
    assert torch.allclose(reordered, cpu.matmul_quantised(x, w), rtol=1e-4, atol=1e-3)
    assert not same_bits(reordered, cpu.matmul_quantised(x, w))


def test_bad_blocks_are_refused():
    with pytest.raises(ValueError, match="unsupported type"):
        QuantisedWeight(torch.zeros(2, 34, dtype=torch.uint8), "Q5_0", 32)
    with pytest.raises(ValueError, match="do not hold"):
        QuantisedWeight(torch.zeros(2, 33, dtype=torch.uint8), "Q8_0", 32)
    w = random_blocks("Q8_0", 4, 64)
    with pytest.raises(ValueError, match="bad shapes"):
        cpu.matmul_quantised(torch.zeros(3, 32), w)
