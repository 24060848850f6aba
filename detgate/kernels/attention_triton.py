"""Paged attention in Triton (CUDA): K/V store, and varlen causal GQA attention over the cache.

Reduction order (the invariant), the same for every query whatever the call:
- the KV axis is cut into splits of `KV_SPLIT` positions (split s = [s*KV_SPLIT, (s+1)*KV_SPLIT),
  a fixed SIZE, never a fixed number of splits), each split into tiles of `BLOCK_N` positions,
  and into groups of `KV_GROUP` positions, each a fixed run of whole splits;
- inside a split, a query folds its visible tiles in ascending order into an online softmax
  (`_tile_step`); a tile after the query's position leaves its state untouched (`where`);
- inside a tile, every sum is a matrix product, i.e. one chain of MMA k16 steps in increasing
  k per output element: q.k over the head dim, p @ v and the row sum of p (p @ ones) over the
  tile's positions; the rest is exact (max) or elementwise. No sum is left to a reduction whose
  tree would follow how the tile's rows and columns sit in threads and warps;
- a group is its splits merged in split order by `_merge` into an empty state, the result its
  groups merged in group order into an empty state. Small splits give a short sequence's
  decode more programs; groups keep a long context's split launch at one program (and one
  merge in the combine) per KV_GROUP positions.
Two launch shapes run that same arithmetic: "fused" (one program per query block and KV head
walks all its tiles in one loop, `_fold`, merging splits and groups in registers as they end:
no workspace, for prefill and big batches) and "split" (one program per query block, KV head
and unit, a group or for a short context a split, writes its partial result, then
`_combine_kernel` merges them, splits into groups where the units are splits: parallelism
for few queries). All use the same tile shapes, warps and helpers, and floating-point
contraction is off (no mul+add fused into an FMA in one kernel but not the other), so a
query's bits do not depend on which launch ran it, nor on its row inside the query block,
nor on the other queries and sequences.
A decode-only call (`decode=True`: at most one query per sequence) maps program i to sequence i
instead of searching query_start_loc for it, and runs tiles of `DECODE` rows (16: the GROUP rows
of its one query, where 64-row tiles would be three quarters padding) with its own warps and
stages. The chains above are the same; what changes is the instruction that runs them (mma.sync
on 16 rows, wgmma on 64 rows on Hopper): that both give each element the same bits is the
hardware's, checked on the GPU (tests/kernels/test_attention_gpu.py: every position decoded
against its prefill) and at every worker start (kernels/selfcheck.py); DETGATE_DECODE_TILE=0
makes decode launches take the 64-row tiles.

Rows of a program are (query, head of the GQA group) pairs: row r = query r // GROUP_PAD of the
block, q head kv_head * GROUP + r % GROUP_PAD. Keys are read by position through the block
table, so the tiles do not depend on the cache's block size.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from detgate.kernels import pdl
from detgate.kernels.attention_tiles import DECODE, SHIPPED

# BLOCK_M: rows (query x group head) per program; BLOCK_N: KV positions per tile.
BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES = SHIPPED
DECODE_BLOCK_M, DECODE_NUM_WARPS, DECODE_NUM_STAGES = DECODE
DECODE_TILE = os.environ.get("DETGATE_DECODE_TILE", "1") != "0"
# Columns of the ones that p is multiplied by for its row sum: the MMA's smallest N.
ROW_SUM_COLUMNS = tl.constexpr(16)
KV_SPLIT = 64  # KV positions per split: a multiple of BLOCK_N (one tile of the shipped tiles)
KV_GROUP = 1024  # KV positions per group of splits: a multiple of KV_SPLIT
# The split launch is taken while the fused one would have fewer programs than this many per
# SM: below it, more programs pay for the combine kernel. It runs a program per group, or per
# split where even that many would be fewer (one short sequence). Launch shape only.
SPLIT_PROGRAMS_BELOW = 2
# A call that is not decode-only runs its one-query sequences (the decodes of a mixed step)
# in a launch of their own with the decode tiles, the others in the general launch: the same
# bits (the decode tile: see above), without 64-row tiles of which a decode fills GROUP rows.
MIXED_DECODE_TILE = os.environ.get("DETGATE_MIXED_DECODE_TILE", "1") != "0"
ALL, SINGLE, MULTI = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # launch subsets
COMBINE_HEADS = 2  # heads x head-dim slice per combine program: spread the merge loops wide
COMBINE_DIMS = 64
_LOG2E = 1.4426950408889634
_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_vt,
                     stride_cache_slot, ROW: tl.constexpr, ROW_PAD: tl.constexpr,
                     PDL: tl.constexpr):
    pdl.enter(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    offs = tl.arange(0, ROW_PAD)
    mask = offs < ROW
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + offs, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + offs, mask=mask)
    tl.store(k_cache_ptr + slot * stride_cache_slot + offs, k, mask=mask)
    tl.store(v_cache_ptr + slot * stride_cache_slot + offs, v, mask=mask)


@triton.jit
def _find_seq(qsl_ptr, target, num_seqs, BLOCK_Q: tl.constexpr, PER_BLOCK: tl.constexpr):
    """The sequence owning `target`: a token (qsl[i] <= target < qsl[i+1]) or, PER_BLOCK, a
    query-block program id (sequence i owns ids [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q
    + i + 1): every sequence gets enough blocks without the host knowing the query lengths)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid)
        if PER_BLOCK:
            first = first // BLOCK_Q + mid
        if first <= target:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _empty(ROWS: tl.constexpr, COLS: tl.constexpr):
    """The online softmax's empty state (m, denom, acc) for ROWS rows of COLS values."""
    return (tl.full([ROWS], float("-inf"), tl.float32), tl.zeros([ROWS], tl.float32),
            tl.zeros([ROWS, COLS], tl.float32))


