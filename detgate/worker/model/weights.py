"""Where each checkpoint tensor goes in the model, and the hash that names a model's weights.

Checkpoint tensors keep their Hugging Face names except q/k/v and gate/up, which the decoder
packs into one matrix each (`_PACKED`). A *slot* is what one Hugging Face tensor fills: a whole
parameter, or one shard (a block of rows) of a packed one. A tensor under the packed name
itself (`...qkv_proj.weight`, as the model names it) fills every shard of that parameter.

The weights' hash (`WeightsDigest`) is taken over slots, not files: a hash of each slot's bytes
as the checkpoint stored them, with their dtype and shape, in slot order. So the same
tensors give the same hash however they are sharded into files, named (Hugging Face or packed),
or delivered (a folder at start-up, a live update from a folder or a handoff file), and the
dtype the worker serves them in is a fingerprint part of its own. Each slot's bytes are hashed
with BLAKE3 (4-5x SHA-256's speed on one core, measured: 4.6 vs 1.0 GB/s; a weight update
hashes every byte it stages, 16 GB for Qwen3-8B); the lines are joined under SHA-256.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from blake3 import blake3

from detgate.worker.model.decoder import CausalLM
from detgate.worker.model.layers.linear import Linear

# checkpoint module name -> (packed module name, shard index)
_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_UNPACKED = {packed: name for name, packed in _PACKED.items()}


class CheckpointError(ValueError):
    """The checkpoint's tensors do not match the model. `tensor`: the one at fault, if any."""

    def __init__(self, message: str, *, tensor: str | None = None) -> None:
        super().__init__(message)
        self.tensor = tensor


@dataclass(frozen=True)
class Slot:
    """Rows [start, start + size) of parameter `param` (dim 0): what the Hugging Face tensor
    `name` fills."""

    name: str
    param: str
    start: int
    size: int


def packed_name(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _PACKED:
        packed, shard = _PACKED[parts[-2]]
        return ".".join([*parts[:-2], packed, parts[-1]]), shard
    return name, None


def checkpoint_names(param: str) -> list[str]:
    """The checkpoint tensors packed into parameter `param`, in shard order (`[param]` when it
    packs nothing): `packed_name`'s inverse, for writing a model back as a checkpoint."""
    parts = param.split(".")
    shards = [(shard, name) for name, (packed, shard) in _PACKED.items()
              if len(parts) >= 2 and parts[-2] == packed]
    return [".".join([*parts[:-2], name, parts[-1]]) for _, name in sorted(shards)] or [param]


def is_skipped(model: CausalLM, name: str) -> bool:
    """Tensors a checkpoint may carry that the model does not load."""
    if name.endswith("rotary_emb.inv_freq"):
        return True  # recomputed from config.json
    return name == "lm_head.weight" and model.lm_head is None  # tied: the embedding is the head


def slots_of(model: CausalLM, params: dict[str, torch.nn.Parameter], name: str) -> list[Slot]:
    """The slots checkpoint tensor `name` fills (raises CheckpointError if it has no place)."""
    target, shard = packed_name(name)
    if target not in params:
        raise CheckpointError(f"tensor {name} has no place in the model", tensor=name)
    linear = model.get_submodule(target.rsplit(".", 1)[0]) if "." in target else None
    sizes = linear.shard_sizes if isinstance(linear, Linear) else [params[target].shape[0]]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    shards = range(len(sizes)) if shard is None else [shard]
    return [Slot(_hf_name(target, s, len(sizes)), target, starts[s], sizes[s]) for s in shards]


def _hf_name(param: str, shard: int, num_shards: int) -> str:
    if num_shards == 1:
        return param
    module, _, leaf = param.rpartition(".")
    parent, _, packed = module.rpartition(".")
    return f"{parent}.{_UNPACKED[(packed, shard)]}.{leaf}"


def expected_shape(params: dict[str, torch.nn.Parameter], slots: list[Slot]) -> tuple[int, ...]:
    """The shape of the tensor that fills `slots` (consecutive shards of one parameter)."""
    return (sum(s.size for s in slots), *params[slots[0].param].shape[1:])


def all_slots(model: CausalLM) -> dict[str, Slot]:
    """Every slot of the model by name: what a complete checkpoint fills."""
    params = dict(model.named_parameters())
    return {slot.name: slot for name in params for slot in slots_of(model, params, name)}


def slot_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class WeightsDigest:
    """The weights' hash: SHA-256 over (slot name, dtype, shape, BLAKE3 of the stored bytes)
    lines in name order. `add` may be called from several threads for different slots."""

    def __init__(self) -> None:
        self._lines: dict[str, str] = {}

    @staticmethod
    def hasher():
        """The hash of one slot's bytes (`update` it chunk by chunk, then `add` its hexdigest)."""
        return blake3()

    def add(self, slot: Slot, dtype: torch.dtype, shape: tuple[int, ...], digest: str) -> None:
        dims = "x".join(map(str, shape))
        self._lines[slot.name] = f"{slot.name} {str(dtype).removeprefix('torch.')} {dims} {digest}"

    def add_tensor(self, slot: Slot, tensor: torch.Tensor) -> None:
        """`tensor`: the slot's stored tensor, contiguous on the CPU."""
        digest = self.hasher()
        digest.update(slot_bytes(tensor))
        self.add(slot, tensor.dtype, tuple(tensor.shape), digest.hexdigest())

    def hexdigest(self) -> str:
        text = "".join(self._lines[key] + "\n" for key in sorted(self._lines))
        return hashlib.sha256(text.encode()).hexdigest()
