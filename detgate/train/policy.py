"""Policy: a trainable model whose per-token logprobs are the batch_invariant sampler's, bit for
bit (train/ops.py says why), with its weights exported as the worker loads them.

Mixed precision, the one rule: the parameters (what the optimizer updates) are fp32 master
weights; every forward first rounds each to the serving dtype (`serving_parameters`, one
round-to-nearest-even per element, differentiable: gradients reach the fp32 masters) and runs
the whole model in that dtype, as the worker does; `serving_state_dict` / `save_pretrained`
export exactly those rounded tensors. So after any optimizer step the exported weights are the
numbers the trainer's next forward uses, and a worker that loads them (same dtype and device,
batch_invariant mode) samples with the trainer's logprobs. In float32 the rounding is the
identity. A worker loading fp32 checkpoint tensors into bf16 rounds them the same way, so a
policy made from a checkpoint starts on the served weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from detgate.contract.constants import DEFAULT_MODE, MODES
from detgate.train.batch import Packed, pack
from detgate.train.forward import chosen_logprobs
from detgate.train.ops import InvariantOps
from detgate.train.reference import TorchOps
from detgate.worker.model.config import TORCH_DTYPES
from detgate.worker.model.loader import LoadedModel, load
from detgate.worker.model.weights import checkpoint_names
from detgate.worker.tools.model_source import DEFAULT_MODEL, resolve_model

# Files of a checkpoint folder that are not copied beside new weights: the weights themselves
# and the record of the GGUF they were converted from.
_NOT_COPIED = ("*.safetensors", "*.safetensors.index.json", "source.json")


class Policy(nn.Module):
    """`Policy.from_pretrained(model, dtype=..., device=...)`; parameters are fp32 masters under
    the worker's names (q/k/v and gate/up packed, as `worker.model` holds them)."""

    def __init__(self, loaded: LoadedModel, folder: Path | None, *, dtype: str | torch.dtype,
                 mode: str = DEFAULT_MODE) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.dtype = TORCH_DTYPES[dtype] if isinstance(dtype, str) else dtype
        if mode == "batch_invariant" and self.dtype not in TORCH_DTYPES.values():
            raise ValueError(f"batch_invariant runs in {sorted(TORCH_DTYPES)}, not {self.dtype}")
        self.mode = mode
        self.model = loaded.model  # its ops: the worker's batch_invariant kernels
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.folder = folder
        for p in self.model.parameters():
            p.data = p.data.float()
            p.requires_grad_(True)
        self.ops = InvariantOps(self.model.ops) if mode == "batch_invariant" else TorchOps()

    @classmethod
    def from_pretrained(cls, model: str | Path = DEFAULT_MODEL, *, dtype: str = "float32",
                        device: str | torch.device = "cpu", mode: str = DEFAULT_MODE) -> Policy:
        """From what `detgate worker --model` takes: a Hugging Face folder, a .gguf file, a
        packaged model name or a make-model preset. The masters get the checkpoint's values."""
        folder = resolve_model(str(model))
        loaded = load(folder, dtype=torch.float32, device=device, mode="batch_invariant")
        return cls(loaded, folder, dtype=dtype, mode=mode)

    def with_mode(self, mode: str, dtype: str | torch.dtype | None = None) -> Policy:
        """A policy on this one's weights (shared, not copied), computed in `mode` (and
        `dtype`: e.g. float64 for a reference)."""
        loaded = LoadedModel(self.model, self.config, self.tokenizer, {}, {})
        return Policy(loaded, self.folder, dtype=dtype or self.dtype, mode=mode)

    @property
    def device(self) -> torch.device:
        return self.model.model.embed_tokens.weight.device

    # -- logprobs ------------------------------------------------------------------------

    def token_logprobs(self, input_ids: torch.Tensor, *,
                       attention_mask: torch.Tensor | None = None,
                       cu_seqlens: torch.Tensor | list[int] | None = None,
                       start: list[int] | None = None) -> torch.Tensor:
        """Per-token logprobs of a batch, in one differentiable pass.

        input_ids [B, T] right-padded with attention_mask [B, T], or packed [N] with cu_seqlens
        [B + 1]. Returns fp32 of input_ids' shape: entry t of a sequence is log p(token t |
        tokens 0..t-1); 0 at each sequence's position 0, before its `start` (optional, one per
        sequence: e.g. its prompt length, sparing the head those rows) and at padding."""
        batch = self.pack(input_ids, attention_mask=attention_mask, cu_seqlens=cu_seqlens)
        if start is not None and len(start) != len(batch.lens):
            raise ValueError(f"start has {len(start)} entries for {len(batch.lens)} sequences")
        targets = batch.targets(start)
        flat = torch.zeros(batch.input_ids.shape[0], device=self.device).index_put(
            (targets,), self.logprobs(batch, targets))
        if attention_mask is None:
            return flat
        out = torch.zeros(tuple(input_ids.shape), device=self.device)
        return out.index_put((batch.seq_of, batch.positions), flat)

    def completion_logprobs(self, prompts: list[list[int]],
                            completions: list[list[int]]) -> list[torch.Tensor]:
        """The logprob of every completion token given its prompt and the completion before it:
        one fp32 tensor per completion (what a sampler recorded for those tokens)."""
        if len(prompts) != len(completions) or not prompts:
            raise ValueError("give one completion per prompt, at least one")
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        ids = [t for p, c in zip(prompts, completions, strict=True) for t in (*p, *c)]
        lens = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        batch = self.pack(torch.tensor(ids), cu_seqlens=cu)
        values = self.logprobs(batch, batch.targets([len(p) for p in prompts]))
        return list(values.split([len(c) for c in completions]))

    def pack(self, input_ids: torch.Tensor, **layout) -> Packed:
        return pack(input_ids, **layout, device=self.device, vocab_size=self.config.vocab_size,
                    max_len=self.config.max_position_embeddings)

    def logprobs(self, batch: Packed, targets: torch.Tensor) -> torch.Tensor:
        """fp32 [R]: the logprob of each target token (train/forward.py), the model run on the
        serving-dtype weights."""
        return torch.func.functional_call(self, self.serving_parameters(), (batch, targets))

    def forward(self, batch: Packed, targets: torch.Tensor) -> torch.Tensor:
        return chosen_logprobs(self.model, self.ops, batch, targets)

    # -- weights -------------------------------------------------------------------------

    def serving_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter rounded to the serving dtype (differentiably): the forward's weights."""
        return {name: p.to(self.dtype) for name, p in self.named_parameters()}

    @torch.no_grad()
    def serving_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights as a worker loads them: the checkpoint's tensor names (q/k/v and gate/up
        unpacked; lm_head only when it is not tied), the serving dtype, on this device."""
        out = {}
        for name, param in self.model.named_parameters():
            served = param.to(self.dtype)
            names = checkpoint_names(name)
            if len(names) == 1:
                out[name] = served
                continue
            linear = self.model.get_submodule(name.rsplit(".", 1)[0])
            for shard, checkpoint_name in enumerate(names):
                out[checkpoint_name] = served.narrow(0, *linear.shard_offset(shard))
        return out

    def save_pretrained(self, folder: str | Path) -> Path:
        """A checkpoint folder `detgate worker --model FOLDER --dtype <this dtype>` serves:
        model.safetensors with `serving_state_dict()`, and the source folder's config,
        tokenizer and generation files. Write each version to a new folder."""
        if self.folder is None:
            raise ValueError("this policy has no source folder to take config.json and the "
                             "tokenizer from")
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for src in self.folder.iterdir():
            if src.is_file() and not any(src.match(p) for p in _NOT_COPIED):
                shutil.copy2(src, folder / src.name)
        tensors = {k: v.detach().cpu().clone() for k, v in self.serving_state_dict().items()}
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
