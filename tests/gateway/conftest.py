"""Gateway fixtures: real gateway processes (`start_gateway`) against a real Redis, built-in
workers (`start_workers_module`), and a vLLM-shaped fixture worker (`vllm_worker`) that also
records what reached it."""

from __future__ import annotations

import re
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.vllm_worker import VllmFixtureWorker
from tests.support.procs import Proc, detgate_cmd, free_port
from tests.support.redis_keys import delete_prefix, keys_under


@dataclass
class Gateway:
    proc: Proc
    url: str
    prefix: str
    redis_url: str

    def client(self, key: str = "open") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def http(self, key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def record(self, rid: str, key: str | None = None) -> dict:
        """GET /v1/requests/{rid}, which must answer 200."""
        with self.http(key) as http:
            r = http.get(f"/v1/requests/{rid}")
        assert r.status_code == 200, r.text
        return r.json()

    def redis_keys(self) -> list[bytes]:
        return keys_under(self.redis_url, self.prefix)

    def wait_up(self, worker_urls: list[str], timeout: float = 60.0) -> None:
        """Until every one of `worker_urls` passed its first health check and probe. /readyz
        answers once one worker is up: a test that needs them all (one to hang or kill while
        the other serves, a capacity summed over them) waits here first."""
        deadline = time.monotonic() + timeout
        while not all(self.metric("detgate_worker_up", worker=u) == 1 for u in worker_urls):
            assert time.monotonic() < deadline, self.proc.log()[-2000:]
            time.sleep(0.1)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (0.0 when absent)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            series, _, value = line.rpartition(" ")
            metric = series.partition("{")[0]
            if metric == name and dict(re.findall(r'(\w+)="([^"]*)"', series)) == labels:
                return float(value)
        return 0.0


def _gateway_starter(redis_url: str, log_dir: Path) -> Iterator:
    """`start(workers, api_keys="", redis=..., env={}, wait="/readyz", prefix=None)` -> Gateway.

    Each gateway gets its own Redis key prefix (or shares `prefix` with an earlier one); its
    keys are deleted afterwards."""
    started: list[Gateway] = []

    def start(workers: list[str], *, api_keys: str = "", redis: str | None = None,
              env: dict[str, str] | None = None, wait: str = "/readyz",
              prefix: str | None = None) -> Gateway:
        port = free_port()
        prefix = prefix or f"detgate-test-{secrets.token_hex(4)}"
        url = f"http://127.0.0.1:{port}"
        proc_env = {
            "DETGATE_HOST": "127.0.0.1", "DETGATE_PORT": str(port),
            "DETGATE_WORKERS": ",".join(workers), "DETGATE_API_KEYS": api_keys,
            "DETGATE_REDIS_URL": redis or redis_url, "DETGATE_KEY_PREFIX": prefix,
            "DETGATE_HEALTH_INTERVAL_S": "0.2", "DETGATE_CONNECT_TIMEOUT_S": "1",
            # Its own record spool (a restarted gateway that should find one passes its own).
            "DETGATE_STATE_DIR": str(log_dir / f"state-{port}"),
            **(env or {}),
        }
        proc = Proc(detgate_cmd("gateway"), url, log_dir / f"gateway-{port}.log", env=proc_env)
        gw = Gateway(proc, url, prefix, redis or redis_url)
        started.append(gw)
        proc.start(wait, timeout=60)
        return gw

    yield start
    for gw in started:
        gw.proc.stop()
    delete_prefix(redis_url, *(gw.prefix for gw in started))


@pytest.fixture
def start_gateway(redis_url, tmp_path) -> Iterator:
    """Start real gateway processes (see `_gateway_starter`)."""
    yield from _gateway_starter(redis_url, tmp_path)


@pytest.fixture(scope="module")
def start_gateway_module(redis_url, tmp_path_factory) -> Iterator:
    yield from _gateway_starter(redis_url, tmp_path_factory.mktemp("gateway"))


def _running_vllm_worker() -> Iterator[VllmFixtureWorker]:
    worker = VllmFixtureWorker()
    worker.start()
    yield worker
    worker.stop()


@pytest.fixture
def vllm_worker() -> Iterator[VllmFixtureWorker]:
    yield from _running_vllm_worker()


@pytest.fixture(scope="module")
def vllm_worker_module() -> Iterator[VllmFixtureWorker]:
    yield from _running_vllm_worker()


@pytest.fixture(scope="module")
def start_workers_module(tiny_model, tmp_path_factory) -> Iterator:
    """`start(modes, extra=())` -> built-in worker processes serving the demo model, one per
    mode (`extra`: more flags). When
    the module's tests are done, every process in the returned lists is stopped: a test that
    restarts a worker puts the new process in its place."""
    started: list[list[Proc]] = []

    def start(modes: list[str], extra: tuple[str, ...] = ()) -> list[Proc]:
        procs = _start_workers(tiny_model, tmp_path_factory.mktemp("workers"), modes, extra)
        started.append(procs)
        return procs

    yield start
    for procs in started:
        for proc in procs:
            proc.stop()


def _start_workers(model_dir: Path, log_dir: Path, modes: list[str],
                   extra: tuple[str, ...] = ()) -> list[Proc]:
    """Built-in worker processes, started together (each takes seconds to load torch);
    `extra`: more flags for each."""
    procs = []
    for mode in modes:
        port = free_port()
        procs.append(Proc(detgate_cmd("worker", "--model", str(model_dir), "--mode", mode,
                                      "--port", str(port), *extra),
                          f"http://127.0.0.1:{port}", log_dir / f"worker-{port}.log"))
    errors: list[BaseException] = []

    def run(proc: Proc) -> None:
        try:
            proc.start("/health", timeout=180)
        except BaseException as exc:  # reported below, from the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for p in procs:
            p.stop()
        raise errors[0]
    return procs
