"""BlockManager: allocation, decode growth, ref counts, prefix caching by hash chain."""

from __future__ import annotations

from detgate.worker.engine.block_manager import BlockManager
from detgate.worker.engine.sequence import SamplingParams, Sequence

BS = 16


def seq(tokens, rid="r", **params) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(**params))


def computed(bm: BlockManager, s: Sequence) -> None:
    """As after a step that computed every token of `s`."""
    s.num_computed_tokens = len(s)
    bm.register_computed(s)


def test_allocate_covers_every_token_and_free_returns_blocks():
    bm = BlockManager(8, BS)
    s = seq(range(40))
    assert bm.can_allocate(s)
    bm.allocate(s)
    assert len(s.block_table) == 3 and len(set(s.block_table)) == 3
    assert bm.num_free_blocks == 5 and s.num_computed_tokens == 0
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == []


def test_can_allocate_refuses_when_blocks_run_out():
    bm = BlockManager(2, BS)
    assert not bm.can_allocate(seq(range(33)))
    assert bm.can_allocate(seq(range(32)))


def test_append_takes_a_block_only_when_crossing_a_boundary():
    bm = BlockManager(3, BS)
    s = seq(range(16))
    bm.allocate(s)
    computed(bm, s)
    s.token_ids.append(99)  # 17 tokens: the 17th needs a second block
    assert bm.can_append(s)
    bm.append(s)
    assert len(s.block_table) == 2
    s.token_ids.append(100)
    bm.append(s)  # 18 tokens still fit in two blocks
    assert len(s.block_table) == 2


def test_can_append_false_without_free_block():
    bm = BlockManager(1, BS)
    s = seq(range(16))
    bm.allocate(s)
    s.token_ids.append(1)
    assert not bm.can_append(s)


def test_prefix_hit_shares_full_blocks_and_keeps_last_token_uncomputed():
    bm = BlockManager(10, BS)
    a = seq(range(48), "a")
    bm.allocate(a)
    computed(bm, a)
    b = seq(range(48), "b")  # same 3 full blocks: only 2 may be reused (last token is computed)
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == b.num_cached_tokens == 32
    assert bm.blocks[a.block_table[0]].ref_count == 2
    c = seq([*range(16), 7, *range(17, 40)], "c")  # differs in block 1: only block 0 hits
    bm.allocate(c)
    assert c.block_table[0] == a.block_table[0] and c.num_computed_tokens == 16


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(4, BS)
    a = seq(range(33), "a")
    bm.allocate(a)
    computed(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = seq(range(33), "b")
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.block_table[:2] == table[:2] and b.num_computed_tokens == 32
    assert bm.num_free_blocks == 1


def test_evicted_block_is_no_longer_a_hit():
    bm = BlockManager(3, BS)
    a = seq(range(17), "a")
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    # Three fresh blocks for unrelated tokens take every block, evicting a's cached block.
    other = seq(range(1000, 1048), "o")
    bm.allocate(other)
    bm.free(other)
    b = seq(range(17), "b")
    bm.allocate(b)
    assert b.num_computed_tokens == 0


def test_partial_blocks_and_unfinished_prefill_are_not_published():
    bm = BlockManager(8, BS)
    a = seq(range(40), "a")
    bm.allocate(a)
    a.num_computed_tokens = 20  # one full block computed so far
    bm.register_computed(a)
    b = seq(range(40), "b")
    bm.allocate(b)
    assert b.num_computed_tokens == 16


def test_prefix_cache_off_and_opt_outs():
    bm = BlockManager(8, BS, enable_prefix_cache=False)
    a = seq(range(40), "a")
    bm.allocate(a)
    computed(bm, a)
    b = seq(range(40), "b")
    bm.allocate(b)
    assert b.num_computed_tokens == 0

    bm = BlockManager(8, BS)
    a = seq(range(40), "a")
    bm.allocate(a)
    computed(bm, a)
    for opt_out in ({"single_pass": True}, {"prompt_logprobs": 0}):
        c = seq(range(40), "c", **opt_out)
        bm.allocate(c)
        assert c.num_computed_tokens == 0
        bm.free(c)


def test_reviving_a_free_cached_block_counts_against_free_blocks():
    bm = BlockManager(3, BS)
    a = seq(range(33), "a")
    bm.allocate(a)
    computed(bm, a)
    bm.free(a)
    b = seq(range(33), "b")  # 2 cached blocks (free, ref 0) + 1 new = all 3 blocks
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert bm.num_free_blocks == 0
