"""ModelConfig: the decoder's shape, read from a Hugging Face `config.json` (Qwen3 and Llama)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from detgate.contract.constants import DTYPES

# Architectures the decoder in worker/model implements, and whether each normalises q and k
# per head before RoPE (Qwen3 does, Llama and Qwen2 do not).
ARCHITECTURES: dict[str, bool] = {
    "Qwen3ForCausalLM": True,
    "LlamaForCausalLM": False,
    "Qwen2ForCausalLM": False,
}

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPES}


class ModelConfigError(ValueError):
    """config.json describes a model this worker cannot run."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling ("rope_type": "llama3") or plain linear scaling."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: torch.dtype

    @classmethod
    def from_dict(cls, raw: dict[str, Any], dtype: torch.dtype) -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelConfigError(
                f"unsupported architectures {archs}; supported: {sorted(ARCHITECTURES)}"
            )
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise ModelConfigError(
                f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads"
            )
        if raw.get("hidden_act", "silu") != "silu" or raw.get("mlp_bias"):
            raise ModelConfigError("only SwiGLU MLPs without bias are supported")
        # transformers >= 5 writes theta and scaling together as "rope_parameters".
        rope = raw.get("rope_parameters") or {}
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=_rope_scaling(raw.get("rope_scaling") or rope),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qk_norm=ARCHITECTURES[arch],
            # Qwen2 carries q/k/v biases without saying so in its config.
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            dtype=dtype,
        )

    @classmethod
    def from_file(cls, path: Path, dtype: torch.dtype) -> ModelConfig:
        return cls.from_dict(json.loads(Path(path).read_text()), dtype)


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(raw["factor"]))
    if kind == "llama3":
        return RopeScaling(
            "llama3",
            float(raw["factor"]),
            float(raw.get("low_freq_factor", 1.0)),
            float(raw.get("high_freq_factor", 4.0)),
            int(raw.get("original_max_position_embeddings", 8192)),
        )
    raise ModelConfigError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")
