"""Paged attention on the CPU in plain torch, with one KV reduction order per query.

Order (the invariant): keys are taken by POSITION in tiles of `KV_TILE` positions (tile t
holds positions [t*KV_TILE, (t+1)*KV_TILE), whatever the cache's block size). For each query:
- the softmax max is the max over its visible keys (exact: no order);
- each tile's contribution (sum of p, and p @ V) is a GEMM or a row sum of fixed shape;
- the tile contributions are added in tile order by `cumsum`, which runs strictly sequentially
  along the tile axis (in double), so tiles after the query's last visible key, all exact
  zeros, leave its sums unchanged: decode (1 query, the batch's key range) and prefill (many
  queries, a longer key range) add up the same numbers in the same order. On the CPU the whole
  KV range is one split, which is a fixed split size too.

Every product is an fp32 batched GEMM with fixed inner shapes (q.k: K = head dim, N =
KV_TILE; p.v: K = KV_TILE, N = head dim) whose row count varies with the number of queries;
MKL's GEMM gives each row the same bits at every row count that is a multiple of 4 (measured,
see kernels/cpu.py), and for every number of matrices in the batch.

So how the sequences of one call are grouped changes no bit, only the work: sequences are
bucketed by their query count rounded up to a power of two (decodes together, prefill chunks
of similar lengths together), and each bucket gathers and scores only the key tiles its own
sequences reach. Within a bucket the work is a fixed, small number of torch ops (no loop over
tiles or sequences; only the GEMMs run once per kv head): on small models the per-op
overhead, not the arithmetic, is what costs. Layout: K/V are gathered once as [B, L, Hkv, D]
and each kv head's tiles are read in place (row stride Hkv * D), the sequences forming the
GEMM batch; the rows of a (sequence, kv head) are (query slot j, head g of the group) at
j * group + g.
"""

from __future__ import annotations

import math

import torch

KV_TILE = 64
# Rows are processed in chunks so that the scores of one chunk stay within this many floats.
_SCORE_BUDGET = 1 << 24
# Smallest row chunk: a row count the GEMM is invariant at (any multiple of 4 is).
_MIN_CHUNK = 16
# Position given to padding rows: after every key (finite scores, never used).
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


def _bucket_slots(qlen: int, group: int) -> int:
    """Query slots of the bucket of a sequence with `qlen` queries: a power of two whose rows
    (slots * group) are a multiple of 4, so decodes of one call share one bucket and every
    bucket's GEMM row count is one MKL is invariant at."""
    least = 4 // math.gcd(group, 4)
    return max(least, 1 << (qlen - 1).bit_length())


def _gather_kv(cache: torch.Tensor, blocks: torch.Tensor, length: int, invalid: torch.Tensor
               ) -> torch.Tensor:
    """Whole cache blocks [B, nb] -> positions 0..length-1 as [Hkv, B, L, D] fp32, zero at the
    `invalid` flat positions [n] of [B, L] (never NaN: the probabilities there are 0, and
    0 * NaN would not be). A transposed view of [B, L, Hkv, D]: no copy, each kv head's
    matrices are read in place with a row stride of Hkv * D."""
    batch, num = blocks.shape
    hkv, d = cache.shape[2:]
    rows = cache.index_select(0, blocks.view(-1)).view(batch, num * cache.shape[1], hkv, d)
    rows = rows[:, :length]
    rows.view(batch * length, hkv * d).index_fill_(0, invalid, 0.0)
    return rows.float().permute(2, 0, 1, 3)


def _attend(qp: torch.Tensor, row_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
            ) -> torch.Tensor:
    """Rows qp [Hkv, B, R, D] at positions row_pos [B, R] over keys k, v [Hkv, B, L, D].

    k, v are views of [B, L', Hkv, D] (L <= L'): the GEMMs run one kv head at a time, since
    (head, sequence) pairs of those views do not merge into one batch dimension; everything
    else runs once. Where L < L', (sequence, tile) pairs do not merge either and `reshape`
    copies: the GEMM's bits do not depend on the row stride it reads K/V with (the bucket
    tests compare chunks that read fewer tiles than were gathered with ones that do not)."""
    hkv, batch, rows, d = qp.shape
    tiles = k.shape[2] // KV_TILE
    q_t = qp[:, :, None].expand(-1, -1, tiles, -1, -1).reshape(hkv, batch * tiles, rows, d)
    s = torch.empty(hkv, batch * tiles, rows, KV_TILE)
    for h in range(hkv):
        k_t = k[h].reshape(batch * tiles, KV_TILE, d).transpose(-1, -2)  # [BT, D, TILE]
        torch.bmm(q_t[h], k_t, out=s[h])
    s = s.view(hkv, batch, tiles, rows, KV_TILE)
    key_pos = torch.arange(tiles * KV_TILE).view(1, 1, tiles, 1, KV_TILE)
    hidden = key_pos > row_pos.view(1, batch, 1, rows, 1)
    seen = (~hidden).float()  # 1 where the key is visible
    m = s.masked_fill(hidden, float("-inf")).amax(dim=(2, 4), keepdim=True)
    # exp of -inf (or of anything that underflows) takes a slow path on x86: exponentiate
    # zeros where keys are hidden, then zero those probabilities exactly.
    p = s.sub_(m).mul_(seen).exp_().mul_(seen)
    denom = p.sum(-1).cumsum(2)[:, :, -1]  # [Hkv, B, R]
    p_t = p.view(hkv, batch * tiles, rows, KV_TILE)
    pv = torch.empty(hkv, batch * tiles, rows, d)
    for h in range(hkv):
        torch.bmm(p_t[h], v[h].reshape(batch * tiles, KV_TILE, d), out=pv[h])
    acc = pv.view(hkv, batch, tiles, rows, d).cumsum(2)[:, :, -1]
    return acc / denom[..., None]


