"""Load a Hugging Face style folder (config.json, *.safetensors, tokenizer.json) into a model.

Tensors are copied one at a time from the safetensors files into preallocated parameters (where
each goes: worker/model/weights.py), so a checkpoint never sits in memory twice; the weights'
hash is taken on the way (`WeightsDigest`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from detgate.worker.model import numerics, quantised_weights
from detgate.worker.model.config import TORCH_DTYPES, ModelConfig
from detgate.worker.model.decoder import CausalLM, build_model
from detgate.worker.model.ops import make_ops
from detgate.worker.model.quantised_weights import QUANTISED_FILE, WEIGHTS_FORMATS
from detgate.worker.model.tokenizer import Tokenizer
from detgate.worker.model.weights import (
    CheckpointError,
    WeightsDigest,
    all_slots,
    expected_shape,
    is_skipped,
    slots_of,
)


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    # Everything that can change the numbers; the server hashes it into system_fingerprint
    # (worker/model/numerics.py says what and why).
    fingerprint_parts: dict[str, str]
    # The machine it runs on, reported beside the fingerprint.
    machine: dict[str, str | int]


def load(
    path: str | Path, *, dtype: str | torch.dtype, device: str | torch.device, mode: str,
    weights_format: str = "fp32",
) -> LoadedModel:
    """`weights_format` "quantised": a batch_invariant fp32 model on the CPU reads the GGUF
    blocks the folder keeps, where it has them (quantised_weights.py); the same bits, so the
    same fingerprint. Anywhere else, or with "fp32", the fp32 weights."""
    if weights_format not in WEIGHTS_FORMATS:
        raise ValueError(f"weights_format must be one of {WEIGHTS_FORMATS}, "
                         f"got {weights_format!r}")
    path = Path(path)
    dtype = TORCH_DTYPES[dtype] if isinstance(dtype, str) else dtype
    device = torch.device(device)
    config = ModelConfig.from_file(path / "config.json", dtype)
    tokenizer = Tokenizer.from_folder(path, extra_eos_ids=config.eos_token_ids)
    config = dataclasses.replace(config, eos_token_ids=tuple(tokenizer.eos_token_ids))
    ops = make_ops(mode)
    with torch.device(device):
        model = build_model(config, ops)
    weights_sha256 = load_weights(model, weight_files(path))
    attached = {}
    if weights_format == "quantised" and mode == "batch_invariant" and device.type == "cpu" \
            and dtype == torch.float32:
        attached = quantised_weights.attach(model, path)
    config_sha256 = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()
    parts = numerics.fingerprint_parts(weights_sha256, config_sha256,
                                       numerics.tokenizer_sha256(path), mode, dtype, device)
    machine = numerics.machine(mode, device) | {"weights": quantised_weights.describe(attached)}
    return LoadedModel(model, config, tokenizer, parts, machine)


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(f for f in path.glob("*.safetensors") if f.name != QUANTISED_FILE)
    if not files:
        raise CheckpointError(f"no *.safetensors in {path}")
    return files


def load_weights(model: CausalLM, files: list[Path]) -> str:
    """Fill every parameter of `model` from `files`; returns the weights' hash."""
    params = dict(model.named_parameters())
    digest = WeightsDigest()
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if is_skipped(model, name):
                    continue
                try:
                    slots = slots_of(model, params, name)
                except CheckpointError as exc:
                    raise CheckpointError(f"{file.name}: {exc}", tensor=name) from None
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != expected_shape(params, slots):
                    raise CheckpointError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                        f"model expects {expected_shape(params, slots)}", tensor=name)
                row = 0
                for slot in slots:
                    part = tensor.narrow(0, row, slot.size)
                    params[slot.param].data.narrow(0, slot.start, slot.size).copy_(part)
                    digest.add_tensor(slot, part)
                    loaded.add(slot.name)
                    row += slot.size
    missing = [name for name in all_slots(model) if name not in loaded]
    if missing:
        raise CheckpointError(f"tensors missing from the checkpoint: {missing[:5]}")
    return digest.hexdigest()
