"""Decoder models. Qwen3, Qwen2 and Llama share one implementation (worker/models/decoder.py);
ModelConfig records what differs between them (q/k norm, biases, RoPE scaling, tied embeddings)."""

from __future__ import annotations

from worker.config import ModelConfig
from worker.models.decoder import CausalLM
from worker.ops import Ops


def build_model(config: ModelConfig, ops: Ops) -> CausalLM:
    """An uninitialised model on torch's current default device; the loader fills its weights."""
    return CausalLM(config, ops).eval()
