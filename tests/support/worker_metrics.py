"""A worker's own /metrics, read the way tests check that work stopped when clients left."""

from __future__ import annotations

import time

import httpx


def worker_gauge(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rpartition(" ")[2])
    return 0.0


def idle(url: str) -> bool:
    return (worker_gauge(url, "detgate_worker_requests_running") == 0
            and worker_gauge(url, "detgate_worker_requests_waiting") == 0)


def wait_until(predicate, timeout: float = 30.0) -> float:
    """Seconds it took `predicate` to hold (fails after `timeout`)."""
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        time.sleep(0.1)
    return time.monotonic() - t0


def assert_all_work_stopped(gw, worker_urls: list[str], timeout: float = 20.0) -> float:
    """Every worker idle within `timeout` and generating nothing for a second after, nothing
    queued or in flight in the gateway, no worker ejected. Returns the seconds to idle."""
    stopped = max(wait_until(lambda u=u: idle(u), timeout=timeout) for u in worker_urls)
    generated = [worker_gauge(u, "detgate_worker_generated_tokens_total") for u in worker_urls]
    time.sleep(1.0)
    assert [worker_gauge(u, "detgate_worker_generated_tokens_total")
            for u in worker_urls] == generated
    assert gw.metric("detgate_queue_depth") == 0
    assert all(gw.metric("detgate_worker_inflight", worker=u) == 0 for u in worker_urls)
    assert all(gw.metric("detgate_worker_up", worker=u) == 1 for u in worker_urls)
    assert " ejected: " not in gw.proc.log()
    return stopped
