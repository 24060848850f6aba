"""Run the model directly over a paged KV cache that a test allocates: no engine, no scheduler.

Each sequence owns whole blocks (listed in its table); a step hands the model every sequence's
new tokens concatenated, as the engine does.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from detgate.worker.model.attention_metadata import AttentionMetadata
from detgate.worker.model.decoder import CausalLM

BLOCK_SIZE = 16


@dataclass
class PagedSeq:
    """A sequence's token ids and blocks; `cached` tokens already have K/V in the cache."""

    token_ids: list[int]
    blocks: list[int]
    cached: int = 0
    hidden: list[torch.Tensor] = field(default_factory=list)  # [n, H] per step
    logits: list[torch.Tensor] = field(default_factory=list)  # [n, V] per step


def make_caches(model: CausalLM, num_blocks: int, device: str = "cpu"
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    c = model.config
    shape = (num_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    if device != "cpu":  # one allocation, contiguous per layer, as the engine's
        cache = torch.zeros(c.num_layers, 2, *shape, dtype=c.dtype, device=device)
        return [(cache[i, 0], cache[i, 1]) for i in range(c.num_layers)]
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


def step_inputs(seqs: list[PagedSeq], counts: list[int], device: str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Inputs of one step computing each sequence's next counts[i] tokens (a prefill chunk or
    one decode token), tables padded with -1 as the model runner pads them."""
    ids, pos, slots, qsl, lens = [], [], [], [0], []
    for s, n in zip(seqs, counts, strict=True):
        new = range(s.cached, s.cached + n)
        ids += [s.token_ids[p] for p in new]
        pos += list(new)
        slots += [s.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in new]
        qsl.append(qsl[-1] + n)
        lens.append(s.cached + n)
    width = max(len(s.blocks) for s in seqs)
    tables = [s.blocks + [-1] * (width - len(s.blocks)) for s in seqs]

    def t(x, dtype=torch.int64):
        return torch.tensor(x, dtype=dtype, device=device)

    meta = AttentionMetadata(t(qsl, torch.int32), t(lens, torch.int32), t(tables, torch.int32),
                             t(slots), max(counts), max(lens))
    return t(ids), t(pos), meta


def mixed_steps(model: CausalLM, caches, prompts: list[list[int]], seed: int, max_tokens: int,
                forward: Callable | None = None, device: str = "cpu") -> list[torch.Tensor]:
    """Run `prompts` to their end in random steps that mix prefill chunks of random lengths
    (whole prompts, chunks after an earlier chunk) and one-token steps, at most max_tokens a
    step, with a few single-sequence one-token steps among them; each step through
    `forward(ids, pos, meta)` (None: the model, eagerly). Returns each step's hidden states as
    int32 bit patterns."""
    rng = random.Random(seed)
    seqs = allocate(prompts)
    out = []
    while any(s.cached < len(s.token_ids) for s in seqs):
        live = [s for s in seqs if s.cached < len(s.token_ids)]
        if rng.random() < 0.15:
            step, counts = [rng.choice(live)], [1]
        else:
            step = rng.sample(live, k=min(len(live), rng.randint(1, 8)))
            counts = [1 if rng.random() < 0.5 else rng.randint(1, len(s.token_ids) - s.cached)
                      for s in step]
        while sum(counts) > max_tokens:
            counts[counts.index(max(counts))] //= 2
        ids, pos, meta = step_inputs(step, counts, device)
        with torch.inference_mode():
            hidden = forward(ids, pos, meta) if forward else model(ids, pos, meta, caches)
        assert hidden is not None and hidden.shape[0] == sum(counts)
        out.append(hidden.clone().view(torch.int32))
        for s, n in zip(step, counts, strict=True):
            s.cached += n
    return out
