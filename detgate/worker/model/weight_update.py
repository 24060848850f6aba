"""New weights for a serving model: read, checked and hashed before anything live is touched.

`WeightStager.stage(path)` takes a checkpoint folder (as the loader reads it) or one
.safetensors file (the handoff file a trainer writes, e.g. under /dev/shm), and
`WeightStager.stage_shared(tensors)` a trainer's CUDA tensors opened over IPC
(model/weight_ipc.py); either refuses them
(`WeightsRejected`, naming the tensor at fault) or returns `StagedWeights`: every slot's bytes
in a host copy of the parameters (pinned for CUDA) and the weights' hash. Only then may
`StagedWeights.commit()` copy them into the live parameters, which the engine does between
steps (engine.Engine.update_weights). The copy goes into the parameters' existing storage, so
CUDA graphs and the kernels' per-weight launch state (both keyed by address) see the new values.

What is refused, all before a byte is staged: a path that is no folder or .safetensors file; a
file whose header is not safetensors; a tensor with no place in the model, the wrong shape, a
dtype other than the served one (or, for float32 serving, bfloat16 and float16, which widen
exactly: a lossy cast is the trainer's business, so that it knows what is served); a slot
filled twice or not at all; a file shorter than its header says (named by the first tensor cut
off); a config.json describing another model. The files are read with pread, not mmap: a file
truncated while it is read gives a short read, and a refusal, not a SIGBUS.

The staging copy is kept between updates (one copy of the weights in host memory, allocated at
the first update): pinning gigabytes costs seconds, and an RL loop updates after every step.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from detgate.worker.model import quantised_weights
from detgate.worker.model.config import ModelConfig, ModelConfigError
from detgate.worker.model.decoder import CausalLM
from detgate.worker.model.loader import weight_files
from detgate.worker.model.weight_ipc import Shared
from detgate.worker.model.weights import (
    CheckpointError,
    Slot,
    WeightsDigest,
    all_slots,
    expected_shape,
    is_skipped,
    slot_bytes,
    slots_of,
)

# safetensors dtype codes this reader knows; a tensor in any other is refused by name.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
# Dtypes a served dtype accepts besides itself: those that widen into it exactly.
_WIDENS = {torch.float32: (torch.bfloat16, torch.float16)}
_MAX_HEADER = 100 << 20  # the safetensors format's own limit
_CHUNK = 8 << 20  # read, then hash while it is still in cache


class WeightsRejected(CheckpointError):
    """A bad update: nothing was changed. `code` says what is wrong, `tensor` where."""

    def __init__(self, message: str, *, code: str, tensor: str | None = None) -> None:
        super().__init__(message, tensor=tensor)
        self.code = code


@dataclass(frozen=True)
class _Entry:
    """One tensor of an update: from a safetensors file's header (its absolute byte range in
    the file), or a trainer's shared tensor (its byte range in `data`, all of it)."""

    file: Path | None
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int
    data: torch.Tensor | None = None  # [end] uint8, for a shared tensor

    @property
    def source(self) -> str:
        return self.file.name if self.file else "the shared tensors"


@dataclass(frozen=True)
class _Read:
    """Rows of an entry that fill one slot."""

    entry: _Entry
    slot: Slot
    begin: int
    nbytes: int


@dataclass
class StagedWeights:
    """Checked, hashed weights in host memory, ready to be copied into the model."""

    model: CausalLM
    buffers: dict[str, torch.Tensor]  # parameter name -> staged values, same shape and dtype
    weights_sha256: str

    def commit(self) -> None:
        """Copy the staged values into the live parameters, in place (call between steps)."""
        params = dict(self.model.named_parameters())
        quantised_weights.detach(self.model)  # the GGUF blocks stand for the old weights
        with torch.inference_mode():
            for name, staged in self.buffers.items():
                params[name].data.copy_(staged, non_blocking=True)
        device = next(iter(params.values())).device
        if device.type == "cuda":
            torch.cuda.synchronize(device)


