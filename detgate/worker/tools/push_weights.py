"""Push a trainer's tensors to running built-in workers on this host: the tensor side of the
workers' POST /update_weights_from_disk (the HTTP side, torch-free, is
detgate/contract/weight_updates.py).

    from detgate.worker.tools.push_weights import update_weights
    answers = update_weights(worker_urls, admin_token, tensors=policy.state_dict())

Two ways, chosen by where the tensors are (`via="auto"`):
- CUDA tensors go as IPC handles (POST /update_weights_from_tensor, model/weight_ipc.py): each
  worker on this host and GPU copies the bytes out of the trainer's memory itself, nothing is
  written. For the Qwen3-8B shape (16 GB) the file below took 20-27 s to write on an H200
  host; the handles take milliseconds. A worker that cannot open them (on the CPU, on another
  GPU) answers `ipc_unavailable`, and the file is used instead.
- Otherwise a file: the tensors are written once as one safetensors file in shared memory
  (/dev/shm when it has room, else the temp dir; DETGATE_HANDOFF_DIR to choose), every worker
  reads it, and it is removed once all have answered.
Either way the worker checks the names, shapes and dtypes as it checks a checkpoint folder,
before anything live is touched, and the request is plain JSON (nothing pickled, nothing that
runs code when decoded).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from detgate.contract.weight_updates import (
    WeightPushError,
    handoff_dir,
    update_workers,
    update_workers_from_tensors,
)
from detgate.worker.model.weight_ipc import share


def update_weights(urls: list[str], token: str, tensors: Mapping[str, torch.Tensor], *,
                   dtype: torch.dtype | None = None, abort_all_requests: bool = False,
                   timeout_s: float = 600.0, via: str = "auto") -> list[dict]:
    """Load `tensors` into every worker at `urls` (on this host), each with the admin `token`;
    returns their answers in order (contract.weight_updates.update_workers).

    `tensors`: name -> tensor, under the checkpoint's (Hugging Face) names or the worker's
    packed ones; a complete set (a state_dict). Aliases of one storage (tied embeddings) are
    sent once. `dtype`: cast floating tensors to it first (the worker accepts only the dtype
    it serves, or exact widenings into it). `via`: "ipc", "file", or "auto" (IPC when every
    tensor is on CUDA, the file when a worker cannot open the handles)."""
    unique = _unaliased(tensors, dtype)
    if via == "ipc" or (via == "auto" and all(t.is_cuda for t in unique.values())):
        try:
            return update_workers_from_tensors(urls, token, share(unique),
                                               abort_all_requests=abort_all_requests,
                                               timeout_s=timeout_s)
        except WeightPushError as exc:
            code = ((exc.answer or {}).get("error") or {}).get("code")
            if via == "ipc" or code != "ipc_unavailable":
                raise
    handoff = write_handoff(unique)
    try:
        return update_workers(urls, token, handoff, abort_all_requests=abort_all_requests,
                              timeout_s=timeout_s)
    finally:
        handoff.unlink(missing_ok=True)


def write_handoff(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> Path:
    """The tensors as one safetensors file in the handoff folder (the caller removes it)."""
    unique = _unaliased(tensors, dtype)
    nbytes = sum(math.prod(t.shape) * t.element_size() for t in unique.values())
    fd, name = tempfile.mkstemp(prefix="detgate-weights-", suffix=".safetensors",
                                dir=handoff_dir(nbytes))
    os.close(fd)
    try:
        save_file(unique, name, metadata={"format": "pt"})
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return Path(name)


def _unaliased(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype | None
               ) -> dict[str, torch.Tensor]:
    """Contiguous tensors, one per storage view: a tied alias (lm_head.weight of a model whose
    head is its embedding) is dropped, the worker takes the embedding."""
    seen: set[tuple] = set()
    out: dict[str, torch.Tensor] = {}
    for name in sorted(tensors, key=lambda n: n == "lm_head.weight"):  # aliases: keep others
        t = tensors[name].detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()))
        if key in seen:
            continue
        seen.add(key)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out[name] = t.contiguous()
    return out
