"""The client side of a built-in worker's weight-update endpoint (POST /update_weights_from_disk,
worker/server/admin.py), torch-free so that any layer can push weights: the RL loop, the
trainer, the benchmarks, the tests.

    answers = update_workers(worker_urls, admin_token, "/dev/shm/step-12.safetensors")
    answers[0]["system_fingerprint"]  # what records sampled from now on will name

`model_path` is a checkpoint folder or one .safetensors file that the workers can read (on
their host). A trainer's tensors become such a file in shared memory with
worker/tools/push_weights.py (`write_handoff`, or `update_weights(..., tensors=...)`), in a
folder `handoff_dir` chooses; or, on CUDA, go as IPC handles
(`update_workers_from_tensors`, POST /update_weights_from_tensor: worker/model/weight_ipc.py
describes them).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from detgate.contract.constants import UPDATE_WEIGHTS_FROM_TENSOR_PATH, UPDATE_WEIGHTS_PATH

HANDOFF_DIR_ENV = "DETGATE_HANDOFF_DIR"


class WeightPushError(RuntimeError):
    """A worker refused the update or did not answer; `answer` is its error body, if any."""

    def __init__(self, url: str, message: str, answer: dict | None = None) -> None:
        super().__init__(f"{url}: {message}")
        self.url = url
        self.answer = answer


def update_workers(urls: list[str], token: str, model_path: str | Path, *,
                   abort_all_requests: bool = False, timeout_s: float = 600.0) -> list[dict]:
    """Load the weights at `model_path` into every worker at `urls` (base URLs) at once, each
    with the admin `token`; their answers in order (system_fingerprint, timings, ...).
    `abort_all_requests`: end the requests in flight now (409 weights_updated) instead of
    letting them finish on the old weights first. Raises WeightPushError for the first worker
    that refused or did not answer (the others may have updated: their fingerprints say)."""
    body = {"model_path": str(model_path), "abort_all_requests": abort_all_requests}
    return _post_all(urls, token, UPDATE_WEIGHTS_PATH, body, timeout_s)


def update_workers_from_tensors(urls: list[str], token: str, tensors: list[dict], *,
                                abort_all_requests: bool = False,
                                timeout_s: float = 600.0) -> list[dict]:
    """The same from shared CUDA tensors (`tensors`: weight_ipc.share's descriptions); the
    trainer keeps them alive until this returns. A worker that cannot open them (another host
    or GPU, a CPU worker) refuses with the code `ipc_unavailable`."""
    body = {"tensors": tensors, "abort_all_requests": abort_all_requests}
    return _post_all(urls, token, UPDATE_WEIGHTS_FROM_TENSOR_PATH, body, timeout_s)


def _post_all(urls: list[str], token: str, path: str, body: dict,
              timeout_s: float) -> list[dict]:
    with ThreadPoolExecutor(max(1, len(urls))) as pool:
        return list(pool.map(lambda url: _post(url, path, token, body, timeout_s), urls))


def handoff_dir(nbytes: int) -> str:
    """Where a handoff file of `nbytes` goes: DETGATE_HANDOFF_DIR, else /dev/shm (memory) when
    it has room, else the temp dir (containers often give /dev/shm 64 MB)."""
    if os.environ.get(HANDOFF_DIR_ENV):
        return os.environ[HANDOFF_DIR_ENV]
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > nbytes * 1.05:
        return str(shm)
    return tempfile.gettempdir()


def _post(url: str, path: str, token: str, body: dict, timeout_s: float) -> dict:
    try:
        r = httpx.post(url.rstrip("/") + path, json=body, timeout=timeout_s,
                       headers={"Authorization": f"Bearer {token}"})
    except httpx.HTTPError as exc:
        raise WeightPushError(url, f"no answer: {exc}") from exc
    try:
        answer = r.json()
    except ValueError:
        answer = None
    if r.status_code != 200 or not isinstance(answer, dict):
        error = answer.get("error") if isinstance(answer, dict) else None
        message = error.get("message") if isinstance(error, dict) else r.text[:500]
        raise WeightPushError(url, f"{r.status_code}: {message}", answer)
    return answer
