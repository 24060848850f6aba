"""A preset's model with random weights drawn straight into device memory, from a seed.

The GPU experiment runs the qwen3-8b-shape preset without writing or reading its 16 GB
checkpoint: config.json and the tokenizer are written exactly as `detgate make-model` writes
them (into a folder of their own), and every weight is drawn on the model's device. The tensors,
their names and their scales are make-model's (`checkpoint_tensors`); each is drawn from a
generator of the device's type seeded by (seed, tensor name), so the weights depend only on the
preset, the seed and the device type, never on drawing order. They are not the bits of the
safetensors make-model writes (those are drawn on the CPU): the fingerprint says
"random:<preset>:<seed>".
Real checkpoints keep going through `worker.model.loader.load`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from detgate.worker.model import numerics
from detgate.worker.model.config import TORCH_DTYPES, ModelConfig
from detgate.worker.model.decoder import CausalLM, build_model
from detgate.worker.model.layers.linear import Linear
from detgate.worker.model.loader import LoadedModel
from detgate.worker.model.ops import make_ops
from detgate.worker.model.tokenizer import Tokenizer
from detgate.worker.model.weights import packed_name
from detgate.worker.tools.make_model import (
    PRESETS,
    Preset,
    checkpoint_tensors,
    hf_config,
    write_tokenizer,
)


def load_random(preset: str | Preset, folder: Path, *, seed: int, device: str | torch.device,
                mode: str, dtype: str | None = None) -> LoadedModel:
    """Write the preset's config and tokenizer into `folder` (reused if there), then build the
    model on `device` with random weights from `seed`. dtype: the preset's unless given.
    `preset`: a name of make-model's, or a Preset of one's own (e.g. fewer layers)."""
    preset = PRESETS[preset] if isinstance(preset, str) else preset
    folder = Path(folder)
    device = torch.device(device)
    dtype = TORCH_DTYPES[dtype or preset.dtype]
    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        vocab_size, eos_ids = write_tokenizer(folder, preset)
        raw_config = hf_config(preset, vocab_size, eos_ids[0])
        (folder / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    config_bytes = (folder / "config.json").read_bytes()
    config = ModelConfig.from_dict(json.loads(config_bytes), dtype)
    tokenizer = Tokenizer.from_folder(folder, extra_eos_ids=config.eos_token_ids)
    config = dataclasses.replace(config, eos_token_ids=tuple(tokenizer.eos_token_ids))
    with torch.device(device):
        model = build_model(config, make_ops(mode))
    fill_random(model, preset, config.vocab_size, seed)
    parts = numerics.fingerprint_parts(f"random:{preset.name}:{seed}:{device.type}",
                                       hashlib.sha256(config_bytes).hexdigest(),
                                       numerics.tokenizer_sha256(folder), mode, dtype, device)
    return LoadedModel(model, config, tokenizer, parts, numerics.machine(mode, device))


@torch.inference_mode()
def fill_random(model: CausalLM, preset, vocab_size: int, seed: int) -> None:
    """Draw every checkpoint tensor of `preset` into its (possibly packed) parameter."""
    params = dict(model.named_parameters())
    for t in checkpoint_tensors(preset, vocab_size):
        target, shard = packed_name(t.name)
        dest = params[target].data
        if shard is not None:
            linear = model.get_submodule(target.rsplit(".", 1)[0])
            assert isinstance(linear, Linear)
            dest = dest.narrow(0, *linear.shard_offset(shard))
        digest = hashlib.sha256(f"{seed}:{t.name}".encode()).digest()
        gen = torch.Generator(device=dest.device)
        gen.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        values = torch.randn(t.shape, generator=gen, dtype=torch.float32, device=dest.device)
        dest.copy_(1.0 + 0.1 * values if t.std == 0.0 else values * t.std)
