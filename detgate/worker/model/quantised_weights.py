"""GGUF blocks served as they come: the CPU batch_invariant matmul reads them in place.

A GGUF's Q8_0 / Q4_0 / Q4_1 tensors are kept, untouched, beside the dequantised checkpoint
(QUANTISED_FILE, written by gguf_checkpoint). `attach` gives every Linear whose checkpoint
tensors all came in one such type a `QuantisedWeight` (q/k/v and gate/up: their rows of
blocks stacked as the packed weight stacks theirs), and the tied LM head too. The fp32
parameters stay: the embedding reads its rows, weight updates write into them, and they are
what the weights' hash covers.

Why a record does not change with the format: `kernels.cpu.matmul_quantised` gives the bits of
`kernels.cpu.matmul` on the dequantised weight (the argument is in the C++ source), and
`attach` checks, before the worker serves, that each weight's blocks dequantise to exactly the
fp32 parameter loaded and hashed into the fingerprint; a mismatch stops the load. So the
fingerprint stays the fp32 path's, and a record made on either path replays on the other.
"""

from __future__ import annotations

import collections
from pathlib import Path

import torch
from safetensors import safe_open

from detgate.kernels import cpu as cpu_kernels
from detgate.kernels.bits import same_bits
from detgate.kernels.quantised import QuantisedWeight
from detgate.worker.model.decoder import CausalLM
from detgate.worker.model.layers.linear import Linear
from detgate.worker.model.weights import CheckpointError, slots_of

QUANTISED_FILE = "quantised.safetensors"
# --weights-format: GGUF blocks read in place where the model has them, or fp32 weights.
WEIGHTS_FORMATS = ("quantised", "fp32")
_HEAD = "model.embed_tokens.weight"  # the tied LM head's checkpoint name


def attach(model: CausalLM, folder: Path) -> dict[str, str]:
    """Give the model's weights their GGUF blocks, where `folder` has them; returns parameter
    name -> ggml type for each weight now read as blocks (empty: none, fp32 throughout)."""
    path = folder / QUANTISED_FILE
    if not path.exists():
        return {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        types = f.metadata() or {}
        blocks = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a mapping
    params = dict(model.named_parameters())
    attached: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        param = f"{name}.weight"
        names = [slot.name for slot in slots_of(model, params, param)]
        weight = _quantised(names, blocks, types, params[param])
        if weight is not None:
            module.quantised = weight
            attached[param] = weight.qtype
    if model.lm_head is None:
        head = _quantised([_HEAD], blocks, types, params[_HEAD])
        if head is not None:
            model.quantised_head = head
            attached[_HEAD] = head.qtype
    return attached


def detach(model: CausalLM) -> None:
    """Back to the fp32 weights (after a weight update the blocks no longer stand for them)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.quantised = None
    model.quantised_head = None


def describe(attached: dict[str, str]) -> str:
    """'quantised: 210 Q4_1, 1 Q8_0' or 'fp32', for the worker's machine description."""
    if not attached:
        return "fp32"
    counts = collections.Counter(attached.values())
    return "quantised: " + ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))


def _quantised(names: list[str], blocks: dict[str, torch.Tensor], types: dict[str, str],
               param: torch.Tensor) -> QuantisedWeight | None:
    """The blocks of checkpoint tensors `names` stacked as `param` [N, K], checked against it;
    None when one of them was not quantised or their types differ (then fp32 it is)."""
    if not all(n in blocks for n in names) or len({types.get(n) for n in names}) != 1:
        return None
    stacked = blocks[names[0]] if len(names) == 1 else torch.cat([blocks[n] for n in names])
    weight = QuantisedWeight(stacked.contiguous(), types[names[0]], param.shape[1])
    if weight.shape != tuple(param.shape) or not same_bits(cpu_kernels.dequantise(weight),
                                                           param.data):
        raise CheckpointError(f"{QUANTISED_FILE}: the blocks of {', '.join(names)} do not "
                              "dequantise to the loaded weights; prepare the model again",
                              tensor=names[0])
    return weight
