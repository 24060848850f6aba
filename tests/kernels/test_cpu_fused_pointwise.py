"""The CPU kernels' one-call RMSNorm, residual add + RMSNorm and rotary (fp32) give the bits of
the torch compositions they replace (kernels/cpu.py's `rms_norm_composed`: the compiled
statistic, then two torch multiplies; the rotary module's `_rotate`), special values included,
whatever the rows' number or the threads; and the bit comparison here is sensitive: the same
products associated the other way differ."""

from __future__ import annotations

import pytest
import torch

from detgate.kernels import cpu
from detgate.kernels.bits import same_bits
from detgate.kernels.cpu_ext import load
from detgate.worker.model.layers.rotary import RotaryEmbedding, _rotate


def _hidden(rows: int, h: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, h, generator=gen) * 4
    flat = x.view(-1)
    specials = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3e38, -3e38, 1e-20])
    flat[: specials.numel()] = specials  # subnormals, signed zeros, squares that overflow
    return x


@pytest.fixture(params=[1, 2], ids=lambda t: f"{t}threads")
def threads(request):
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


@pytest.mark.parametrize("h", [1, 13, 64, 576, 581])
def test_rms_norm_is_the_composition_bit_for_bit(h, threads):
    x = _hidden(37, h, seed=h)
    weight = torch.randn(h, generator=torch.Generator().manual_seed(1))
    for eps in (1e-6, 1e-5):
        fused = cpu.rms_norm(x, weight, eps)
        assert same_bits(fused, cpu.rms_norm_composed(x, weight, eps))
        # rows alone give the bits they have in the batch
        assert all(same_bits(cpu.rms_norm(x[i:i + 1], weight, eps), fused[i:i + 1])
                   for i in range(0, 37, 5))


@pytest.mark.parametrize("h", [13, 576])
def test_add_rms_norm_is_the_composition_bit_for_bit(h, threads):
    x, residual = _hidden(21, h, seed=3), _hidden(21, h, seed=4).flip(0)
    weight = torch.randn(h, generator=torch.Generator().manual_seed(2))
    out, new_residual = cpu.add_rms_norm(x, residual, weight, 1e-6)
    summed = x + residual
    assert same_bits(new_residual, summed)
    assert same_bits(out, cpu.rms_norm_composed(summed, weight, 1e-6))
    # a 3-D input (q/k norm's [T, H, D]) and a strided residual take the same path
    out3, _ = cpu.add_rms_norm(x.view(3, 7, h), residual.view(3, 7, h), weight, 1e-6)
    assert same_bits(out3.view(21, h), out)


def test_the_bit_comparison_sees_one_rounding_moved():
    """The control: (weight * x) * inv, the same products associated the other way, differs
    from the fused norm somewhere, so the equalities above are not vacuous."""
    x = _hidden(64, 576, seed=5)
    weight = torch.randn(576, generator=torch.Generator().manual_seed(6))
    inv = load().inv_rms(x, 1e-6).view(-1, 1)
    assert not same_bits((weight * x) * inv, cpu.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("head_dim", [20, 64])
def test_rotary_is_the_module_composition_bit_for_bit(head_dim, threads):
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None)
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(9, (4 + 2 * 2) * head_dim, generator=gen) * 3
    q, k, _ = qkv.split([4 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)
    q, k = q.reshape(9, 4, head_dim), k.reshape(9, 2, head_dim)  # views with a row stride
    positions = torch.tensor([0, 1, 2, 77, 300, 511, 5, 5, 100])
    for x in (q, k):
        fused = cpu.rotary(positions, x, rope.cos, rope.sin)
        cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
        assert same_bits(fused, _rotate(x, cos, sin))
        assert all(same_bits(cpu.rotary(positions[i:i + 1], x[i:i + 1], rope.cos, rope.sin),
                             fused[i:i + 1]) for i in range(9))


def test_rotary_refuses_positions_outside_its_table():
    rope = RotaryEmbedding(16, 8, 10000.0, None)
    with pytest.raises(RuntimeError, match="outside the table"):
        cpu.rotary(torch.tensor([8]), torch.randn(1, 2, 16), rope.cos, rope.sin)
