"""Workers found through DNS (`DETGATE_WORKERS=dns+http://NAME:PORT`): a real DNS server on
127.0.0.1 whose A records the test changes, two real built-in workers on the same port of two
loopback addresses (127.0.0.1 and 127.0.0.2), a real gateway resolving the name through that
server. Workers join without a restart; one that leaves DNS is drained: no new request goes
to it, the one in flight on it finishes, and its metrics go once it is idle."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.support.dns_server import DnsServer
from tests.support.procs import Proc, detgate_cmd, free_port

NAME = "workers.detgate.test"
HOSTS = ("127.0.0.1", "127.0.0.2")


@pytest.fixture(scope="module")
def dns_server():
    server = DnsServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def port_and_workers(tiny_model, tmp_path_factory):
    """One built-in worker per loopback address, all on one port (as pods behind a headless
    Service are)."""
    logs = tmp_path_factory.mktemp("dns-workers")
    port = free_port()
    procs = [Proc(detgate_cmd("worker", "--model", str(tiny_model), "--host", host,
                              "--port", str(port)),
                  f"http://{host}:{port}", logs / f"worker-{host}.log") for host in HOSTS]
    threads = [threading.Thread(target=p.start, kwargs={"timeout": 180}) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    yield port, procs
    for p in procs:
        p.stop()


@pytest.fixture
def gw(start_gateway, dns_server, port_and_workers):
    port, _ = port_and_workers
    dns_server.set(NAME, [HOSTS[0]])
    return start_gateway([f"dns+http://{NAME}:{port}"], env={
        "DETGATE_DNS_NAMESERVERS": dns_server.address, "DETGATE_DNS_REFRESH_S": "0.2"})


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def served_by(gw, n: int) -> set[str]:
    """The workers that answered n concurrent completions (from their records)."""
    out: set[str] = set()

    def one() -> None:
        with gw.http() as http:
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hello",
                                                   "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200, r.text
            out.add(http.get(f"/v1/requests/{r.json()['id']}").json()["worker"])

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_workers_join_and_leave_with_dns(gw, dns_server, port_and_workers):
    port, _ = port_and_workers
    first, second = (f"http://{h}:{port}" for h in HOSTS)
    assert served_by(gw, 4) == {first}

    dns_server.set(NAME, list(HOSTS))
    wait_for(lambda: gw.metric("detgate_worker_up", worker=second) == 1)
    assert served_by(gw, 8) == {first, second}

    # A long request in flight on the first worker when it leaves DNS.
    answer: dict = {}

    def long_request() -> None:
        with gw.http() as http:
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "a long one",
                                                   "max_tokens": 900, "temperature": 0})
            answer.update(status=r.status_code, body=r.json())

    thread = threading.Thread(target=long_request)
    thread.start()
    wait_for(lambda: gw.metric("detgate_worker_inflight", worker=first)
             + gw.metric("detgate_worker_inflight", worker=second) == 1)
    draining = first if gw.metric("detgate_worker_inflight", worker=first) == 1 else second
    staying = second if draining == first else first
    lookups = gw.metric("detgate_dns_lookups_total", result="ok")
    dns_server.set(NAME, [staying.removeprefix("http://").rpartition(":")[0]])
    # Gone from the choice once a lookup begun after the change has been applied: the one in
    # flight may answer the old set, the next one the new, and a third one counted means the
    # second one's update is done (one request landing on the staying worker proves nothing).
    wait_for(lambda: gw.metric("detgate_dns_lookups_total", result="ok") >= lookups + 3)
    # Still counted while its request runs.
    assert served_by(gw, 6) == {staying}
    assert thread.is_alive(), "the long request ended before the check: make it longer"
    assert gw.metric("detgate_worker_inflight", worker=draining) == 1
    thread.join(timeout=120)
    assert answer["status"] == 200, answer
    assert answer["body"]["usage"]["completion_tokens"] == 900
    with gw.http() as http:
        rec = http.get(f"/v1/requests/{answer['body']['id']}").json()
    assert rec["status"] == "complete" and rec["worker"] == draining
    # Drained: its series are gone, the other worker's stay.
    wait_for(lambda: f'worker="{draining}"' not in httpx.get(gw.url + "/metrics").text)
    assert gw.metric("detgate_worker_up", worker=staying) == 1


def test_failed_lookups_keep_workers_and_nxdomain_drains_them(gw, dns_server,
                                                              port_and_workers):
    port, _ = port_and_workers
    first = f"http://{HOSTS[0]}:{port}"
    assert served_by(gw, 2) == {first}
    failed = gw.metric("detgate_dns_lookups_total", result="failed")
    dns_server.failing = True
    wait_for(lambda: gw.metric("detgate_dns_lookups_total", result="failed") > failed + 2)
    assert served_by(gw, 2) == {first}, "a DNS outage must not empty the fleet"
    dns_server.failing = False

    dns_server.remove(NAME)
    wait_for(lambda: httpx.get(gw.url + "/readyz").status_code == 503)
    with gw.http() as http:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hello",
                                               "max_tokens": 4})
    assert r.status_code == 503 and r.json()["error"]["type"]
    assert gw.metric("detgate_dns_lookups_total", result="empty") > 0

    dns_server.set(NAME, [HOSTS[0]])
    wait_for(lambda: httpx.get(gw.url + "/readyz").status_code == 200)
    assert served_by(gw, 2) == {first}


def test_bad_dns_entries_stop_the_start(tmp_path):
    for entry, nameservers in (("dns+ftp://x:1", ""), ("dns+http://x:1/v1", ""),
                               ("dns+http://x:1", "not-an-address")):
        out = subprocess.run(
            [sys.executable, "-m", "detgate.cli", "gateway"], capture_output=True, text=True,
            timeout=60, env={"PATH": "/usr/bin:/bin", "DETGATE_WORKERS": entry,
                             "DETGATE_DNS_NAMESERVERS": nameservers,
                             "DETGATE_STATE_DIR": str(tmp_path),
                             "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
        assert out.returncode == 2, (entry, out.stderr)
        assert "bad configuration" in out.stderr
