"""Paged attention for the engine: `store_kv` then `paged_attention`, dispatched by device.

    store_kv(k, v, k_cache, v_cache, slot_mapping) -> None
        k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D];
        slot_mapping: [T] int64 = block_id * block_size + offset; entries < 0 are skipped.
    paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                    decode=False)
        q: [T, Hq, D], the queries of all sequences concatenated; sequence i owns
        q[query_start_loc[i]:query_start_loc[i+1]], its LAST positions (query j sits at
        seq_lens[i] - qlen_i + j). block_tables: [B, max_blocks] int32 (padding 0 or -1).
        Causal, GQA (Hq % Hkv == 0). Returns [T, Hq, D] in q's dtype. decode=True promises
        at most one query per sequence (a decode step: CUDA then takes its decode launch).

Invariant (both implementations): a query's output bits depend only on its q row, its
position and its sequence's cached K/V, never on the other queries or sequences in the call,
on how the prompt was chunked, on decode vs prefill, nor on the cache's block size. K/V are
always stored before attention, so fresh and cached keys are read and reduced the same way.
CPU: `kernels.attention_cpu`; CUDA: `kernels.attention_triton` (imported on first use).
"""

from __future__ import annotations

import torch

from detgate.kernels import by_device


def _impl(name: str, x: torch.Tensor):
    return by_device(x, name, "detgate.kernels.attention_triton", "detgate.kernels.attention_cpu")


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, query_start_loc: torch.Tensor,
           seq_lens: torch.Tensor) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged_attention: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} "
                         f"and {tuple(v_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError("paged_attention: head dims differ or Hq is not a multiple of Hkv")
    block_size = k_cache.shape[1]
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"paged_attention: block size {block_size} is not a power of two >= 16")
    batch = seq_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1 or block_tables.shape[0] != batch:
        raise ValueError("paged_attention: query_start_loc, seq_lens and block_tables disagree")


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write this step's K/V into the paged caches (before attention reads them)."""
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"cache {tuple(k_cache.shape)}")
    _impl("store_kv", k)(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, decode: bool = False) -> torch.Tensor:
    """Causal GQA attention of every query over its sequence's cached K/V (see above).

    `decode`: the caller's promise that no sequence has more than one query (a decode step),
    which lets the CUDA kernel take its decode launch; same bits either way."""
    _check(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens)
    return _impl("paged_attention", q)(q, k_cache, v_cache, block_tables, query_start_loc,
                                       seq_lens, scale, decode=decode)
