"""Run the model directly over a paged KV cache that a test allocates: no engine, no scheduler.

Each sequence owns whole blocks (listed in its table); a step hands the model every sequence's
new tokens concatenated, as the engine does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.engine.attention_metadata import AttentionMetadata
from worker.model.decoder import CausalLM

BLOCK_SIZE = 16


@dataclass
class PagedSeq:
    """A sequence's token ids and blocks; `cached` tokens already have K/V in the cache."""

    token_ids: list[int]
    blocks: list[int]
    cached: int = 0
    hidden: list[torch.Tensor] = field(default_factory=list)  # [n, H] per step
    logits: list[torch.Tensor] = field(default_factory=list)  # [n, V] per step


def make_caches(model: CausalLM, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    c = model.config
    shape = (num_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    return [
        (torch.zeros(shape, dtype=c.dtype), torch.zeros(shape, dtype=c.dtype))
        for _ in range(c.num_layers)
    ]


def allocate(token_lists: list[list[int]], first_block: int = 0) -> list[PagedSeq]:
    """Give each sequence enough consecutive blocks for all its tokens."""
    seqs, nxt = [], first_block
    for ids in token_lists:
        n = -(-len(ids) // BLOCK_SIZE)
        seqs.append(PagedSeq(list(ids), list(range(nxt, nxt + n))))
        nxt += n
    return seqs


def step(model: CausalLM, caches, seqs: list[PagedSeq], counts: list[int]) -> torch.Tensor:
    """Compute the next `counts[i]` tokens of each sequence in ONE forward call, then the logits
    of all T rows in one head call; returns hidden [T, H]."""
    ids, pos, slots, starts, lens = [], [], [], [0], []
    for s, n in zip(seqs, counts, strict=True):
        new = range(s.cached, s.cached + n)
        ids += [s.token_ids[p] for p in new]
        pos += list(new)
        slots += [s.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in new]
        starts.append(starts[-1] + n)
        lens.append(s.cached + n)
    width = max(len(s.blocks) for s in seqs)
    tables = torch.tensor(
        [s.blocks + [-1] * (width - len(s.blocks)) for s in seqs], dtype=torch.int32
    )
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(counts),
        max_seq_len=max(lens),
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.tensor(pos), meta, caches)
        logits = model.compute_logits(hidden)
    for i, (s, n) in enumerate(zip(seqs, counts, strict=True)):
        s.hidden.append(hidden[starts[i] : starts[i + 1]])
        s.logits.append(logits[starts[i] : starts[i + 1]])
        s.cached += n
    return hidden