@triton.jit
def _tile_step(m, denom, acc, q, q_pos, n0, seq_len, table_ptr, k_cache_ptr, v_cache_ptr,
               kv_head, stride_cache_slot, stride_cache_head, qk_scale,
               BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               PRECISION: tl.constexpr):
    """Fold the tile of positions [n0, n0 + BLOCK_N) into the online softmax (m, denom, acc):
    running max (log2 domain), sum and unnormalised sum of p * v."""
    offs_d = tl.arange(0, HEAD_DIM)
    ones = tl.full([BLOCK_N, ROW_SUM_COLUMNS], 1.0, v_cache_ptr.dtype.element_ty)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    key_ok = offs_n < seq_len
    block = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    row = (block * BLOCK_SIZE + offs_n % BLOCK_SIZE) * stride_cache_slot \
        + kv_head * stride_cache_head
    k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=key_ok[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    visible = (offs_n[None, :] <= q_pos[:, None]) & key_ok[None, :]
    s = tl.where(visible, s, float("-inf"))
    # A row before this tile sees none of it: its state must stay bit-for-bit.
    seen = n0 <= q_pos
    m_new = tl.where(seen, tl.maximum(m, tl.max(s, 1)), 0.0)
    p = tl.exp2(s - m_new[:, None]).to(v.dtype)
    alpha = tl.exp2(m - m_new)
    # Row sum as p @ ones: the same k16 chain over positions as p @ v (its columns are
    # equal; max picks one exactly), whatever the tile's thread and warp layout.
    row_sum = tl.max(tl.dot(p, ones, input_precision=PRECISION), 1)
    denom_new = denom * alpha + row_sum
    acc_new = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return (tl.where(seen, m_new, m), tl.where(seen, denom_new, denom),
            tl.where(seen[:, None], acc_new, acc))


@triton.jit
def _split_partial(q, q_pos, kv_lo, kv_hi, seq_len, table_ptr, k_cache_ptr, v_cache_ptr,
                   kv_head, stride_cache_slot, stride_cache_head, qk_scale,
                   BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax of rows q [BLOCK_M, D] over positions [kv_lo, kv_hi), tile by tile.

    Returns (m, denom, acc): running max (log2 domain), sum and unnormalised sum of p * v."""
    m, denom, acc = _empty(BLOCK_M, HEAD_DIM)
    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        m, denom, acc = _tile_step(m, denom, acc, q, q_pos, n0, seq_len, table_ptr, k_cache_ptr,
                                   v_cache_ptr, kv_head, stride_cache_slot, stride_cache_head,
                                   qk_scale, BLOCK_SIZE, HEAD_DIM, BLOCK_N, PRECISION)
    return m, denom, acc


@triton.jit
def _merge(m_run, denom_run, acc_run, m, denom, acc):
    """Fold one split's (m, denom, acc) into the running result; a split a row did not see
    (m = -inf) leaves it untouched."""
    has = m > float("-inf")
    m_new = tl.where(has, tl.maximum(m_run, m), 0.0)
    c_run = tl.exp2(m_run - m_new)
    c = tl.exp2(m - m_new)
    denom_new = denom_run * c_run + denom * c
    acc_new = acc_run * c_run[:, None] + acc * c[:, None]
    return (tl.where(has, m_new, m_run), tl.where(has, denom_new, denom_run),
            tl.where(has[:, None], acc_new, acc_run))


@triton.jit
def _fold(q, q_pos, kv_lo, kv_hi, seq_len, table_ptr, k_cache_ptr, v_cache_ptr, kv_head,
          stride_cache_slot, stride_cache_head, qk_scale, BLOCK_SIZE: tl.constexpr,
          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          KV_SPLIT: tl.constexpr, KV_GROUP: tl.constexpr, GROUPS: tl.constexpr,
          PRECISION: tl.constexpr):
    """The tiles of [kv_lo, kv_hi) (kv_lo on a group's start) in one loop, so that the
    pipeline's loads run ahead across split and group ends: a split is merged into its group
    once its last tile is folded and, GROUPS, a group into the run once its last split is.
    Returns the run (GROUPS) or the one group's merged splits (not GROUPS)."""
    m_run, denom_run, acc_run = _empty(BLOCK_M, HEAD_DIM)
    m_grp, denom_grp, acc_grp = _empty(BLOCK_M, HEAD_DIM)
    m, denom, acc = _empty(BLOCK_M, HEAD_DIM)
    for n0 in range(kv_lo, kv_hi, BLOCK_N):
        m, denom, acc = _tile_step(m, denom, acc, q, q_pos, n0, seq_len, table_ptr, k_cache_ptr,
                                   v_cache_ptr, kv_head, stride_cache_slot, stride_cache_head,
                                   qk_scale, BLOCK_SIZE, HEAD_DIM, BLOCK_N, PRECISION)
        last = n0 + BLOCK_N >= kv_hi
        if ((n0 + BLOCK_N) % KV_SPLIT == 0) | last:
            m_grp, denom_grp, acc_grp = _merge(m_grp, denom_grp, acc_grp, m, denom, acc)
            m, denom, acc = _empty(BLOCK_M, HEAD_DIM)
        if GROUPS:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if ((n0 + BLOCK_N) % KV_GROUP == 0) | last:
                m_run, denom_run, acc_run = _merge(m_run, denom_run, acc_run, m_grp, denom_grp,
                                                   acc_grp)
                m_grp, denom_grp, acc_grp = _empty(BLOCK_M, HEAD_DIM)
    if GROUPS:
        return m_run, denom_run, acc_run
    return m_grp, denom_grp, acc_grp


@triton.jit
def _attn_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr, qsl_ptr, seq_lens_ptr,
                 ws_ml_ptr, ws_acc_ptr, num_seqs, stride_qt, stride_qh, stride_ot, stride_oh,
                 stride_table, stride_cache_slot, stride_cache_head, stride_ws_t, stride_ws_h,
                 qk_scale, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, KV_SPLIT: tl.constexpr, KV_GROUP: tl.constexpr,
                 SPLIT_PROGRAMS: tl.constexpr, PER_SPLIT: tl.constexpr, DECODE: tl.constexpr,
                 SUBSET: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    pdl.enter(PDL)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    # DECODE: program i is sequence i, its query (if it has one) in rows 0..GROUP-1 as below.
    seq = pid if DECODE else _find_seq(qsl_ptr, pid, num_seqs, BLOCK_Q, True)
    q_begin = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_begin
    q_first = 0 if DECODE else (pid - (q_begin // BLOCK_Q + seq)) * BLOCK_Q  # block's 1st query
    if q_first >= q_len:
        return
    if SUBSET != ALL:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if (q_len == 1) != (SUBSET == SINGLE):
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_first + offs_m // GROUP_PAD
    g = offs_m % GROUP_PAD
    row_ok = (q_idx < q_len) & (g < GROUP)
    q_pos = tl.where(row_ok, seq_len - q_len + q_idx, -1)
    tok = (q_begin + q_idx).to(tl.int64)
    head = kv_head * GROUP + g
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    kv_end = tl.minimum(seq_len - q_len + q_first + BLOCK_Q, seq_len)  # last row's pos + 1
    table_ptr = tables_ptr + seq.to(tl.int64) * stride_table
    if SPLIT_PROGRAMS:
        # This program's unit: one split (its partial) or one group (its splits merged).
        unit_lo = tl.program_id(2) * (KV_SPLIT if PER_SPLIT else KV_GROUP)
        if unit_lo >= kv_end:
            return
        if PER_SPLIT:
            m, denom, acc = _split_partial(q, q_pos, unit_lo,
                                           tl.minimum(unit_lo + KV_SPLIT, kv_end), seq_len,
                                           table_ptr, k_cache_ptr, v_cache_ptr, kv_head,
                                           stride_cache_slot, stride_cache_head, qk_scale,
                                           BLOCK_SIZE, HEAD_DIM, BLOCK_M, BLOCK_N, PRECISION)
        else:
            m, denom, acc = _fold(q, q_pos, unit_lo, tl.minimum(unit_lo + KV_GROUP, kv_end),
                                  seq_len, table_ptr, k_cache_ptr, v_cache_ptr, kv_head,
                                  stride_cache_slot, stride_cache_head, qk_scale, BLOCK_SIZE,
                                  HEAD_DIM, BLOCK_M, BLOCK_N, KV_SPLIT, KV_GROUP, False,
                                  PRECISION)
        keep = row_ok & (q_pos >= unit_lo)
        ws = tok * stride_ws_t + head * stride_ws_h + tl.program_id(2)
        tl.store(ws_ml_ptr + 2 * ws, m, mask=keep)
        tl.store(ws_ml_ptr + 2 * ws + 1, denom, mask=keep)
        tl.store(ws_acc_ptr + ws[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=keep[:, None])
    else:
        m_run, denom_run, acc_run = _fold(q, q_pos, 0, kv_end, seq_len, table_ptr, k_cache_ptr,
                                          v_cache_ptr, kv_head, stride_cache_slot,
                                          stride_cache_head, qk_scale, BLOCK_SIZE, HEAD_DIM,
                                          BLOCK_M, BLOCK_N, KV_SPLIT, KV_GROUP, True, PRECISION)
        out = acc_run / denom_run[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _partial(ws_ml_ptr, ws_acc_ptr, tok, heads, head_ok, dims, unit, stride_ws_t, stride_ws_h,
             HEAD_DIM: tl.constexpr):
    """One unit's (m, denom, acc) of the token's heads, as the attention kernel parked it."""
    ws = tok.to(tl.int64) * stride_ws_t + heads * stride_ws_h + unit
    m = tl.load(ws_ml_ptr + 2 * ws, mask=head_ok, other=float("-inf"))
    denom = tl.load(ws_ml_ptr + 2 * ws + 1, mask=head_ok, other=0.0)
    acc = tl.load(ws_acc_ptr + ws[:, None] * HEAD_DIM + dims[None, :], mask=head_ok[:, None],
                  other=0.0)
    return m, denom, acc


@triton.jit
def _combine_kernel(out_ptr, qsl_ptr, seq_lens_ptr, ws_ml_ptr, ws_acc_ptr, num_seqs,
                    stride_ot, stride_oh, stride_ws_t, stride_ws_h, HQ: tl.constexpr,
                    HEADS: tl.constexpr, DIMS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    KV_SPLIT: tl.constexpr, KV_GROUP: tl.constexpr, PER_SPLIT: tl.constexpr,
                    SUBSET: tl.constexpr, PDL: tl.constexpr):
    """One program per (token, HEADS heads, DIMS of the head dim): merges the token's groups
    0..pos // KV_GROUP in order into the run, PER_SPLIT each group first from its splits in
    order (the fused launch's `_fold`, step for step)."""
    pdl.enter(PDL)
    tok = tl.program_id(0)
    seq = _find_seq(qsl_ptr, tok, num_seqs, 1, False)
    q_end = tl.load(qsl_ptr + seq + 1)
    if SUBSET != ALL:  # noqa: SIM102 (a compile-time branch around a run-time one)
        if (q_end - tl.load(qsl_ptr + seq) == 1) != (SUBSET == SINGLE):
            return
    pos = tl.load(seq_lens_ptr + seq) - q_end + tok
    heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    head_ok = heads < HQ
    dims = tl.program_id(2) * DIMS + tl.arange(0, DIMS)
    m_run, denom_run, acc_run = _empty(HEADS, DIMS)
    SPLITS: tl.constexpr = KV_GROUP // KV_SPLIT
    for group in range(0, pos // KV_GROUP + 1):
        if PER_SPLIT:
            m_grp, denom_grp, acc_grp = _empty(HEADS, DIMS)
            for split in range(group * SPLITS, tl.minimum(group * SPLITS + SPLITS,
                                                          pos // KV_SPLIT + 1)):
                m, denom, acc = _partial(ws_ml_ptr, ws_acc_ptr, tok, heads, head_ok, dims,
                                         split, stride_ws_t, stride_ws_h, HEAD_DIM)
                m_grp, denom_grp, acc_grp = _merge(m_grp, denom_grp, acc_grp, m, denom, acc)
        else:
            m_grp, denom_grp, acc_grp = _partial(ws_ml_ptr, ws_acc_ptr, tok, heads, head_ok,
                                                 dims, group, stride_ws_t, stride_ws_h, HEAD_DIM)
        m_run, denom_run, acc_run = _merge(m_run, denom_run, acc_run, m_grp, denom_grp, acc_grp)
    out = acc_run / denom_run[:, None]
    tl.store(out_ptr + tok.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
             + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _fills(programs: int, device: torch.device) -> bool:
    """At least SPLIT_PROGRAMS_BELOW programs per SM (Triton's interpreter: one SM)."""
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 1
    return programs >= SPLIT_PROGRAMS_BELOW * sms


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, Hkv, D] into the caches at slot_mapping [T]; negative slots skipped."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv: the caches must be contiguous")
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    k2 = k.reshape(num_tokens, -1).to(k_cache.dtype)
    v2 = v.reshape(num_tokens, -1).to(v_cache.dtype)
    row = k2.shape[1]
    _store_kv_kernel[(num_tokens,)](k2, v2, k_cache, v_cache, slot_mapping, k2.stride(0),
                                    v2.stride(0), k_cache.stride(1), ROW=row,
                                    ROW_PAD=triton.next_power_of_2(row), **pdl.options(k2))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, decode: bool = False,
                    split_programs: bool | None = None, per_split: bool | None = None,
                    decode_tile_singles: bool | None = None) -> torch.Tensor:
    """Causal GQA attention of q [T, Hq, D] over the paged cache -> [T, Hq, D] in q's dtype.

    `decode`: the caller knows that no sequence has more than one query (a decode step); a
    sequence with more would be computed wrongly. `split_programs` picks the launch shape and
    `per_split` the split launch's unit, a split or a group (None: by occupancy);
    `decode_tile_singles` whether a call that is not decode-only runs its one-query sequences
    in a decode launch of their own (None: MIXED_DECODE_TILE). None of them changes a bit of
    the result (the decode tile: see above)."""
    if q.dtype not in _SUPPORTED or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"paged_attention: q and caches in one of {_SUPPORTED}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged_attention: the caches must be contiguous")
    if q.stride(2) != 1:  # rows may be strided (a view of a fused qkv), elements may not
        q = q.contiguous()
    num_tokens, hq, d = q.shape
    group = hq // k_cache.shape[2]
    if triton.next_power_of_2(group) > BLOCK_M or d & (d - 1) or d < 16:
        raise ValueError(f"paged_attention: GQA group {group} or head dim {d} not supported")
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if decode and num_tokens > seq_lens.shape[0]:
        raise ValueError(f"paged_attention: decode with {num_tokens} queries for "
                         f"{seq_lens.shape[0]} sequences")
    if decode_tile_singles is None:
        decode_tile_singles = MIXED_DECODE_TILE
    args = (q, k_cache, v_cache, out, block_tables.to(torch.int32),
            query_start_loc.to(torch.int32), seq_lens.to(torch.int32), scale)
    if decode or not (DECODE_TILE and decode_tile_singles):
        _launch(*args, decode, ALL.value, split_programs, per_split)
    else:
        _launch(*args, True, SINGLE.value, None, None)
        _launch(*args, False, MULTI.value, split_programs, per_split)
    return out


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
            tables: torch.Tensor, qsl: torch.Tensor, lens: torch.Tensor, scale: float,
            decode: bool, subset: int, split_programs: bool | None,
            per_split: bool | None) -> None:
    """One launch (and its combine) over the sequences of `subset`, into out."""
    num_tokens, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    group = hq // hkv
    group_pad = triton.next_power_of_2(group)
    num_seqs = lens.shape[0]
    block_m, warps, stages = BLOCK_M, NUM_WARPS, NUM_STAGES
    if decode and DECODE_TILE:
        # No deeper a pipeline than the configuration's own (its shared memory with BLOCK_N).
        block_m, warps, stages = max(DECODE_BLOCK_M, group_pad), DECODE_NUM_WARPS, \
            min(DECODE_NUM_STAGES, NUM_STAGES)
    q_blocks = num_seqs if decode else num_tokens // (block_m // group_pad) + num_seqs
    width = tables.shape[1] * block_size
    max_splits, max_groups = triton.cdiv(width, KV_SPLIT), triton.cdiv(width, KV_GROUP)
    if split_programs is None:
        split_programs = max_splits > 1 and not _fills(q_blocks * hkv, q.device)
    if per_split is None:
        per_split = split_programs and not _fills(q_blocks * hkv * max_groups, q.device)
    units = max_splits if per_split else max_groups
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    launch = pdl.options(q)
    if split_programs:
        ws_ml = torch.empty(num_tokens, hq, units, 2, device=q.device, dtype=torch.float32)
        ws_acc = torch.empty(num_tokens, hq, units, d, device=q.device, dtype=torch.float32)
        grid = (q_blocks, hkv, units)
    else:
        ws_ml = ws_acc = out  # unused
        grid = (q_blocks, hkv)
    _attn_kernel[grid](q, k_cache, v_cache, out, tables, qsl, lens, ws_ml, ws_acc, num_seqs,
                       q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
                       k_cache.stride(1), k_cache.stride(2), hq * units, units,
                       scale * _LOG2E, BLOCK_SIZE=block_size, HEAD_DIM=d, GROUP=group,
                       GROUP_PAD=group_pad, BLOCK_M=block_m, BLOCK_N=BLOCK_N, KV_SPLIT=KV_SPLIT,
                       KV_GROUP=KV_GROUP, SPLIT_PROGRAMS=split_programs, PER_SPLIT=per_split,
                       DECODE=decode, SUBSET=subset, PRECISION=precision, num_warps=warps,
                       num_stages=stages, enable_fp_fusion=False, **launch)
    if split_programs:
        heads, dims = min(COMBINE_HEADS, hq), min(COMBINE_DIMS, d)
        grid = (num_tokens, triton.cdiv(hq, heads), d // dims)
        _combine_kernel[grid](out, qsl, lens, ws_ml, ws_acc, num_seqs, out.stride(0),
                              out.stride(1), hq * units, units, HQ=hq,
                              HEADS=triton.next_power_of_2(heads), DIMS=dims, HEAD_DIM=d,
                              KV_SPLIT=KV_SPLIT, KV_GROUP=KV_GROUP, PER_SPLIT=per_split,
                              SUBSET=subset, num_warps=NUM_WARPS, enable_fp_fusion=False,
                              **launch)