class WeightStager:
    """Stages updates for one model; owns the staging buffers it keeps between updates."""

    def __init__(self, model: CausalLM, config: ModelConfig) -> None:
        self.model = model
        self.config = config
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, path: Path) -> StagedWeights:
        """Check `path` completely, then read it into the staging buffers and hash it."""
        try:
            return self._stage(path)
        except OSError as exc:  # unreadable: permissions, a file gone meanwhile
            raise WeightsRejected(f"{exc.filename or path}: {exc.strerror or exc}",
                                  code="weights_unreadable") from None

    def stage_shared(self, tensors: list[Shared]) -> StagedWeights:
        """The same for a trainer's tensors opened over CUDA IPC: checked as a file's header
        is, then copied into the staging buffers and hashed over the same bytes (so the
        fingerprint does not depend on how the weights came)."""
        entries = [_Entry(None, t.name, t.dtype, t.shape, 0, t.data.numel(), t.data)
                   for t in tensors]
        return self._read_all(self._plan(entries), {})

    def _stage(self, path: Path) -> StagedWeights:
        reads = self._plan(_entries(self._files(path)))
        fds = {f: os.open(f, os.O_RDONLY) for f in {r.entry.file for r in reads}}
        try:
            return self._read_all(reads, fds)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _read_all(self, reads: list[_Read], fds: dict[Path, int]) -> StagedWeights:
        buffers = self._staging_buffers()
        digest = WeightsDigest()
        workers = min(32, os.cpu_count() or 1)
        with ThreadPoolExecutor(workers) as pool:
            # Largest first, so that no big tensor starts last.
            order = sorted(reads, key=lambda r: -r.nbytes)
            list(pool.map(lambda r: self._read(fds.get(r.entry.file), r, buffers, digest),
                          order))
        return StagedWeights(self.model, buffers, digest.hexdigest())

    # -- checks ------------------------------------------------------------------------------

    def _files(self, path: Path) -> list[Path]:
        if path.is_file() and path.suffix == ".safetensors":
            return [path]
        if not path.is_dir():
            raise WeightsRejected(f"{path} is neither a folder nor a .safetensors file",
                                  code="weights_not_found")
        if (path / "config.json").exists():
            self._check_config(path / "config.json")
        try:
            return weight_files(path)
        except CheckpointError as exc:
            raise WeightsRejected(str(exc), code="weights_not_found") from None

    def _check_config(self, file: Path) -> None:
        """A folder's config.json must describe the model being served (the numbers, not the
        bytes: a trainer's save_pretrained writes its own keys)."""
        try:
            new = ModelConfig.from_file(file, self.config.dtype)
        except (ModelConfigError, KeyError, ValueError, TypeError) as exc:
            raise WeightsRejected(f"config.json: {exc}", code="config_mismatch") from None
        new = dataclasses.replace(new, eos_token_ids=self.config.eos_token_ids)
        for field in dataclasses.fields(ModelConfig):
            ours, theirs = getattr(self.config, field.name), getattr(new, field.name)
            if ours != theirs:
                raise WeightsRejected(f"config.json: {field.name} is {theirs!r}, the served "
                                      f"model has {ours!r}", code="config_mismatch")

    def _plan(self, entries: list[_Entry]) -> list[_Read]:
        params = dict(self.model.named_parameters())
        reads: list[_Read] = []
        filled: dict[str, str] = {}  # slot name -> the entry that fills it
        for e in entries:
            if is_skipped(self.model, e.name):
                continue
            try:
                slots = slots_of(self.model, params, e.name)
            except CheckpointError as exc:
                raise WeightsRejected(f"{e.source}: {exc}", code="unknown_tensor",
                                      tensor=e.name) from None
            want = expected_shape(params, slots)
            if e.shape != want:
                raise WeightsRejected(f"{e.name}: shape {list(e.shape)}, the model's is "
                                      f"{list(want)}", code="shape_mismatch", tensor=e.name)
            served = params[slots[0].param].dtype
            if e.dtype != served and e.dtype not in _WIDENS.get(served, ()):
                raise WeightsRejected(_dtype_message(e, served), code="dtype_mismatch",
                                      tensor=e.name)
            row_bytes = (e.end - e.begin) // e.shape[0]
            row = 0
            for slot in slots:
                if slot.name in filled:
                    raise WeightsRejected(f"{slot.name} is given twice ({filled[slot.name]} and "
                                          f"{e.name})", code="duplicate_tensor", tensor=e.name)
                filled[slot.name] = e.name
                reads.append(_Read(e, slot, e.begin + row * row_bytes, slot.size * row_bytes))
                row += slot.size
        missing = [name for name in all_slots(self.model) if name not in filled]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise WeightsRejected(f"tensors missing: {', '.join(missing[:3])}{more}",
                                  code="missing_tensors", tensor=missing[0])
        return reads

    # -- reading -----------------------------------------------------------------------------

    def _staging_buffers(self) -> dict[str, torch.Tensor]:
        if not self._buffers:
            pin = any(p.device.type == "cuda" for p in self.model.parameters())
            self._buffers = {name: torch.empty(p.shape, dtype=p.dtype, pin_memory=pin)
                             for name, p in self.model.named_parameters()}
        return self._buffers

    def _read(self, fd: int | None, r: _Read, buffers: dict[str, torch.Tensor],
              digest: WeightsDigest) -> None:
        dest = buffers[r.slot.param].narrow(0, r.slot.start, r.slot.size)
        shape = (r.slot.size, *r.entry.shape[1:])
        # An exact widening is read as stored, hashed, then converted.
        stored = dest if r.entry.dtype == dest.dtype else torch.empty(shape, dtype=r.entry.dtype)
        if r.entry.data is None:
            hexdigest = _pread_hashed(fd, r, slot_bytes(stored))
        else:
            hexdigest = _copy_hashed(r, stored)
        if stored is not dest:
            dest.copy_(stored)
        digest.add(r.slot, r.entry.dtype, shape, hexdigest)


