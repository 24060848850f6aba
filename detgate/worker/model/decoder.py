"""The Qwen3 / Llama decoder: embeddings, N x (attention + SwiGLU) with pre-norm residuals, LM head.

Parameter names follow the Hugging Face checkpoints (`model.layers.0.self_attn...`), except that
q/k/v and gate/up are packed into one matrix each (see Linear.shard_sizes and the loader).
"""

from __future__ import annotations

import torch
from torch import nn

from detgate.kernels.quantised import QuantisedWeight
from detgate.worker.model.attention_metadata import AttentionMetadata
from detgate.worker.model.config import ModelConfig
from detgate.worker.model.layers.attention import Attention
from detgate.worker.model.layers.linear import Linear
from detgate.worker.model.layers.mlp import SwiGLU
from detgate.worker.model.layers.rms_norm import RMSNorm
from detgate.worker.model.layers.rotary import RotaryEmbedding
from detgate.worker.model.ops import KVCache, Ops


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, ops: Ops) -> None:
        super().__init__()
        self.self_attn = Attention(config, rotary, ops)
        self.mlp = SwiGLU(config, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, config.dtype)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, ops, config.dtype
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        kv_cache: KVCache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately so each norm can fuse the add before it.
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta, kv_cache)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _freeze=True,
            _weight=torch.empty(config.vocab_size, config.hidden_size, dtype=config.dtype),
        )
        # One table shared by every layer.
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary, ops) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, config.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, meta, kv_cache)
        hidden, _ = self.norm.add_forward(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """`model(input_ids [T], positions [T], meta, kv_caches) -> hidden [T, H]`;
    `compute_logits(hidden [B, H]) -> logits [B, V]` in the model's dtype (widening them is
    the log_softmax's and the sampler's job: exact, and on the GPU no extra pass over
    [B, V])."""

    def __init__(self, config: ModelConfig, ops: Ops) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.model = DecoderModel(config, ops)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, [config.vocab_size], ops, config.dtype)
        )
        # The tied head's GGUF blocks, when served quantised (Linear.quantised says why).
        self.quantised_head: QuantisedWeight | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden)
        weight = self.model.embed_tokens.weight if self.quantised_head is None \
            else self.quantised_head
        return self.ops.linear(hidden, weight)


def build_model(config: ModelConfig, ops: Ops) -> CausalLM:
    """An uninitialised model on torch's current default device; the loader fills its weights."""
    return CausalLM(config, ops).eval()
