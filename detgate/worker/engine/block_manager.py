"""Paged KV cache bookkeeping: block tables, reference counts, prefix caching.

A block is `block_size` consecutive token slots of the KV cache. A sequence's block table maps
its token positions to blocks (position p lives in block_table[p // block_size] at offset
p % block_size). A sequence gets blocks for all its tokens at admission, then one more block
whenever a decoded token crosses a block boundary.

Prefix caching: once a full block's K/V have been computed, the block is published under the
hash of its tokens chained with the hash of the block before it, so a hit on block i means the
whole prefix up to block i matches. Freed blocks keep their K/V and their hash until they are
handed out again, least recently freed first; a later sequence with the same prefix takes them
back. A block may be shared by several sequences (ref_count > 1) but is only ever written
by the sequence that computes it, before it is published.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from detgate.worker.engine.sequence import Sequence

_NO_HASH = None


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = _NO_HASH
    token_ids: tuple[int, ...] = ()


def block_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    # Python's hash of a tuple of ints is not salted: the same tokens give the same hash in
    # every process. Collisions are caught by comparing token_ids on lookup.
    return hash((parent, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True):
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref_count 0, least recently freed first (those are handed out first).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- admission -------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._match_prefix(seq)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        return self.blocks_needed(len(seq)) - len(hits) + revived <= len(self._free)

    def allocate(self, seq: Sequence) -> None:
        """Give `seq` blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table, "allocate() on a sequence that holds blocks"
        hits = self._match_prefix(seq)
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        seq.block_table = list(hits)
        for _ in range(self.blocks_needed(len(seq)) - len(hits)):
            seq.block_table.append(self._take_free_block())
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)

    # -- decode ----------------------------------------------------------------------------

    def can_append(self, seq: Sequence) -> bool:
        """Whether every token of `seq` (the one just sampled included) can get a slot."""
        return self._has_slots(seq) or len(self._free) >= 1

    def append(self, seq: Sequence) -> None:
        if not self._has_slots(seq):
            seq.block_table.append(self._take_free_block())

    # -- release and publication -----------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        # Tail blocks are freed first, so they are reused before the prefix blocks before them.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def register_computed(self, seq: Sequence) -> None:
        """Publish the full blocks of `seq` whose K/V are computed (by a step launched, which
        every later reader follows on the stream) and whose token ids are known (a block
        holding a PENDING token waits for it: the scheduler registers again then)."""
        if (seq.num_computed_tokens // self.block_size <= seq.num_registered_blocks  # most steps
                or not self.enable_prefix_cache or seq.params.single_pass):
            return
        num_full = min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size
        hashes = self._hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            block.hash = hashes[i]
            block.token_ids = self._block_tokens(seq, i)
            self._cached.setdefault(hashes[i], block.block_id)
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def reset_prefix_cache(self) -> None:
        """Unpublish every block (new weights: the cached K/V are the old weights'). Only
        while no sequence holds a block."""
        assert len(self._free) == len(self.blocks), "reset_prefix_cache() with blocks in use"
        self._cached.clear()
        for block in self.blocks:
            block.hash, block.token_ids = _NO_HASH, ()

    # -- internals -------------------------------------------------------------------------

    def _has_slots(self, seq: Sequence) -> bool:
        return len(seq.block_table) * self.block_size >= len(seq)

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])

    def _hashes(self, seq: Sequence, num_full: int) -> list[int]:
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(block_hash(parent, self._block_tokens(seq, i)))
        return seq.block_hashes

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest cached prefix of `seq`, as block ids.

        At most (len - 1) // block_size blocks: the last token is always computed, since its
        logits give the next token, and it must land in a block this sequence owns alone.
        """
        params = seq.params
        if not self.enable_prefix_cache or params.single_pass or params.prompt_logprobs is not None:
            return []
        num_full = (len(seq) - 1) // self.block_size
        hits: list[int] = []
        for i, h in enumerate(self._hashes(seq, num_full)[:num_full]):
            block_id = self._cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != self._block_tokens(seq, i):
                break
            hits.append(block_id)
        return hits

    def _take_free_block(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not _NO_HASH and self._cached.get(block.hash) == block_id:
            del self._cached[block.hash]
        block.hash, block.token_ids, block.ref_count = _NO_HASH, (), 1
        return block_id
