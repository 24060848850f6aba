"""The Triton paged attention on small shapes: equals the reference, and a query's bits do not
depend on the batch, decode vs prefill, the chunking, the block size or the launch shape.

Without CUDA it runs under Triton's interpreter (TRITON_INTERPRET=1, set before the kernel
module is imported) on CPU tensors, with small tiles and splits so that every query crosses
several splits; with CUDA, natively with the real constants.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from detgate.kernels.bits import same_bits

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

from importlib import import_module  # noqa: E402

from tests.kernels.interpreter_dot import fixed_order_dot  # noqa: E402
from tests.kernels.paged_cases import (  # noqa: E402
    Impl,
    chunked_prefill,
    make_world,
    prefill,
    reference_output,
    step,
    with_block_size,
)

at = import_module("detgate.kernels.attention_triton")
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _impl(split_programs: bool | None) -> Impl:
    """The general launch for every sequence (one-query ones included), in that shape."""
    return Impl(store_kv=at.store_kv,
                paged_attention=functools.partial(at.paged_attention,
                                                  split_programs=split_programs,
                                                  decode_tile_singles=False))


FUSED, SPLIT = _impl(False), _impl(True)
DECODE_FUSED = Impl(store_kv=at.store_kv, paged_attention=functools.partial(
    at.paged_attention, decode=True, split_programs=False))
DECODE_SPLIT = Impl(store_kv=at.store_kv, paged_attention=functools.partial(
    at.paged_attention, decode=True, split_programs=True))


@pytest.fixture(autouse=True, scope="module")
def _interpreter_fixed_order_dot():
    """Under the interpreter, a product with one summation order per element
    (tests/kernels/interpreter_dot.py), so these tests check the kernel's own order."""
    if ON_GPU:
        yield
        return
    with fixed_order_dot():
        yield


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    """Under the interpreter: 32-row blocks, 16-position tiles, 32-position splits in groups
    of 64 positions."""
    if not ON_GPU:
        monkeypatch.setattr(at, "BLOCK_M", 32)
        monkeypatch.setattr(at, "BLOCK_N", 16)
        monkeypatch.setattr(at, "KV_SPLIT", 32)
        monkeypatch.setattr(at, "KV_GROUP", 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_and_launch_shapes_agree(dtype):
    world = make_world([50, 1, 33], 4, 1, 16, 16, dtype, DEVICE, seed=1)
    fused = prefill(world, [0, 1, 2], impl=FUSED)
    split = prefill(world, [0, 1, 2], impl=SPLIT)
    for i, (f, s) in enumerate(zip(fused, split, strict=True)):
        assert same_bits(f, s), f"fused and split launches differ for sequence {i}"
        torch.testing.assert_close(f, reference_output(world, i), atol=TOL[dtype], rtol=TOL[dtype])


def _split_and_group_lens() -> list[int]:
    """Sequences ending inside, on and before split and group ends, from the constants in
    force (under the interpreter 100, 31, 64, 1, 65, 128; natively 1,092 ... 2,048): the
    group after the first holds one split, two, or all of its splits."""
    s, g = at.KV_SPLIT, at.KV_GROUP
    return [g + s + 4, s - 1, 2 * s, 1, g + 1, 2 * g]


@pytest.mark.parametrize("decode", [False, True], ids=["general", "decode"])
def test_split_launch_by_split_or_by_group_equals_the_fused_launch(decode):
    """The split launch's two units (a split: the combine merges splits into groups, then
    groups; a group: the program merges its splits) and the fused launch's one loop merge the
    same partials in the same order: the same bits, for queries ending inside, on and before
    split and group ends."""
    lens = _split_and_group_lens()
    world = make_world(lens, 4, 2, 16, 16, torch.float32, DEVICE, seed=8)
    seqs = list(range(len(lens)))
    fused = prefill(world, seqs, impl=FUSED)
    for per_split in (True, False):
        impl = Impl(store_kv=at.store_kv, paged_attention=functools.partial(
            at.paged_attention, split_programs=True, per_split=per_split))
        split = prefill(world.fresh_cache(), seqs, impl=impl)
        assert all(same_bits(a, b) for a, b in zip(fused, split, strict=True)), per_split
        if decode:
            impl = Impl(store_kv=at.store_kv, paged_attention=functools.partial(
                at.paged_attention, decode=True, split_programs=True, per_split=per_split))
            batch = step(world, [(i, n - 1, n) for i, n in enumerate(lens)], impl)
            assert all(same_bits(batch[i], fused[i][-1:]) for i in seqs), per_split


def test_negative_control_groups_of_one_split_differ(monkeypatch):
    """The test above can fail: the same splits grouped otherwise (each its own group) give
    other bits to a query whose splits then merge in another tree, one after the first group
    that sees two splits of a later group ((s0 + s1) + (s2 + s3) against ((s0 + s1) + s2) +
    s3); a query that sees at most one split past the first group keeps its bits, as merging
    a state into the empty one is exact."""
    lens = _split_and_group_lens()
    world = make_world(lens, 4, 2, 16, 16, torch.float32, DEVICE, seed=8)
    seqs = list(range(len(lens)))
    past_first_group_and_one_split = at.KV_GROUP + at.KV_SPLIT  # read before regrouping
    grouped = prefill(world, seqs, impl=FUSED)
    monkeypatch.setattr(at, "KV_GROUP", at.KV_SPLIT)
    alone = prefill(world.fresh_cache(), seqs, impl=FUSED)
    differing = [i for i in seqs if not same_bits(grouped[i], alone[i])]
    assert differing and all(lens[i] > past_first_group_and_one_split for i in differing), \
        differing


@pytest.mark.parametrize("split_programs", [False, True, None], ids=["fused", "split", "auto"])
def test_mixed_step_with_decodes_in_their_own_launch_equals_the_general_launch(split_programs):
    """A step mixing prompt chunks and decodes: its one-query sequences run in a decode
    launch of their own (decode tiles), the rest in the general launch; every row has the
    bits of the general launch over all of them."""
    lens = [45, 3, 70, 17, 1, 64, 90]
    world = make_world(lens, 4, 2, 16, 16, torch.float32, DEVICE, seed=9)
    prefill(world, [0, 1, 2, 3, 4, 5], impl=FUSED)
    chunks = [(0, 44, 45), (1, 2, 3), (2, 50, 70), (3, 16, 17), (4, 0, 1), (5, 63, 64),
              (6, 0, 33)]
    general = step(world, chunks, _impl(split_programs))
    routed = step(world, chunks, Impl(store_kv=at.store_kv, paged_attention=functools.partial(
        at.paged_attention, split_programs=split_programs, decode_tile_singles=True)))
    for i in range(len(chunks)):
        assert same_bits(routed[i], general[i]), i


def test_sequence_alone_equals_sequence_among_many():
    lens = [45, 3, 70, 17]
    world = make_world(lens, 4, 2, 16, 16, torch.float32, DEVICE, seed=2)
    among = prefill(world, list(range(len(lens))), impl=FUSED)
    alone = prefill(world.fresh_cache(), [2], impl=FUSED)
    assert same_bits(alone[0], among[2])
    decodes = [(i, n - 1, n) for i, n in enumerate(lens)]
    for impl in (FUSED, SPLIT):
        batch = step(world, decodes, impl)
        assert same_bits(step(world, [decodes[2]], impl)[0], batch[2])
        assert same_bits(batch[2], among[2][-1:])


@pytest.mark.parametrize("impl", [FUSED, SPLIT], ids=["fused", "split"])
def test_decode_equals_same_position_in_prefill(impl):
    world = make_world([100], 4, 1, 16, 16, torch.float32, DEVICE, seed=3)
    full = prefill(world, [0], impl=FUSED)[0]
    for pos in (0, 15, 16, 31, 32, 33, 63, 64, 99):
        assert same_bits(step(world, [(0, pos, pos + 1)], impl)[0], full[pos:pos + 1]), pos


@pytest.mark.parametrize("splits", [[80, 48], [1, 127], [33, 31, 64]])
def test_chunked_prefill_equals_fresh_prefill(splits):
    world = make_world([128], 4, 1, 16, 32, torch.float32, DEVICE, seed=4)
    fresh = prefill(world, [0], impl=FUSED)[0]
    assert same_bits(chunked_prefill(world, splits, FUSED), fresh)


def test_block_size_does_not_change_bits():
    world = make_world([90, 40], 4, 1, 16, 16, torch.float32, DEVICE, seed=5)
    base = prefill(world, [0, 1], impl=FUSED)
    other = prefill(with_block_size(world, 32), [0, 1], impl=FUSED)
    assert all(same_bits(a, b) for a, b in zip(base, other, strict=True))


def test_store_kv_skips_negative_slots():
    world = make_world([20], 4, 2, 16, 16, torch.float32, DEVICE)
    k = torch.randn(3, 2, 16, device=DEVICE)
    at.store_kv(k, -k, world.k_cache, world.v_cache, torch.tensor([5, -1, 7], device=DEVICE))
    flat_k, flat_v = world.k_cache.flatten(0, 1), world.v_cache.flatten(0, 1)
    assert same_bits(flat_k[5], k[0]) and same_bits(flat_k[7], k[2])
    assert same_bits(flat_v[7], -k[2]) and flat_k[6].isnan().all()


@pytest.mark.parametrize("impl", [DECODE_FUSED, DECODE_SPLIT], ids=["fused", "split"])
def test_decode_launch_equals_the_general_launch(impl):
    """Program i = sequence i (no search): the same bits as the general launch, for every
    sequence whatever its length or the batch around it."""
    lens = [45, 3, 70, 17, 1, 64]
    world = make_world(lens, 4, 2, 16, 16, torch.float32, DEVICE, seed=6)
    prefill(world, list(range(len(lens))), impl=FUSED)
    decodes = [(i, n - 1, n) for i, n in enumerate(lens)]
    general = step(world, decodes, FUSED)
    fast = step(world, decodes, impl)
    for i in range(len(lens)):
        assert same_bits(fast[i], general[i]), i
    assert same_bits(step(world, decodes[2:3], impl)[0], general[2])


def test_negative_control_decode_launch_with_other_position_chunks_differs(monkeypatch):
    """The comparison above can fail: a decode launch whose online softmax takes its positions
    in chunks of another size (BLOCK_N, which decode shares with prefill to keep the bits)
    gives the longer sequences other bits than the general launch."""
    lens = [45, 3, 70, 17, 1, 64]
    world = make_world(lens, 4, 2, 16, 16, torch.float32, DEVICE, seed=6)
    prefill(world, list(range(len(lens))), impl=FUSED)
    decodes = [(i, n - 1, n) for i, n in enumerate(lens)]
    general = step(world, decodes, FUSED)
    monkeypatch.setattr(at, "BLOCK_N", at.BLOCK_N * 2)
    other = step(world, decodes, DECODE_FUSED)
    differing = [i for i in range(len(lens)) if not same_bits(other[i], general[i])]
    assert differing and all(lens[i] > at.BLOCK_N // 2 for i in differing), differing


def test_decode_launch_refuses_more_queries_than_sequences():
    world = make_world([20], 4, 2, 16, 16, torch.float32, DEVICE)
    q = torch.randn(2, 4, 16, device=DEVICE)
    qsl = torch.tensor([0, 2], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    tables = torch.arange(2, dtype=torch.int32, device=DEVICE)[None]
    with pytest.raises(ValueError, match="decode"):
        at.paged_attention(q, world.k_cache, world.v_cache, tables, qsl, lens, 0.25, decode=True)
