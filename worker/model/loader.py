"""Load a Hugging Face style folder (config.json, *.safetensors, tokenizer.json) into a model.

Checkpoint tensors keep their Hugging Face names except q/k/v and gate/up, which this decoder
packs into one matrix each (`_PACKED`). Tensors are copied one at a time from the safetensors
files into preallocated parameters, so a checkpoint never sits in memory twice.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from detgate.provenance import cpu_model
from worker.model.config import TORCH_DTYPES, ModelConfig
from worker.model.decoder import CausalLM, build_model
from worker.model.layers.linear import Linear
from worker.model.ops import make_ops
from worker.model.tokenizer import Tokenizer

# checkpoint module name -> (packed module name, shard index)
_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class CheckpointError(ValueError):
    """The folder's tensors do not match its config."""


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    # Everything that can change the numbers; the server hashes it into system_fingerprint.
    fingerprint_parts: dict[str, str]


def load(
    path: str | Path, *, dtype: str | torch.dtype, device: str | torch.device, mode: str
) -> LoadedModel:
    path = Path(path)
    dtype = TORCH_DTYPES[dtype] if isinstance(dtype, str) else dtype
    device = torch.device(device)
    config = ModelConfig.from_file(path / "config.json", dtype)
    tokenizer = Tokenizer.from_folder(path, extra_eos_ids=config.eos_token_ids)
    config = dataclasses.replace(config, eos_token_ids=tuple(tokenizer.eos_token_ids))
    ops = make_ops(mode)
    with torch.device(device):
        model = build_model(config, ops)
    files = weight_files(path)
    load_weights(model, files)
    config_sha256 = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()
    parts = fingerprint_parts(_files_sha256(files), config_sha256, mode, dtype, device)
    return LoadedModel(model, config, tokenizer, parts)


def fingerprint_parts(
    weights_sha256: str, config_sha256: str, mode: str, dtype: torch.dtype, device: torch.device
) -> dict[str, str]:
    """Everything besides the weights and config that can change the numbers."""
    return {
        "weights_sha256": weights_sha256,
        "config_sha256": config_sha256,
        "mode": mode,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "kernels_sha256": _kernels_sha256(),
        # Default mode's MKL calls and the sampler's torch ops may split work by thread count.
        "torch_threads": str(torch.get_num_threads()),
        **(_cpu_parts() if device.type == "cpu" else {}),
    }


def _cpu_parts() -> dict[str, str]:
    """What the CPU kernels' bits could depend on beyond their source: the build in use (its
    instruction set; by their argument it changes no bit, but a claim is only as good as its
    check) and the C library, whose logf runs once per log_softmax row."""
    import platform

    from kernels.cpu_ext import BuildError, load

    try:
        build = load().isa()
    except BuildError:
        build = "not built"
    return {"cpu_kernels": build, "libc": " ".join(platform.libc_ver())}


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors in {path}")
    return files


def load_weights(model: CausalLM, files: list[Path]) -> None:
    params = dict(model.named_parameters())
    loaded: set[tuple[str, int]] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed from config.json
                if name == "lm_head.weight" and model.lm_head is None:
                    continue  # tied: the embedding is the head
                target, shard = packed_name(name)
                if target not in params:
                    raise CheckpointError(f"{file.name}: tensor {name} has no place in the model")
                dest = params[target].data
                if shard is not None:
                    linear = model.get_submodule(target.rsplit(".", 1)[0])
                    assert isinstance(linear, Linear)
                    start, size = linear.shard_offset(shard)
                    dest = dest.narrow(0, start, size)
                tensor = f.get_tensor(name)
                if tensor.shape != dest.shape:
                    raise CheckpointError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                        f"model expects {tuple(dest.shape)}"
                    )
                dest.copy_(tensor)
                loaded.add((target, 0 if shard is None else shard))
    missing = [name for name, expected in _expected_shards(model) if not expected <= loaded]
    if missing:
        raise CheckpointError(f"tensors missing from the checkpoint: {missing[:5]}")


def packed_name(name: str) -> tuple[str, int | None]:
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _PACKED:
        packed, shard = _PACKED[parts[-2]]
        return ".".join([*parts[:-2], packed, parts[-1]]), shard
    return name, None


def _expected_shards(model: CausalLM):
    for module_name, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            shards = range(len(module.shard_sizes)) if isinstance(module, Linear) else range(1)
            yield full, {(full, s) for s in shards}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    # CPU results depend on the instruction set the kernels dispatch to, not only on the model.
    return f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"


def _files_sha256(files: list[Path]) -> str:
    total = hashlib.sha256()
    for file in files:
        with open(file, "rb") as f:
            total.update(f"{file.name}:{hashlib.file_digest(f, 'sha256').hexdigest()}\n".encode())
    return total.hexdigest()


def _kernels_sha256() -> str:
    """Kernel tile sizes, split sizes and reduction orders live in the kernels' source (Python,
    Triton and C++): hash all of it."""
    import kernels

    root = Path(kernels.__file__).parent
    digest = hashlib.sha256()
    for src in sorted([*root.rglob("*.py"), *root.rglob("*.cpp")]):
        digest.update(src.relative_to(root).as_posix().encode() + b"\0" + src.read_bytes())
    return digest.hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
