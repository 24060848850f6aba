"""Paged attention on the CPU: `store_kv` (a copy) and `paged_attention`, both compiled.

Order (the invariant), from kernels/csrc/cpu_kernels.cpp: a query at position p of its
sequence reads that sequence's keys 0..p in increasing position, through its block table, so
the cache's block size, the other sequences of the call, decode vs prefill and the prefill's
chunking never change which numbers it adds or in what order. Per query head: scores as 8-lane
dot products over the head dim; max; exp and their sum over the p + 1 scores (8 lanes, fixed
tree); the value sum per head-dim element as one fma chain in increasing position; one
division. Every order depends only on (head dim, p + 1). The softmax scale is folded into the
queries inside the call: one IEEE multiply per element, the bits of torch's `q * scale`.
"""

from __future__ import annotations

import torch

from detgate.kernels.cpu_ext import load


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, Hkv, D] into the caches [num_blocks, block_size, Hkv, D] at slot_mapping
    [T] (block * block_size + offset); negative slots are skipped."""
    load().store_kv(_heads(k.to(k_cache.dtype)), _heads(v.to(v_cache.dtype)), k_cache, v_cache,
                    slot_mapping.to(torch.int64))


def _heads(x: torch.Tensor) -> torch.Tensor:
    """x [T, Hkv, D] with adjacent heads of adjacent elements (a view when it already is)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def _int32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.int32).contiguous()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, decode: bool = False) -> torch.Tensor:
    """Causal GQA attention of q [T, Hq, D] over the paged cache; see kernels/attention.py.
    `decode` changes nothing here: the kernel runs one query at a time whatever the step."""
    if k_cache.dtype not in (torch.float32, torch.bfloat16):
        k_cache, v_cache = k_cache.float(), v_cache.float()
    out = load().paged_attention(q.float().contiguous(), k_cache.contiguous(),
                                 v_cache.contiguous(), _int32(block_tables),
                                 _int32(query_start_loc), _int32(seq_lens), scale)
    return out.to(q.dtype)
