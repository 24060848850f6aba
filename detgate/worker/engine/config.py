"""EngineConfig: every knob of one worker process, built once where the process starts."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from detgate.contract.constants import DEFAULT_DTYPE, DEFAULT_MODE, DTYPES, MODES


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"
    mode: str = DEFAULT_MODE
    device: str = "cpu"
    dtype: str = DEFAULT_DTYPE
    # Scheduler limits: sequences in flight and tokens run in one step (a CUDA worker whose flags
    # leave them unset takes cuda_batch_limits' instead, in from_args).
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Longest prefill chunk one sequence gets in a step; None = only the token budget limits it.
    chunk_size: int | None = None
    block_size: int = 16
    # KV cache size: blocks, or MiB; neither = enough for max_num_seqs full-length sequences
    # on CPU (capped at DEFAULT_CPU_KV_MB) or a share of free memory on CUDA.
    num_kv_blocks: int | None = None
    kv_cache_mb: int | None = None
    enable_prefix_cache: bool = True
    # None = the model's max_position_embeddings (capped by the KV cache's capacity).
    max_model_len: int | None = None
    max_n: int = 16
    # CUDA only: run every step eagerly instead of replaying decode steps from CUDA graphs.
    enforce_eager: bool = False
    # CUDA: before serving, capture the usual CUDA graphs and run a step's eager tail at every
    # row count (Engine.warm_up), so that no request waits for a capture, a compile or a check.
    warm_up: bool = True
    # batch_invariant on the CPU: check the kernels' invariance on the model's shapes first.
    self_check: bool = True
    # Schedule and launch step n + 1 before waiting for step n's results, so that on CUDA the
    # host's work hides behind the GPU's. None = on for CUDA, off on the CPU (where nothing
    # overlaps: each launch computes at once; the bookkeeping is the same either way).
    async_scheduling: bool | None = None
    # batch_invariant fp32 on the CPU: read a GGUF's quantised blocks in place ("quantised")
    # or its dequantised fp32 weights ("fp32"); the same bits either way.
    weights_format: str = "quantised"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two >= 16")
        if self.weights_format not in ("quantised", "fp32"):
            raise ValueError(f"weights_format must be quantised or fp32, got "
                             f"{self.weights_format!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "num_kv_blocks",
                     "kv_cache_mb", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def overlaps_steps(self) -> bool:
        """Whether steps are scheduled asynchronously (`async_scheduling` resolved)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.device.startswith("cuda")

    @property
    def prefill_chunk(self) -> int:
        return self.chunk_size or self.max_num_batched_tokens

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        """From `detgate worker` / `detgate bench engine` arguments (absent flags keep defaults;
        on CUDA, absent scheduler limits are the card's cuda_batch_limits)."""
        values = {name: getattr(args, name) for name in cls.__dataclass_fields__
                  if getattr(args, name, None) is not None}
        if values.get("device", "cpu").startswith("cuda"):
            values = {**card_batch_limits(values["device"]), **values}
        if getattr(args, "no_prefix_cache", False):
            values["enable_prefix_cache"] = False
        if getattr(args, "skip_self_check", False):
            values["self_check"] = False
        return cls(**values)


def cuda_batch_limits(total_memory: int, name: str) -> dict[str, int]:
    """max_num_seqs and max_num_batched_tokens for a CUDA card: vLLM's OpenAI-server defaults
    (its EngineArgs.get_batch_defaults), so that a worker batches as a vLLM server on the same
    card would: 1,024 sequences and 8,192 tokens a step on cards of 70 GiB or more (A100s
    excepted, as there), 256 and 2,048 on smaller ones (EngineConfig's 64 and 2,048 suit a
    CPU). The limits change no bit of a batch_invariant worker's output, only how many
    sequences share a step."""
    if total_memory >= 70 * 2**30 and "a100" not in name.lower():
        return {"max_num_seqs": 1024, "max_num_batched_tokens": 8192}
    return {"max_num_seqs": 256, "max_num_batched_tokens": 2048}


def card_batch_limits(device: str) -> dict[str, int]:
    """cuda_batch_limits of the card `device` names; none where CUDA is absent (the engine
    fails on such a config where it starts, as without this)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    card = torch.cuda.get_device_properties(torch.device(device))
    return cuda_batch_limits(card.total_memory, card.name)


DEFAULT_CPU_KV_MB = 1024
CUDA_KV_MEMORY_FRACTION = 0.85
