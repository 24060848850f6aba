"""Ordinary traffic must not eject healthy workers: connections the worker closed while idle,
long requests that keep progressing, and what a client sees when a worker dies mid-stream.

Real built-in workers (the tiny model), real gateway processes, real Redis. Each test names
the failure it catches:
- bursts with idle gaps around the worker's keep-alive, and (through a proxy that makes the
  race certain) connections reset as they are reused: a request sent on a connection the
  worker just closed was a 502 and an ejection of a live worker (17 in 2,400 requests);
- a request that runs long but progresses: a flat attempt timeout cut it (504) and ejected
  its busy worker;
- a worker killed mid-stream: the stream ended in `data: [DONE]` after its error event, so
  clients kept a truncated answer as a success;
- a connection not made within the connect timeout counted as refused, which ejects: under
  guidellm's 512-at-once burst on a loaded host, both healthy workers were ejected; and, with
  one worker, failed the request for want of another worker to retry on.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import threading
import time

import httpx
import orjson
import pytest

from detgate.gateway.upstream import Refused, Unreachable, Upstream
from tests.gateway.dropping_proxy import ReuseDroppingProxy
from tests.gateway.stalling_proxy import StallingProxy
from tests.gateway.test_gateway_faults import events, model_of


def ejections(gw) -> int:
    return gw.proc.log().count(" ejected: ")


async def _bursts(url: str, model: str, *, bursts: int, size: int, gap_s: tuple[float, float],
                  seed: int = 0) -> list[int | str]:
    """`bursts` bursts of `size` concurrent one-token requests (every third streamed), each
    after an idle gap drawn from `gap_s`; the statuses (a stream: 200 only with [DONE]; a
    client-side error: its name)."""
    rng = random.Random(seed)
    statuses: list[int | str] = []
    limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        async def one(i: int) -> int | str:
            body = {"model": model, "prompt": f"burst {i}", "max_tokens": 1,
                    "temperature": 0, "stream": i % 3 == 0}
            try:
                if not body["stream"]:
                    return (await http.post("/v1/completions", json=body)).status_code
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    raw = await r.aread()
            except httpx.HTTPError as exc:
                return type(exc).__name__
            return r.status_code if events(raw)[-1:] == [b"[DONE]"] else "no [DONE]"

        for b in range(bursts):
            statuses += await asyncio.gather(*(one(b * size + i) for i in range(size)))
            await asyncio.sleep(rng.uniform(*gap_s))
    return statuses


@pytest.fixture(scope="module")
def keepalive_1s_workers(start_workers_module):
    """Workers that close idle connections after 1 s (so that a gap of about 1 s races)."""
    return start_workers_module(["batch_invariant"] * 2, ("--keepalive-timeout-s", "1"))


def test_bursts_with_idle_gaps_eject_no_worker(start_gateway, keepalive_1s_workers):
    """The gateway misconfigured to keep idle connections (30 s) far longer than the workers
    (1 s), bursts of 30 after gaps around 1 s: 1,500 requests, every one answered, no worker
    ejected (a connection the worker closed as it was reused is sent again, fresh)."""
    workers = keepalive_1s_workers
    model = model_of(workers[0].url)
    gw = start_gateway([w.url for w in workers], env={"DETGATE_UPSTREAM_KEEPALIVE_S": "30"})
    statuses = asyncio.run(_bursts(gw.url, model, bursts=50, size=30, gap_s=(0.9, 1.2)))
    reconnects = sum(gw.metric("detgate_upstream_reconnects_total", worker=w.url)
                     for w in workers)
    print(f"misconfigured keep-alive: {len(statuses)} requests, {reconnects:g} resent on a "
          f"fresh connection, {ejections(gw)} ejections")
    assert len(statuses) >= 1500
    assert [s for s in statuses if s != 200] == []
    assert ejections(gw) == 0
    assert all(gw.metric("detgate_worker_up", worker=w.url) == 1 for w in workers)


def test_a_reused_connection_reset_before_any_answer_is_sent_again(start_gateway,
                                                                   keepalive_1s_workers):
    """Every reused connection reset at the moment of reuse (tests/gateway/dropping_proxy.py
    in front of the real workers: the race, made certain): each such request, health checks
    included, goes once more on a fresh connection, is answered, and counts against no
    worker. Before, each was a 502 and an ejection."""
    proxies = [ReuseDroppingProxy(w.url).start() for w in keepalive_1s_workers]
    try:
        model = model_of(keepalive_1s_workers[0].url)
        gw = start_gateway([p.url for p in proxies])
        statuses = asyncio.run(_bursts(gw.url, model, bursts=10, size=30, gap_s=(0.1, 0.3)))
        reconnects = [gw.metric("detgate_upstream_reconnects_total", worker=p.url)
                      for p in proxies]
        dropped = [p.dropped for p in proxies]
        # Counted while the proxies still stand: once they stop, the next health check is
        # refused and ejects both workers, rightly.
        ejected = ejections(gw)
    finally:
        for p in proxies:
            p.stop()
    print(f"reset on reuse: {sum(dropped)} requests, {sum(reconnects):g} sent again, "
          f"{ejected} ejections, {len(statuses)} answered")
    assert [s for s in statuses if s != 200] == []
    # Every POST reset is sent again by the gateway; a reset GET (a health check) may be
    # retried by aiohttp itself first, as it does for idempotent requests.
    assert 0 < sum(reconnects) <= sum(dropped)
    assert ejected == 0


def test_long_progressing_requests_are_not_cut_and_eject_nothing(start_gateway,
                                                                 keepalive_1s_workers):
    """Requests that run many times the first-byte and progress timeouts (2 s) but keep
    producing: a whole one asks for 16 x 800 tokens (its timeout follows that), a stream
    sends events all along. Both complete; the worker is never ejected."""
    worker = keepalive_1s_workers[0]
    model = model_of(worker.url)
    gw = start_gateway([worker.url], env={"DETGATE_FIRST_BYTE_TIMEOUT_S": "2",
                                          "DETGATE_PROGRESS_TIMEOUT_S": "2"})
    t0 = time.monotonic()
    with gw.http() as http:
        whole = http.post("/v1/completions", json={
            "model": model, "prompt": "Once", "n": 16, "max_tokens": 800, "temperature": 1.0,
            "seed": 1})
        whole_s = time.monotonic() - t0
        assert whole.status_code == 200, whole.text
        with http.stream("POST", "/v1/completions", json={
                "model": model, "prompt": "Twice", "max_tokens": 800, "temperature": 1.0,
                "seed": 2, "stream": True, "n": 4}) as r:
            streamed = events(r.read())
    stream_s = time.monotonic() - t0 - whole_s
    print(f"whole answer {whole_s:.1f} s, stream {stream_s:.1f} s, against 2 s timeouts")
    assert whole_s > 4  # it did outlast the first-byte timeout (else this proves nothing)
    assert streamed[-1] == b"[DONE]"
    assert ejections(gw) == 0
    assert gw.metric("detgate_worker_up", worker=worker.url) == 1


def test_worker_killed_mid_stream_ends_in_an_error_event_not_done(start_gateway, start_worker):
    """kill -9 after a few events: HTTP 200, the tokens, an error event and no `[DONE]`; the
    record `failed` with exactly the tokens sent; the other worker takes what follows."""
    workers = [start_worker(), start_worker()]
    model = model_of(workers[0].url)
    gw = start_gateway([w.url for w in workers])
    gw.wait_up([w.url for w in workers])
    with gw.http() as http:
        with http.stream("POST", "/v1/completions", json={
                "model": model, "prompt": "Long story:", "max_tokens": 1500, "temperature": 0,
                "stream": True, "logprobs": 1}) as r:
            rid = r.headers["x-detgate-record-id"]
            got: list[bytes] = []
            killed = False
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                got.append(line[6:].encode())
                if len(got) == 6 and not killed:
                    victim = _inflight_worker(gw, workers)
                    os.kill(victim.popen.pid, signal.SIGKILL)
                    killed = True
        assert r.status_code == 200
        assert b"[DONE]" not in got, got[-3:]
        error = orjson.loads(got[-1])["error"]
        assert error["type"] == "upstream_error" and error["code"] == "upstream_failed"
        chunks = [orjson.loads(g) for g in got[:-1]]
        sent_text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        sent_tokens = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks
                          if c["choices"] and c["choices"][0].get("logprobs"))
        rec = http.get(f"/v1/requests/{rid}").json()
        assert rec["status"] == "failed", rec["status"]
        assert rec["choices"][0]["text"] == sent_text
        assert len(rec["choices"][0]["token_ids"]) == sent_tokens > 0
        (survivor,) = (w for w in workers if w is not victim)
        # What follows is sent once the victim is gone: a process that SIGKILL has not yet
        # ended (a loaded machine) still accepts connections, and a request it takes fails.
        victim.popen.wait(timeout=30)
        for i in range(10):
            r = http.post("/v1/completions", json={"model": model, "prompt": f"after {i}",
                                                   "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert http.get(f"/v1/requests/{r.json()['id']}").json()["worker"] == survivor.url
    assert gw.metric("detgate_worker_up", worker=victim.url) == 0


def _inflight_worker(gw, workers):
    """The worker a single running request is on (the gateway's in-flight gauge)."""
    busy = [w for w in workers if gw.metric("detgate_worker_inflight", worker=w.url) > 0]
    assert len(busy) == 1, busy
    return busy[0]


async def test_a_connect_timeout_is_not_a_refusal():
    """Only a refusal proves nothing listens (Refused: the caller ejects); a connection the
    worker's host does not complete in time (here a listener whose accept queue is full, as
    a starved host's can be) is Unreachable: its health check decides."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filling = []
    for _ in range(3):  # the accept queue full: the next handshake is not completed
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        filling.append(s)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    upstream = Upstream(connect_timeout_s=0.3, keepalive_s=1, progress_timeout_s=5)
    try:
        await asyncio.sleep(0.1)
        with pytest.raises(Unreachable) as slow:
            await upstream.post(f"http://127.0.0.1:{port}/v1/completions", b"{}", 2)
        assert not isinstance(slow.value, Refused), slow.value
        with pytest.raises(Refused):
            await upstream.post(f"http://127.0.0.1:{closed_port}/v1/completions", b"{}", 2)
    finally:
        await upstream.close()
        for s in (*filling, listener):
            s.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_connect_timeout_to_the_only_worker_is_tried_once_more(start_gateway,
                                                                 keepalive_1s_workers, stream):
    """One worker, whose host completes no new connection for 2 s (its accept queue full, as
    under a burst on a starved host): the first attempt's connect times out (1.5 s), and as
    the request never reached the worker, the one retry goes to the same worker instead of
    failing for want of another. Before, that was a 502 (1 of 200 requests in a burst of
    200 against one worker)."""
    worker = keepalive_1s_workers[0]
    proxy = StallingProxy(worker.url).start()
    try:
        gw = start_gateway([proxy.url], env={"DETGATE_CONNECT_TIMEOUT_S": "1.5"})
        body = {"model": model_of(worker.url), "prompt": "stalled", "max_tokens": 2,
                "temperature": 0, "stream": stream}
        proxy.stall()
        threading.Timer(2.0, proxy.release).start()
        t0 = time.monotonic()
        with httpx.Client(base_url=gw.url, timeout=30) as http:
            r = http.post("/v1/completions", json=body)
        took = time.monotonic() - t0
        ejected = ejections(gw)  # before the proxy stops (then its worker is rightly ejected)
    finally:
        proxy.stop()
    assert r.status_code == 200, r.text
    if stream:
        assert events(r.content)[-1] == b"[DONE]"
    assert took > 1.5  # the first connect did time out: the answer came from the retry
    assert ejected == 0
