"""POST /update_weights_from_disk and /update_weights_from_tensor: load new weights into the
running worker (SGLang's paths), for an RL loop that pushes its trainer's weights after every
optimizer step.

`model_path` is a checkpoint folder (as `--model` takes) or one .safetensors file: a trainer on
the same host hands its tensors over as a file in shared memory (/dev/shm), which the worker
reads into its staging copy (worker/tools/push_weights.py writes it; the client of this
endpoint is contract/weight_updates.py). From a trainer on the same host and GPU,
/update_weights_from_tensor takes its CUDA tensors' IPC handles instead, as JSON
(model/weight_ipc.py): no file is written; the worker copies the bytes out of the trainer's
memory into the same staging copy.
Everything is checked and hashed before the live weights are touched (model/weight_update.py);
a bad update is a 400 naming the tensor, and the old weights keep serving. Then the engine
applies it between steps (engine/async_engine.py): requests in flight finish on the old
weights, or with `abort_all_requests` end now with a 409 `weights_updated` error; requests that
arrive meanwhile wait and run on the new weights. The answer names the new system_fingerprint.

Authentication: a bearer token of its own (`--admin-token-file`, or DETGATE_WORKER_ADMIN_TOKEN),
never a tenant key; without one configured the endpoint refuses every call (403). The gateway
has no route to it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from detgate.contract import errors
from detgate.contract.constants import (
    ADMIN_TOKEN_ENV,
    UPDATE_WEIGHTS_FROM_TENSOR_PATH,
    UPDATE_WEIGHTS_PATH,
)
from detgate.worker.errors import AdminDisabled, AdminUnauthorized, InvalidRequest
from detgate.worker.model.weight_ipc import SharedTensorError, open_shared
from detgate.worker.model.weight_update import StagedWeights, WeightsRejected, WeightStager
from detgate.worker.server.context import ServingContext
from detgate.worker.server.http import json_response

log = logging.getLogger("detgate.worker")
router = APIRouter()


class UpdateWeightsRequest(BaseModel):
    model_path: str
    abort_all_requests: bool = False


class SharedTensorSpec(BaseModel):
    """One CUDA tensor as model/weight_ipc.share describes it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: str
    dtype: str
    shape: list[int] = Field(max_length=8)
    stride: list[int] = Field(max_length=8)
    offset: int
    device: int = Field(ge=0)
    handle: str = Field(max_length=1024)
    storage_bytes: int = Field(ge=0)
    storage_offset_bytes: int = Field(ge=0)
    ref_counter_handle: str = Field(max_length=1024)
    ref_counter_offset: int = Field(ge=0)
    event_handle: str | None = Field(default=None, max_length=1024)
    event_sync_required: bool


class UpdateWeightsFromTensorRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tensors: list[SharedTensorSpec] = Field(min_length=1, max_length=100_000)
    abort_all_requests: bool = False


@router.post(UPDATE_WEIGHTS_PATH)
async def update_weights_from_disk(request: Request):
    admin: WeightAdmin = request.app.state.admin
    body = await admin.parse(request, UpdateWeightsRequest)
    return json_response(await admin.update(
        lambda: admin.stager.stage(Path(body.model_path)), body.abort_all_requests,
        body.model_path))


@router.post(UPDATE_WEIGHTS_FROM_TENSOR_PATH)
async def update_weights_from_tensor(request: Request):
    admin: WeightAdmin = request.app.state.admin
    body = await admin.parse(request, UpdateWeightsFromTensorRequest)
    specs = [t.model_dump() for t in body.tensors]
    return json_response(await admin.update(lambda: admin.stage_shared(specs),
                                            body.abort_all_requests, "shared tensors"))


class WeightAdmin:
    """Authorises admin calls and runs weight updates, one at a time."""

    def __init__(self, token: str | None, ctx: ServingContext, stager: WeightStager) -> None:
        self._token = token
        self.ctx = ctx
        self.stager = stager
        self._lock = asyncio.Lock()

    def authorize(self, header: str | None) -> None:
        if not self._token:
            raise AdminDisabled("weight updates are disabled on this worker: start it with "
                                f"--admin-token-file or {ADMIN_TOKEN_ENV}")
        scheme, _, given = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                 self._token.encode()):
            raise AdminUnauthorized("a valid admin token is required (Authorization: Bearer)")

    async def parse(self, request: Request, model: type[BaseModel]) -> BaseModel:
        """The request's body, parsed only once the caller is known to be the admin."""
        self.authorize(request.headers.get("authorization"))
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as exc:
            message, param, code = errors.validation_error(exc.errors())
            raise InvalidRequest(message, param=param, code=code) from None

    def stage_shared(self, specs: list[dict]) -> StagedWeights:
        device = next(self.stager.model.parameters()).device
        try:
            shared = open_shared(specs, device)
        except SharedTensorError as exc:
            raise WeightsRejected(str(exc), code=exc.code, tensor=exc.tensor) from None
        return self.stager.stage_shared(shared)

    async def update(self, stage: Callable[[], StagedWeights], abort: bool, source: str) -> dict:
        async with self._lock:
            start = time.perf_counter()
            try:
                staged = await asyncio.to_thread(stage)
            except WeightsRejected as exc:
                log.warning("weight update refused: %s", exc)
                raise InvalidRequest(f"weights refused, the old ones keep serving: {exc}",
                                     param=exc.tensor or "model_path", code=exc.code) from None
            staged_s = time.perf_counter() - start
            previous = self.ctx.fingerprint
            # No await between these two lines: what is submitted from here on runs on the new
            # weights (engine/async_engine.py), and is named so.
            fingerprint = self.ctx.use_weights(staged.weights_sha256)
            applied = self.ctx.engine.update_weights(staged.commit, abort=abort)
            outcome = await applied
        total_s = time.perf_counter() - start
        log.info("weights updated from %s: %s -> %s (%d finished first, %d aborted, %.3f s)",
                 source, previous, fingerprint, outcome.finished, outcome.aborted,
                 total_s)
        return {"success": True, "message": f"weights updated: {fingerprint}",
                "system_fingerprint": fingerprint, "previous_fingerprint": previous,
                "weights_sha256": staged.weights_sha256,
                "num_finished_requests": outcome.finished,
                "num_aborted_requests": outcome.aborted,
                "timings": {"stage_s": staged_s, "drain_s": outcome.drain_s,
                            "commit_s": outcome.commit_s, "total_s": total_s}}


def read_admin_token(path: str | None) -> str | None:
    """The admin token: the file's content, else the environment's (None: no admin)."""
    if path:
        token = Path(path).read_text().strip()
        if not token:
            raise SystemExit(f"--admin-token-file {path} is empty")
        return token
    return os.environ.get(ADMIN_TOKEN_ENV) or None
