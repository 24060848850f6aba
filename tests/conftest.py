"""Fixtures shared by every test package: a real Redis, the demo model, real worker processes."""

from __future__ import annotations

import os
import subprocess
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