def _pread_hashed(fd: int, r: _Read, out: memoryview) -> str:
    """Read the slot's bytes into `out`, hashing each chunk right after it is read."""
    hasher = WeightsDigest.hasher()
    done = 0
    while done < r.nbytes:
        chunk = out[done:done + min(_CHUNK, r.nbytes - done)]
        n = os.preadv(fd, [chunk], r.begin + done)
        if n <= 0:
            raise WeightsRejected(f"{r.entry.file.name} ended inside tensor {r.entry.name} "
                                  "while it was read (was it changed?)", code="truncated_file",
                                  tensor=r.entry.name)
        hasher.update(chunk[:n])
        done += n
    return hasher.hexdigest()


def _copy_hashed(r: _Read, out: torch.Tensor) -> str:
    """Copy the slot's bytes from a shared tensor (device memory) into `out` (host), and hash
    them as _pread_hashed hashes a file's: the same bytes give the same hash."""
    out.reshape(-1).view(torch.uint8).copy_(r.entry.data[r.begin:r.begin + r.nbytes])
    hasher = WeightsDigest.hasher()
    hasher.update(slot_bytes(out))
    return hasher.hexdigest()


def _entries(files: list[Path]) -> list[_Entry]:
    return [e for f in files for e in _header(f)]


def _header(file: Path) -> list[_Entry]:
    """The tensors a safetensors file declares, checked against its size: 8 bytes of header
    length (little-endian), the JSON header, then the data its offsets point into."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= min(_MAX_HEADER, size - 8):
            raise WeightsRejected(f"{file.name} is not a safetensors file (or is cut short "
                                  "before its data)", code="bad_file")
        try:
            header = json.loads(f.read(n))
            entries = [_entry(file, 8 + n, name, info) for name, info in header.items()
                       if name != "__metadata__"]
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise WeightsRejected(f"{file.name}: the safetensors header is malformed ({exc})",
                                  code="bad_file") from None
    for e in sorted(entries, key=lambda e: e.end):
        if e.end > size:
            raise WeightsRejected(f"{file.name} is truncated: tensor {e.name} needs bytes up to "
                                  f"{e.end}, the file has {size}", code="truncated_file",
                                  tensor=e.name)
    return entries


def _entry(file: Path, base: int, name: str, info: dict) -> _Entry:
    code = info["dtype"]
    if code not in _DTYPES:
        raise WeightsRejected(f"{name}: dtype {code} is not one a model can be served in",
                              code="dtype_mismatch", tensor=name)
    dtype = _DTYPES[code]
    shape = tuple(int(d) for d in info["shape"])
    begin, end = (base + int(o) for o in info["data_offsets"])
    itemsize = torch.empty((), dtype=dtype).element_size()
    if end - begin != math.prod(shape) * itemsize or begin < base:
        raise WeightsRejected(f"{file.name}: tensor {name}'s data offsets do not fit its "
                              f"shape {list(shape)} and dtype {code}", code="bad_file",
                              tensor=name)
    return _Entry(file, name, dtype, shape, begin, end)


def _dtype_message(e: _Entry, served: torch.dtype) -> str:
    accepted = [served, *_WIDENS.get(served, ())]
    names = " or ".join(str(d).removeprefix("torch.") for d in accepted)
    return (f"{e.name}: dtype {str(e.dtype).removeprefix('torch.')}, this worker serves "
            f"{str(served).removeprefix('torch.')} and accepts {names}")
