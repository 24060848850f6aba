"""Grouped-query self-attention over the paged KV cache, with optional per-head q/k RMSNorm."""

from __future__ import annotations

import functools
from importlib import import_module

import torch
from torch import nn

from detgate.worker.model.attention_metadata import AttentionMetadata
from detgate.worker.model.config import ModelConfig
from detgate.worker.model.layers.linear import Linear
from detgate.worker.model.layers.rms_norm import RMSNorm
from detgate.worker.model.layers.rotary import RotaryEmbedding
from detgate.worker.model.ops import KVCache, Ops


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = Linear(
            config.hidden_size,
            [q_size, kv_size, kv_size],
            ops,
            config.dtype,
            bias=config.attention_bias,
        )
        self.o_proj = Linear(q_size, [config.hidden_size], ops, config.dtype)
        self.rotary = rotary
        self.q_norm = (
            RMSNorm(config.head_dim, config.rms_norm_eps, ops, config.dtype)
            if config.qk_norm
            else None
        )
        self.k_norm = (
            RMSNorm(config.head_dim, config.rms_norm_eps, ops, config.dtype)
            if config.qk_norm
            else None
        )

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
    ) -> torch.Tensor:
        # positions: [T]; x: [T, hidden]
        out = self.attend(positions, self.qkv_proj(x), meta, kv_cache)  # [T, Hq, D]
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.head_dim))

    def attend(
        self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata,
        kv_cache: KVCache
    ) -> torch.Tensor:
        """Everything between the two projections: qkv [T, (Hq + 2 Hkv) D] -> [T, Hq, D] (q/k
        norm, rotary, this step's K/V stored, attention over the cache). The trainer
        (detgate.train) runs this same code on a cache holding its batch's K/V."""
        t = qkv.shape[0]
        k_cache, v_cache = kv_cache
        if qkv.is_cuda and qkv_triton().supported(qkv, self.num_heads, self.num_kv_heads,
                                                  self.head_dim, self.rotary.cos, k_cache):
            # q/k norm, rotary and the K/V store in one launch (both modes on CUDA)
            q = qkv_triton().norm_rope_store(
                qkv, positions, self.rotary.cos, self.rotary.sin,
                self.q_norm.weight if self.q_norm is not None else None,
                self.k_norm.weight if self.k_norm is not None else None,
                self.q_norm.eps if self.q_norm is not None else 0.0,
                k_cache, v_cache, meta.slot_mapping, self.num_heads, self.num_kv_heads)
        else:
            q, k, v = qkv.split(self.qkv_proj.shard_sizes, dim=-1)
            q = q.reshape(t, self.num_heads, self.head_dim)
            k = k.reshape(t, self.num_kv_heads, self.head_dim)
            v = v.reshape(t, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.ops.rotate(self.rotary, positions, q, k)
            self.ops.store_kv(k, v, kv_cache, meta)
        return self.ops.attention(q, kv_cache, meta, self.scale)  # [T, Hq, D]


@functools.cache
def qkv_triton():
    """kernels.qkv_triton, imported on first use (it needs triton; the CPU path does not)."""
    return import_module("detgate.kernels.qkv_triton")
