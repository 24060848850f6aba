"""The Triton paged attention at Qwen3-8B sizes on a GPU (32 q heads, 8 kv heads, head dim 128,
bf16): a query's bits do not depend on the batch, decode vs prefill, the chunking or the
launch shape, under each tile configuration the benchmark measures; and the negative control
that torch's SDPA on the same shapes does depend on them."""

from __future__ import annotations

import functools
from importlib import import_module

import pytest
import torch
import torch.nn.functional as F

from detgate.kernels.attention_tiles import CONFIGS, FIELDS, config_name
from detgate.kernels.bits import same_bits
from tests.kernels.paged_cases import (
    Impl,
    chunked_prefill,
    make_world,
    prefill,
    reference_output,
    step,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

HQ, HKV, D = 32, 8, 128


@pytest.fixture(params=CONFIGS, ids=config_name)
def at(request, monkeypatch):
    """The kernel module under each tile configuration the benchmark times."""
    module = import_module("detgate.kernels.attention_triton")
    for name, value in zip(FIELDS, request.param, strict=True):
        monkeypatch.setattr(module, name, value)
    return module


def _impl(at, split_programs: bool | None) -> Impl:
    """The general launch for every sequence (one-query ones included), in that shape."""
    return Impl(store_kv=at.store_kv,
                paged_attention=functools.partial(at.paged_attention,
                                                  split_programs=split_programs,
                                                  decode_tile_singles=False))


def test_matches_reference_both_launches(at):
    lens = [1500, 1, 300, 1024]
    world = make_world(lens, HQ, HKV, D, 16, torch.bfloat16, "cuda", seed=1)
    fused = prefill(world, [0, 1, 2, 3], impl=_impl(at, False))
    split = prefill(world, [0, 1, 2, 3], impl=_impl(at, True))
    for i in range(len(lens)):
        assert same_bits(fused[i], split[i]), i
        torch.testing.assert_close(fused[i], reference_output(world, i), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("decode", [False, True], ids=["general", "decode"])
def test_split_launch_by_split_or_by_group_equals_the_fused_launch(decode):
    """The split launch by split and by group, and the fused launch's one loop over splits
    and groups: the same bits, for contexts ending inside, on and before split and group
    ends (the shipped KV_SPLIT and KV_GROUP)."""
    at = import_module("detgate.kernels.attention_triton")
    lens = [2100, 1, 300, at.KV_SPLIT, at.KV_SPLIT + 1, at.KV_GROUP, at.KV_GROUP + 1]
    world = make_world(lens, HQ, HKV, D, 16, torch.bfloat16, "cuda", seed=8)
    seqs = list(range(len(lens)))
    fused = prefill(world, seqs, impl=_impl(at, False))
    decodes = [(i, n - 1, n) for i, n in enumerate(lens)]
    for per_split in (True, False):
        impl = Impl(store_kv=at.store_kv, paged_attention=functools.partial(
            at.paged_attention, split_programs=True, per_split=per_split, decode=decode))
        if decode:
            got = step(world, decodes, impl)
            assert all(same_bits(got[i], fused[i][-1:]) for i in seqs), per_split
        else:
            got = prefill(world.fresh_cache(), seqs, impl=impl)
            assert all(same_bits(got[i], fused[i]) for i in seqs), per_split


@pytest.mark.parametrize("split_programs", [False, None], ids=["fused", "auto"])
def test_mixed_step_with_decodes_in_their_own_launch_equals_the_general_launch(split_programs):
    """A mixed step (prompt chunks and 64 decodes): the decodes in a decode launch of their
    own, the rest in the general launch; every row has the general launch's bits."""
    at = import_module("detgate.kernels.attention_triton")
    gen = torch.Generator().manual_seed(9)
    lens = torch.randint(1, 3000, (64,), generator=gen).tolist() + [700, 1500, 40]
    world = make_world(lens, HQ, HKV, D, 16, torch.bfloat16, "cuda", seed=9)
    prefill(world, [*range(64), 65], impl=_impl(at, None))  # the K/V the step reads
    chunks = [(i, n - 1, n) for i, n in enumerate(lens[:64])] + \
        [(64, 0, 700), (65, 1000, 1500), (66, 0, 40)]
    general = step(world, chunks, _impl(at, split_programs))
    routed = step(world, chunks, Impl(store_kv=at.store_kv, paged_attention=functools.partial(
        at.paged_attention, split_programs=split_programs, decode_tile_singles=True)))
    for i in range(len(chunks)):
        assert same_bits(routed[i], general[i]), i


def test_fp32_matches_reference_without_tf32(at):
    world = make_world([200, 77], HQ, HKV, D, 32, torch.float32, "cuda", seed=2)
    outs = prefill(world, [0, 1], impl=_impl(at, None))
    for i in range(2):
        torch.testing.assert_close(outs[i], reference_output(world, i), atol=1e-5, rtol=1e-5)


def test_decode_at_every_position_equals_prefill(at):
    """All 2048 positions decoded in one call (2048 one-query sequences sharing one cache, seq
    lens 1..2048), in both launch shapes, general and decode launch, against the one-sequence
    prefill."""
    n = 2048
    world = make_world([n], HQ, HKV, D, 16, torch.bfloat16, "cuda", seed=3)
    full = prefill(world, [0], impl=_impl(at, False))[0]
    table = torch.tensor(world.blocks[0], dtype=torch.int32, device="cuda").expand(n, -1)
    qsl = torch.arange(n + 1, dtype=torch.int32, device="cuda")
    lens = torch.arange(1, n + 1, dtype=torch.int32, device="cuda")
    for split in (False, True):
        dec = at.paged_attention(world.q[0], world.k_cache, world.v_cache, table.contiguous(),
                                 qsl, lens, D**-0.5, split_programs=split,
                                 decode_tile_singles=False)
        assert same_bits(dec, full), f"split={split}"
        dec = at.paged_attention(world.q[0], world.k_cache, world.v_cache, table.contiguous(),
                                 qsl, lens, D**-0.5, decode=True, split_programs=split)
        assert same_bits(dec, full), f"decode launch, split={split}"


def test_needle_alone_equals_needle_among_many(at):
    gen = torch.Generator().manual_seed(4)
    lens = [700] + torch.randint(1, 3000, (31,), generator=gen).tolist()
    world = make_world(lens, HQ, HKV, D, 16, torch.bfloat16, "cuda", seed=4)
    impl = _impl(at, None)
    among = prefill(world, list(range(len(lens))), impl=impl)
    alone = prefill(world.fresh_cache(), [0], impl=impl)
    assert same_bits(alone[0], among[0])
    decodes = [(i, n - 1, n) for i, n in enumerate(lens)]
    batch = step(world, decodes[7:] + decodes[:7], impl)
    assert same_bits(batch[len(lens) - 7], step(world, [decodes[0]], impl)[0])
    assert same_bits(batch[len(lens) - 7], among[0][-1:])


@pytest.mark.parametrize(("block_size", "splits"), [(32, [80, 48]), (16, [1, 511, 1000, 536]),
                                                    (64, [300, 300, 300, 1148])])
def test_chunked_prefill_equals_fresh_prefill(at, block_size, splits):
    total = sum(splits)
    world = make_world([total], HQ, HKV, D, block_size, torch.bfloat16, "cuda", seed=5)
    impl = _impl(at, None)
    fresh = prefill(world, [0], impl=impl)[0]
    assert same_bits(chunked_prefill(world, splits, impl), fresh)


def test_dispatch_by_device_uses_triton():
    world = make_world([64, 9], HQ, HKV, D, 16, torch.bfloat16, "cuda", seed=6)
    outs = prefill(world, [0, 1])  # kernels.attention, dispatched on the CUDA tensors
    at = import_module("detgate.kernels.attention_triton")
    again = prefill(world.fresh_cache(), [0, 1], impl=_impl(at, None))
    assert all(same_bits(a, b) for a, b in zip(outs, again, strict=True))


def test_sdpa_is_not_batch_invariant():
    """Negative control: torch SDPA's bits for one query change with decode vs prefill and
    with the batch size, on these shapes."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(1, HQ, 2048, D, device="cuda", generator=gen, dtype=torch.bfloat16)
               for _ in range(3))
    k, v = k[:, :HKV], v[:, :HKV]
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    differs = 0
    for p in range(0, 2048, 97):
        dec = F.scaled_dot_product_attention(q[:, :, p:p + 1], k[:, :, :p + 1], v[:, :, :p + 1],
                                             enable_gqa=True)
        differs += not same_bits(dec, full[:, :, p:p + 1])
    qb = q[:, :, -1:].expand(64, -1, -1, -1).contiguous()
    kb, vb = k.expand(64, -1, -1, -1).contiguous(), v.expand(64, -1, -1, -1).contiguous()
    batched = F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)
    alone = F.scaled_dot_product_attention(q[:, :, -1:], k, v, enable_gqa=True)
    differs += not same_bits(batched[:1], alone)
    assert differs > 0
