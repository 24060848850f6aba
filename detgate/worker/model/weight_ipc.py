"""A trainer's CUDA tensors handed to a worker on the same host without a copy: CUDA IPC.

The handoff file (worker/tools/push_weights.py) costs the trainer one write of every weight:
for the Qwen3-8B shape, 16 GB into /dev/shm took 20-27 s on an H200 host, against a 2 s goal
for a whole update. With CUDA IPC the trainer sends, for each tensor, the handle of the device
allocation that holds it (what `torch.multiprocessing` sends between processes), and the worker
maps that memory and copies the bytes out itself: device to its pinned staging copy, hashed on
the way, then into the live parameters as any other update (model/weight_update.py). Nothing
is written twice and the trainer does no work but keep its tensors alive until the answer.

The request stays plain JSON, never a pickle: `share` writes each tensor's handle and geometry
as JSON values, and `open_shared` validates them and rebuilds the tensor through torch's own
`rebuild_cuda_tensor` with classes chosen here, so nothing the caller sends names code to run.
A rebuilt tensor is read once, then dropped, which releases the trainer's reference count.

Only where both processes see the same GPU: another host, or a worker on the CPU, answers a
400 `ipc_unavailable` (push_weights then falls back to the file).
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

# Dtypes a tensor may be shared in (the ones a model is served or trained in).
DTYPES = {str(d).removeprefix("torch."): d
          for d in (torch.float32, torch.bfloat16, torch.float16)}


class SharedTensorError(ValueError):
    """A shared tensor that cannot be read: `code` says why, `tensor` names it."""

    def __init__(self, message: str, *, code: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.tensor = tensor


@dataclass(frozen=True)
class Shared:
    """One opened tensor: its bytes as a flat uint8 view of the trainer's memory."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    data: torch.Tensor  # [nbytes] uint8, on the trainer's device


def share(tensors: Mapping[str, torch.Tensor]) -> list[dict]:
    """The JSON description of contiguous CUDA `tensors` (name -> tensor) that a worker on this
    host can open; the caller keeps the tensors alive until the worker has answered."""
    specs = []
    for name, t in tensors.items():
        if not t.is_cuda or not t.is_contiguous():
            raise ValueError(f"{name}: only contiguous CUDA tensors can be shared")
        (_cls, size, stride, offset, _storage_cls, dtype, device, handle, storage_bytes,
         storage_offset_bytes, _grad, counter, counter_offset, event,
         event_sync) = reduce_tensor(t.detach())[1]
        specs.append({
            "name": name, "dtype": str(dtype).removeprefix("torch."), "shape": list(size),
            "stride": list(stride), "offset": offset, "device": device,
            "handle": _b64(handle), "storage_bytes": storage_bytes,
            "storage_offset_bytes": storage_offset_bytes,
            "ref_counter_handle": _b64(counter), "ref_counter_offset": counter_offset,
            "event_handle": _b64(event) if event else None,
            "event_sync_required": bool(event_sync)})
    return specs


def open_shared(specs: list[dict], device: torch.device) -> list[Shared]:
    """Map every described tensor into this process (a worker whose model is on `device`);
    SharedTensorError for the first that is malformed or cannot be mapped."""
    if device.type != "cuda":
        raise SharedTensorError("tensors are shared over CUDA IPC, and this worker runs on "
                                f"the {device.type}: send a handoff file instead",
                                code="ipc_unavailable")
    return [_open(spec) for spec in specs]


def _open(spec: dict) -> Shared:
    name = spec["name"]
    dtype = DTYPES.get(spec["dtype"])
    if dtype is None:
        raise SharedTensorError(f"{name}: dtype {spec['dtype']!r} cannot be shared (one of "
                                f"{', '.join(DTYPES)})", code="dtype_mismatch", tensor=name)
    shape, stride = tuple(spec["shape"]), tuple(spec["stride"])
    if any(d < 0 for d in shape) or stride != _contiguous(shape):
        raise SharedTensorError(f"{name}: shape {list(shape)} with stride {list(stride)} is not "
                                "a contiguous tensor", code="bad_tensor", tensor=name)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if spec["offset"] < 0 or (spec["offset"] * itemsize + nbytes > spec["storage_bytes"]):
        raise SharedTensorError(f"{name}: {nbytes} bytes at element {spec['offset']} do not fit "
                                f"its allocation of {spec['storage_bytes']} bytes",
                                code="truncated_tensor", tensor=name)
    try:
        t = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(shape), stride, spec["offset"], torch.TypedStorage, dtype,
            spec["device"], _bytes(spec["handle"], name), spec["storage_bytes"],
            spec["storage_offset_bytes"], False, _bytes(spec["ref_counter_handle"], name),
            spec["ref_counter_offset"],
            _bytes(spec["event_handle"], name) if spec["event_handle"] else None,
            spec["event_sync_required"])
    except (RuntimeError, OSError, TypeError) as exc:  # not this host's or GPU's memory
        raise SharedTensorError(f"{name}: its CUDA memory cannot be opened here ({exc}); "
                                "tensors are shared only with a worker on the trainer's host "
                                "and GPU", code="ipc_unavailable", tensor=name) from None
    return Shared(name, dtype, shape, t.reshape(-1).view(torch.uint8))


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _bytes(text: str, name: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise SharedTensorError(f"{name}: a handle is not base64", code="bad_tensor",
                                tensor=name) from None
