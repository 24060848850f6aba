"""Paged attention on the CPU in plain torch, with one KV reduction order per query.

Order (the invariant): keys are taken by POSITION in tiles of `KV_TILE` positions (tile t
holds positions [t*KV_TILE, (t+1)*KV_TILE), whatever the cache's block size), and each query
folds the tiles in ascending order into an online softmax (running max, sum and weighted V).
A tile after the query's position leaves the query's state untouched (`torch.where`, not an
add of zeros), so decode (1 query, short key range) and prefill (many queries, the longest
key range of the batch) apply exactly the same tile updates to a given query. On the CPU the
whole KV range is one split, which is a fixed split size too.

Every product is an fp32 batched GEMM with fixed inner shapes (q.k: K = head dim, N =
KV_TILE; p.v: K = KV_TILE, N = head dim) whose row count varies with the number of queries;
MKL's GEMM gives each row the same bits for every row count from `invariant_rows` on
(measured, see kernels/cpu.py), and for every number of matrices in the batch.

Layout: everything is [Hkv, B, rows, ...] so that (kv head, sequence) pairs merge into one
GEMM batch dimension without copies; rows of a (sequence, kv head) are (query j, head g of
the group) at j * group + g.
"""

from __future__ import annotations

import torch

from kernels.cpu import invariant_rows

KV_TILE = 64
# Position given to padding rows: after every key, so they never force a mask.
_NEVER = 1 << 30


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, Hkv, D] into the caches [num_blocks, block_size, Hkv, D] at slot_mapping
    [T] (block * block_size + offset); negative slots are skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_kv(cache: torch.Tensor, slots: torch.Tensor, invalid: torch.Tensor) -> torch.Tensor:
    """Cache rows at slots [B, L] -> [Hkv, B, L, D] fp32, zero where invalid (never NaN)."""
    rows = cache.view(-1, *cache.shape[2:]).index_select(0, slots.view(-1))
    rows = rows.view(*slots.shape, *cache.shape[2:]).permute(2, 0, 1, 3)
    return rows.float().contiguous().masked_fill_(invalid[None, :, :, None], 0.0)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention of q [T, Hq, D] over the paged cache; see kernels/attention.py."""
    num_tokens, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    batch = len(lens)
    qlens = [starts[i + 1] - starts[i] for i in range(batch)]
    first_pos = [n - qn for n, qn in zip(lens, qlens, strict=True)]
    num_tiles = -(-max(lens) // KV_TILE)

    # Key slots by position: position p of sequence b lives at block_tables[b, p // block_size].
    pos = torch.arange(num_tiles * KV_TILE)
    col = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    invalid = pos[None, :] >= seq_lens[:, None].long()  # [B, L]
    slots = block_tables[:, col].long().clamp(min=0) * block_size + pos % block_size
    slots.masked_fill_(invalid, 0)
    k = _gather_kv(k_cache, slots, invalid)  # [Hkv, B, L, D]
    v = _gather_kv(v_cache, slots, invalid)

    # Queries as rows [Hkv, B, R, D], padded to a row count the GEMM is invariant at, with the
    # softmax scale folded in once.
    rows = invariant_rows(max(qlens) * group)
    seq_of = torch.repeat_interleave(torch.arange(batch), torch.tensor(qlens),
                                     output_size=num_tokens)
    j_of = torch.arange(num_tokens) - query_start_loc[:-1].long()[seq_of]
    row_of = j_of[:, None] * group + torch.arange(group)  # [T, group]
    qp = torch.zeros(hkv, batch, rows, d)
    qp[:, seq_of[:, None], row_of] = (q.float() * scale).view(num_tokens, hkv, group, d
                                                              ).permute(1, 0, 2, 3)
    # Each row's query position; padding rows see every key (finite, never used), so only
    # real rows decide whether a tile needs masking.
    row_pos = torch.full((batch, rows), _NEVER)
    row_pos[seq_of[:, None], row_of] = (torch.tensor(first_pos)[seq_of] + j_of)[:, None]

    m = torch.full((hkv, batch, rows, 1), float("-inf"))
    denom = torch.zeros(hkv, batch, rows, 1)
    acc = torch.zeros(hkv, batch, rows, d)
    for t in range(num_tiles):
        lo, hi = t * KV_TILE, (t + 1) * KV_TILE
        # Rows are in query order inside each sequence, so the rows that see this tile are a
        # suffix of each sequence's rows; compute from the earliest such row on, rounded to a
        # row count the GEMM is invariant at (rows outside the suffix keep their state).
        firsts = [max(0, lo - f) * group for f, n in zip(first_pos, lens, strict=True) if lo < n]
        r0 = rows - invariant_rows(rows - min(firsts))
        rpos = row_pos[None, :, r0:, None]  # [1, B, R', 1]
        low = int(rpos.amin())
        s = torch.matmul(qp[:, :, r0:], k[:, :, lo:hi].transpose(-1, -2))  # [Hkv, B, R', TILE]
        if low < hi - 1:  # some row sees only part of the tile
            s = torch.where(pos[lo:hi] <= rpos, s, float("-inf"))
        m_old, denom_old, acc_old = m[:, :, r0:], denom[:, :, r0:], acc[:, :, r0:]
        m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
        p = torch.exp(s - m_new)
        alpha = torch.exp(m_old - m_new)
        denom_new = denom_old * alpha + p.sum(-1, keepdim=True)
        acc_new = acc_old * alpha + torch.matmul(p, v[:, :, lo:hi])
        if low < lo:  # some row is before the tile: its state must stay bit-for-bit
            seen = rpos >= lo
            m_new = torch.where(seen, m_new, m_old)
            denom_new = torch.where(seen, denom_new, denom_old)
            acc_new = torch.where(seen, acc_new, acc_old)
        m[:, :, r0:], denom[:, :, r0:], acc[:, :, r0:] = m_new, denom_new, acc_new

    out = acc / denom  # [Hkv, B, R, D]
    return out[:, seq_of[:, None], row_of].permute(1, 0, 2, 3).reshape(num_tokens, hq, d
                                                                       ).to(q.dtype)