def _attend_bucket(qs: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, tables: torch.Tensor, starts: list[int],
                   qlens: list[int], lens: list[int], slots: int) -> None:
    """Sequences of one bucket, each padded to `slots` queries: writes their rows of `out`.

    qs [T + 1, Hq, D] are the call's queries, scaled, and a zero row T that padding slots
    read; out [T + 1, Hq, D] gets each query's output at its token (padding slots write row
    T). tables [B, max_blocks] are the bucket's block tables; starts, qlens, lens: each
    sequence's first token, query count and length.
    """
    hq, d = qs.shape[1:]
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    batch, rows = len(lens), slots * group
    num_tiles = -(-max(lens) // KV_TILE)

    # Keys by position: position p of sequence b lives in block tables[b, p // block_size].
    length = num_tiles * KV_TILE
    first, qlen, seq_len = torch.tensor([starts, qlens, lens])[:, :, None]  # each [B, 1]
    cols = torch.arange(-(-length // block_size)).clamp(max=tables.shape[1] - 1)
    blocks = tables[:, cols].long().clamp(min=0)
    invalid = (torch.arange(length) >= seq_len).view(-1).nonzero().view(-1)  # flat [B, L]
    k = _gather_kv(k_cache, blocks, length, invalid)  # [Hkv, B, L, D]
    v = _gather_kv(v_cache, blocks, length, invalid)

    # Queries as rows [Hkv, B, R, D], row (slot j, head g of the group) at j * group + g;
    # row_pos [B, R] holds each row's query position (_NEVER for padding rows).
    j = torch.arange(slots)
    pad = j >= qlen  # [B, slots]
    tokens = (first + j).masked_fill_(pad, qs.shape[0] - 1)
    qp = qs[tokens].view(batch, slots, hkv, group, d).permute(2, 0, 1, 3, 4)
    qp = qp.reshape(hkv, batch, rows, d)
    row_pos = (seq_len - qlen + j).masked_fill_(pad, _NEVER)
    row_pos = row_pos[:, :, None].expand(-1, -1, group).reshape(batch, rows)

    # Row chunks of at most one tile of queries (a multiple of 4 rows, as every GEMM row count
    # here must be), each over the key tiles its queries can see (the tiles it skips would add
    # exact zeros).
    budget = _SCORE_BUDGET // (hkv * batch * length) // 4 * 4
    chunk = max(_MIN_CHUNK, min(KV_TILE * group, budget))
    edges = list(range(0, rows, chunk))
    if len(edges) > 1 and rows - edges[-1] < _MIN_CHUNK:
        edges.pop()
    edges.append(rows)
    parts = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        # The last position of a query with a row in [lo, hi), over the bucket's sequences.
        last = max((n - q + min(q, -(-hi // group)) - 1
                    for n, q in zip(lens, qlens, strict=True) if q > lo // group), default=0)
        keys = (last // KV_TILE + 1) * KV_TILE
        parts.append(_attend(qp[:, :, lo:hi], row_pos[:, lo:hi], k[:, :, :keys], v[:, :, :keys]))
    att = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # [Hkv, B, R, D]
    out[tokens.view(-1)] = att.view(hkv, batch, slots, group, d).permute(1, 2, 0, 3, 4).reshape(
        batch * slots, hq, d)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention of q [T, Hq, D] over the paged cache; see kernels/attention.py."""
    num_tokens, hq, d = q.shape
    group = hq // k_cache.shape[2]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    qlens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    buckets: dict[int, list[int]] = {}
    for i, n in enumerate(qlens):
        if n:
            buckets.setdefault(_bucket_slots(n, group), []).append(i)

    # The softmax scale folded into the queries once; row T stays zero for padding slots.
    qs = torch.zeros(num_tokens + 1, hq, d)
    qs[:num_tokens] = q.float() * scale
    out = torch.empty(num_tokens + 1, hq, d)
    for slots, seqs in buckets.items():
        tables = block_tables if len(seqs) == len(lens) else block_tables[seqs]
        _attend_bucket(qs, out, k_cache, v_cache, tables, [starts[i] for i in seqs],
                       [qlens[i] for i in seqs], [lens[i] for i in seqs], slots)
    return out[:num_tokens].to(q.dtype)
