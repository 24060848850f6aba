"""CPU paged attention: matches the reference, and every query's bits are independent of the
batch, of decode vs prefill, of the prefill chunking and of the cache's block size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from detgate.kernels.bits import same_bits
from tests.kernels.paged_cases import (
    chunked_prefill,
    make_world,
    prefill,
    reference_output,
    step,
    with_block_size,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
CONFIGS = [  # (Hq, Hkv, D, dtype)
    (8, 2, 64, torch.float32),
    (4, 4, 32, torch.float32),
    (8, 1, 64, torch.bfloat16),
]


@pytest.mark.parametrize(("hq", "hkv", "d", "dtype"), CONFIGS)
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_reference(hq, hkv, d, dtype, block_size):
    world = make_world([70, 1, 33, 128], hq, hkv, d, block_size, dtype, seed=block_size)
    outs = prefill(world, [0, 1, 2, 3])
    for i, out in enumerate(outs):
        assert out.dtype == dtype and not out.isnan().any()
        tol = TOL[dtype]
        torch.testing.assert_close(out, reference_output(world, i), atol=tol, rtol=tol)


@pytest.mark.parametrize(("hq", "hkv", "d", "dtype"), CONFIGS)
def test_sequence_alone_equals_sequence_among_many(hq, hkv, d, dtype):
    gen = torch.Generator().manual_seed(7)
    lens = [90] + torch.randint(1, 160, (11,), generator=gen).tolist()
    world = make_world(lens, hq, hkv, d, 16, dtype, seed=3)
    among = prefill(world, list(range(len(lens))))
    alone = prefill(world.fresh_cache(), [0])
    assert same_bits(alone[0], among[0])
    # Decode steps: the needle alone, then in the middle of a batch of other decodes.
    for pos in (0, 17, 63, 89):
        alone_dec = step(world, [(0, pos, pos + 1)])[0]
        batch = [(i, n - 1, n) for i, n in enumerate(lens) if i] + [(0, pos, pos + 1)]
        batch = batch[5:] + batch[:5]
        among_dec = step(world, batch)[batch.index((0, pos, pos + 1))]
        assert same_bits(alone_dec, among_dec) and same_bits(alone_dec, among[0][pos:pos + 1])


@pytest.mark.parametrize(("hq", "hkv", "d", "dtype"), CONFIGS)
def test_decode_equals_same_position_in_prefill(hq, hkv, d, dtype):
    world = make_world([150], hq, hkv, d, 32, dtype, seed=5)
    full = prefill(world, [0])[0]
    for pos in [*range(0, 150, 3), 149]:
        assert same_bits(step(world, [(0, pos, pos + 1)])[0], full[pos:pos + 1]), pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [[80, 48], [1, 127], [33, 31, 64], [16] * 8, [100, 27, 1]])
def test_chunked_prefill_equals_fresh_prefill(dtype, splits):
    world = make_world([128], 8, 2, 64, 32, dtype, seed=11)
    fresh = prefill(world, [0])[0]
    assert same_bits(chunked_prefill(world, splits), fresh)


def test_chunked_prefill_inside_a_mixed_batch():
    """Chunks of several prompts, scheduled together with other sequences' decodes."""
    world = make_world([128, 77, 200], 8, 2, 64, 16, torch.float32, seed=13)
    fresh = prefill(world, [0, 1, 2])
    chunked = prefill(world.fresh_cache(), [0, 1, 2], chunk=48)
    for a, b in zip(fresh, chunked, strict=True):
        assert same_bits(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_size_does_not_change_bits(dtype):
    world = make_world([150, 40], 8, 2, 64, 16, dtype, seed=17)
    base = prefill(world, [0, 1])
    for block_size in (32, 64):
        other = prefill(with_block_size(world, block_size), [0, 1])
        assert all(same_bits(a, b) for a, b in zip(base, other, strict=True)), block_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bits_do_not_depend_on_the_batch_shape(dtype):
    """A prompt chunked into pieces of 1 to 49 queries, each chunk alone or beside other
    sequences' decodes and chunks of other lengths, longer and shorter, gives the bits of the
    whole prompt prefilled alone."""
    world = make_world([210, 300, 40, 130, 7], 8, 2, 64, 16, dtype, seed=23)
    fresh = prefill(world, [0])[0]
    others = [prefill(world, [i])[0] for i in range(1, 5)]
    mixed = world.fresh_cache()
    prefill(mixed, [1, 2, 3, 4])  # the other sequences' K/V, for their decodes
    splits = [1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 32, 33, 49]
    outs, start = [], 0
    for n, size in enumerate(splits):
        seq = (0, start, start + size)
        if n % 3 == 0:
            batch = [seq]
        elif n % 3 == 1:  # decodes of every other sequence, one of them longer than seq 0
            batch = [(i, end - 1, end) for i, end in ((1, 300), (2, 40), (4, 7))] + [seq]
        else:  # re-prefilled chunks of the others, in this and in neighbouring buckets
            batch = [(3, 0, size), seq, (1, 299 - 2 * size, 300), (2, 39, 40)]
        got = step(mixed, batch)
        outs.append(got[batch.index(seq)])
        for (i, s, e), out in zip(batch, got, strict=True):
            if i:
                assert same_bits(out, others[i - 1][s:e]), (n, i)
        start += size
    assert same_bits(torch.cat(outs), fresh[:start])


def test_store_kv_skips_negative_slots():
    world = make_world([20], 4, 2, 16, 16, torch.float32)
    from detgate.kernels.attention import store_kv

    k = torch.randn(3, 2, 16)
    slots = torch.tensor([5, -1, 7])
    store_kv(k, k, world.k_cache, world.v_cache, slots)
    flat = world.k_cache.flatten(0, 1)
    assert same_bits(flat[5], k[0]) and same_bits(flat[7], k[2])
    assert flat[6].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_is_not_invariant_between_decode_and_prefill(dtype):
    """Negative control: torch's SDPA (the default mode's attention) gives a position other
    bits when it is decoded alone than inside the causal prefill, so the tests above can fail."""
    gen = torch.Generator().manual_seed(19)
    q, k, v = (torch.randn(1, 8, 300, 64, generator=gen).to(dtype) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    differing = [p for p in range(0, 300, 7) if not same_bits(
        F.scaled_dot_product_attention(q[:, :, p:p + 1], k[:, :, :p + 1], v[:, :, :p + 1]),
        full[:, :, p:p + 1])]
    assert differing
