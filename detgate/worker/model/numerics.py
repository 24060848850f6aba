"""What a worker's numbers depend on (the parts hashed into its system_fingerprint) and the
machine it runs on (reported beside the fingerprint, in records and on /v1/models).

A record replays only on a worker of its fingerprint. So the fingerprint must name everything
that can change a bit (or a replay differs for a reason nobody can see), and nothing that
cannot (or a record made on one machine is refused by another that computes the same bits).
Part by part:

Always:
- the weights (their hash), the model's config and tokenizer files, the mode, the dtype, the
  device kind;
- the sources of the code that computes: the kernels (tile and split sizes and every reduction
  order live in their Python, Triton and C++ source) and the model (layers, rotary tables,
  tokenizer and chat template handling); the server adds the sampler's and the token masks'
  sources and the grammar library's version (server/context.py); the `tokenizers` library
  turns a text prompt into the ids the model sees;
- torch's version: torch still computes in every mode (pointwise arithmetic, fp32 -> bf16
  rounding, topk, sort, the top-p cumsum), and a sampled token's draw is torch's
  `exponential_`, whose implementation changed between releases (MKL's VSL stream, then
  torch's own generator stream and transform: pytorch issue 132395);
- the C library and the CPU's instruction-set class (`cpu_ext.isa_class`: "x86-64 avx2+fma",
  "x86-64 baseline", or the architecture): libm computes the rotary tables' pow, cos and sin
  (layers/rotary.py), the attention scale, the log of each log_softmax row in the CPU kernels
  and the -log(u) of torch's exponential draw; glibc picks FMA variants of those functions on
  x86-64 CPUs with FMA and AVX2, and has changed them across versions.

batch_invariant on an x86-64 CPU: nothing more. The CPU model, its core and thread count,
torch's CPU capability (AVX2, AVX-512) and the CPU kernels' build (AVX2 or portable) change no
bit, and stay out:
- every reduction runs in the CPU kernels, whose order is a function of the reduction length
  alone (the argument at the top of kernels/csrc/cpu_kernels.cpp): a thread computes whole
  output elements, never part of a sum, and both builds run the same IEEE operations;
- the sampler's softmax is the kernels' (torch's sums in lanes of its vector width: its AVX2
  and AVX-512 kernels gave other bits, measured), and the rotary tables come from libm, not
  from torch's vectorised pow, cos and sin (its default and AVX2 kernels gave another float64
  pow, measured);
- what torch still computes is exact in any loop and any thread split: one correctly rounded
  IEEE operation per element, rounding to bf16, gathers, comparisons, the serial generator
  stream, a sequential cumsum. tests/worker/test_numerics_machines.py checks whole answers
  (greedy and sampled, fp32 and bf16) across 1, 2 and all threads, both kernel builds and
  torch's default, AVX2 and AVX-512 kernels (ATEN_CPU_CAPABILITY), with default mode as the
  control that differs.

default mode on the CPU: MKL, oneDNN and torch's own reductions pick their code path by the
instruction set and split sums across threads (docs: README "Why the CPU path is invariant on
every CPU"), so the CPU model and feature flags, torch's CPU capability, the thread count and
torch's build (its MKL and oneDNN) are parts. So are they on CPUs other than x86-64, where the
claim above has not been measured.

CUDA: the GPU's name and compute capability, torch's CUDA version and Triton's version. Not
measured across GPUs (Triton compiles per architecture, cuBLAS picks kernels per GPU): GPUs
stay apart.

Engine settings (KV block size, chunking, batch limits) decide which rows run together, which
batch_invariant mode makes irrelevant by construction, and which in default mode the load
decides anyway: no fingerprint could name them.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
from pathlib import Path

import torch

from detgate.contract.provenance import cpu_model
from detgate.kernels import cpu_ext

# A model folder's files, besides config.json and the weights, that decide the token ids.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                   "chat_template.jinja")


def fingerprint_parts(weights_sha256: str, config_sha256: str, tokenizer_sha256: str, mode: str,
                      dtype: torch.dtype, device: torch.device) -> dict[str, str]:
    """Everything the model's numbers depend on (see the module docstring)."""
    parts = {
        "weights_sha256": weights_sha256,
        "config_sha256": config_sha256,
        "tokenizer_sha256": tokenizer_sha256,
        "mode": mode,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device.type,
        "sources_sha256": sources_sha256(),
        "torch": torch.__version__,
        "tokenizers": _version("tokenizers"),
        "libc": " ".join(platform.libc_ver()),
        "isa_class": cpu_ext.isa_class(),
    }
    if device.type == "cuda":
        parts |= {"gpu": torch.cuda.get_device_name(device),
                  "compute_capability": "{}.{}".format(*torch.cuda.get_device_capability(device)),
                  "cuda": str(torch.version.cuda), "triton": _version("triton")}
    elif not machine_free(mode, device):
        parts |= {"cpu": cpu_model(), "cpu_flags_sha256": cpu_ext.cpu_flags_sha256(),
                  "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                  "torch_threads": str(torch.get_num_threads()),
                  "torch_build_sha256": _sha256(torch.__config__.show().encode())}
    return parts


def machine_free(mode: str, device: torch.device) -> bool:
    """True where the CPU, its threads and torch's CPU kernels change no bit (see above)."""
    return mode == "batch_invariant" and device.type == "cpu" and \
        cpu_ext.isa_class().startswith("x86-64")


def machine(mode: str, device: torch.device) -> dict[str, str | int]:
    """The machine a worker runs on, for people and records: hashed only where
    `fingerprint_parts` says so."""
    out: dict[str, str | int] = {
        "cpu": cpu_model(), "arch": platform.machine(), "isa_class": cpu_ext.isa_class(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count() or 1,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__, "libc": " ".join(platform.libc_ver()),
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        out |= {"gpu": torch.cuda.get_device_name(device), "cuda": str(torch.version.cuda),
                "triton": _version("triton")}
    elif mode == "batch_invariant":
        out["cpu_kernels"] = _cpu_kernels_build()
    return out


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU model with torch's CPU capability (benchmark reports)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({torch.backends.cpu.get_cpu_capability()})"


def tokenizer_sha256(folder: Path) -> str:
    """A hash of the tokenizer's files in a model folder (those present, by name)."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (folder / name).exists():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return digest.hexdigest()


def sources_sha256() -> str:
    """The source of the kernels and of the model (Python, Triton and C++), file by file."""
    from detgate import kernels
    from detgate.worker import model

    digest = hashlib.sha256()
    for package in (kernels, model):
        root = Path(package.__file__).parent
        for src in sorted([*root.rglob("*.py"), *root.rglob("*.cpp")]):
            name = f"{package.__name__}/{src.relative_to(root).as_posix()}"
            digest.update(name.encode() + b"\0" + src.read_bytes())
    return digest.hexdigest()


def _cpu_kernels_build() -> str:
    try:
        return cpu_ext.load().isa()
    except cpu_ext.BuildError:
        return "not built"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
