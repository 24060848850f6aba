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
"""

from __future__ import annotations

import torch

from kernels.cpu import invariant_rows, pad_rows

KV_TILE = 32


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, Hkv, D] into the caches [num_blocks, block_size, Hkv, D] at slot_mapping
    [T] (block * block_size + offset); negative slots are skipped."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _gather_kv(cache: torch.Tensor, slots: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """cache rows at slots [B, L] -> [B, Hkv, L, D] fp32, zero where not valid (never NaN)."""
    rows = cache.view(-1, *cache.shape[2:])[slots].float()  # [B, L, Hkv, D]
    rows = torch.where(valid[:, :, None, None], rows, 0.0)
    return rows.transpose(1, 2).contiguous()


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
    max_q = max(qlens)
    num_tiles = -(-max(lens) // KV_TILE)
    kv_len = num_tiles * KV_TILE

    # Key slots by position: position p of sequence b lives at block_tables[b, p // block_size].
    pos = torch.arange(kv_len)
    col = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    valid_key = pos[None, :] < seq_lens[:, None].long()  # [B, L]
    blocks = block_tables[:, col].long().clamp(min=0)
    slots = torch.where(valid_key, blocks * block_size + pos % block_size, 0)
    k = _gather_kv(k_cache, slots, valid_key)  # [B, Hkv, L, D]
    v = _gather_kv(v_cache, slots, valid_key)

    # Queries as rows (query j, head g of the group) per (sequence, kv head): [B, Hkv, R, D].
    seq_of = torch.repeat_interleave(torch.arange(batch), torch.tensor(qlens),
                                     output_size=num_tokens)
    j_of = torch.arange(num_tokens) - query_start_loc[:-1].long()[seq_of]
    qp = q.new_zeros(batch, max_q, hq, d, dtype=torch.float32)
    qp[seq_of, j_of] = q.float()
    rows = max_q * group
    qp = qp.view(batch, max_q, hkv, group, d).permute(0, 2, 1, 3, 4).reshape(batch, hkv, rows, d)
    qp = pad_rows(qp, invariant_rows(rows))
    padded = qp.shape[2]
    # Position of each row's query; padding rows get position -1 (they see no key).
    qpos = seq_lens[:, None].long() - torch.tensor(qlens)[:, None] + torch.arange(max_q)[None, :]
    qpos = torch.where(torch.arange(max_q)[None, :] < torch.tensor(qlens)[:, None], qpos, -1)
    row_pos = pad_rows(qpos.repeat_interleave(group, dim=1), padded, dim=1)
    row_pos = torch.where(torch.arange(padded) < rows, row_pos, -1)[:, None, :, None]

    m = torch.full((batch, hkv, padded, 1), float("-inf"))
    denom = torch.zeros(batch, hkv, padded, 1)
    acc = torch.zeros(batch, hkv, padded, d)
    for t in range(num_tiles):
        span = slice(t * KV_TILE, (t + 1) * KV_TILE)
        key_pos = pos[span]
        allowed = key_pos[None, None, None, :] <= row_pos  # [B, 1, R, TILE]
        s = torch.matmul(qp, k[:, :, span].transpose(-1, -2)) * scale
        s = torch.where(allowed, s, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        active = allowed[..., :1]  # key t*KV_TILE is visible iff any key of the tile is
        m_safe = torch.where(active, m_new, 0.0)
        p = torch.exp(s - m_safe)
        alpha = torch.exp(torch.where(active, m, 0.0) - m_safe)
        denom = torch.where(active, denom * alpha + p.sum(-1, keepdim=True), denom)
        acc = torch.where(active, acc * alpha + torch.matmul(p, v[:, :, span]), acc)
        m = torch.where(active, m_new, m)

    out = (acc[:, :, :rows] / denom[:, :, :rows].clamp(min=torch.finfo(torch.float32).tiny))
    out = out.view(batch, hkv, max_q, group, d).permute(0, 2, 1, 3, 4).reshape(batch, max_q, hq, d)
    return out[seq_of, j_of].to(q.dtype)
