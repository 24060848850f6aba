"""Faults: Redis killed (-9) under load, with and without the spool filling up; a worker hung
(SIGSTOP) with requests waiting on it; SIGTERM during long requests and streams.

What must hold: every 2xx and every `data: [DONE]` has its record afterwards (0 lost), no
client is told success for an unrecorded answer, and everything that fails fails in the error
shape, with a record where the request was forwarded. Real Redis (an own redis-server),
real worker processes (the tiny model), real gateway processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest
import redis

from detgate.gateway.interrupts import stopping
from detgate.gateway.keys import Keys
from tests.gateway.test_gateway_redis_outage import OwnRedis

REC = "X-Detgate-Record-Id"
CHAT = "/v1/chat/completions"


@pytest.fixture
def own_redis(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    r = OwnRedis(tmp_path, durable=True)
    r.start()
    yield r
    r.stop()


def model_of(worker_url: str) -> str:
    return httpx.get(worker_url + "/v1/models", timeout=10).json()["data"][0]["id"]


def body(model: str, i: int, stream: bool, max_tokens: int = 8) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def events(raw: bytes) -> list[bytes]:
    return [line[6:] for line in raw.splitlines() if line.startswith(b"data: ")]


def send(base: str, payload: dict, key: str | None = None) -> dict:
    """One request (`key`: the tenant's API key); what the client was told: status, record id,
    success claimed."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=base, timeout=120, headers=headers) as http:
        if not payload["stream"]:
            r = http.post(CHAT, json=payload)
            out = {"status": r.status_code, "id": r.headers.get(REC), "ok": r.status_code == 200,
                   "json": r.json(), "headers": r.headers}
            if r.status_code == 200:
                assert r.json()["id"] == r.headers[REC]
            return out
        with http.stream("POST", CHAT, json=payload) as r:
            raw = r.read()
        data = events(raw) if r.status_code == 200 else []
        errors = [orjson.loads(d)["error"] for d in data if d != b"[DONE]"
                  and "error" in orjson.loads(d)]
        return {"status": r.status_code, "id": r.headers.get(REC), "stream": True,
                "ok": bool(data) and data[-1] == b"[DONE]", "errors": errors, "raw": raw}


def wait_drained(base: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        ready = httpx.get(base + "/readyz", timeout=5).json()
        if ready["redis"] and ready["spool"]["records"] == 0:
            return
        assert time.monotonic() < deadline, ready
        time.sleep(0.2)


def lost_records(gw, outcomes: list[dict]) -> list[str]:
    """Ids of answers that claimed success but have no record in Redis."""
    client = redis.Redis.from_url(gw.redis_url)
    try:
        return [o["id"] for o in outcomes if o["ok"]
                and client.get(Keys(gw.prefix).record("default", o["id"])) is None]
    finally:
        client.close()


def test_redis_kill9_under_load_loses_no_record(start_gateway, start_worker, own_redis):
    worker = start_worker()
    model = model_of(worker.url)
    gw = start_gateway([worker.url], redis=own_redis.url)
    n = 40
    payloads = [body(model, i, stream=i % 2 == 1) for i in range(n)]
    done = threading.Semaphore(0)

    def one(p: dict) -> dict:
        try:
            return send(gw.url, p)
        finally:
            done.release()

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(one, p) for p in payloads]
        for _ in range(10):
            done.acquire()
        own_redis.kill()
        time.sleep(1.5)
        own_redis.start()
        outcomes = [f.result() for f in futures]
    wait_drained(gw.url)
    ok = [o for o in outcomes if o["ok"]]
    assert len(ok) == n, [o for o in outcomes if not o["ok"]][:3]  # the outage cost no answer
    assert lost_records(gw, outcomes) == []
    assert gw.metric("detgate_records_total", result="spooled") > 0
    with httpx.Client(base_url=gw.url, timeout=10) as http:
        for o in ok:
            assert http.get(f"/v1/requests/{o['id']}").json()["status"] == "complete"


def _refused_properly(o: dict) -> bool:
    """Refused without a success claim: a 503 recorder_unavailable, or a stream whose record
    could not be made durable ending in that error event and no [DONE]."""
    if o["status"] == 503:
        err = orjson.loads(o["raw"]) if o.get("stream") else o["json"]
        return err["error"]["code"] == "recorder_unavailable"
    return bool(o.get("stream") and o["errors"]
                and o["errors"][-1]["code"] == "recorder_unavailable"
                and b"[DONE]" not in o["raw"])


def finished_on(worker_url: str) -> float:
    """Requests the worker has finished (any finish reason)."""
    text = httpx.get(worker_url + "/metrics", timeout=10).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("detgate_worker_requests_total{"))


def test_spool_full_refuses_before_any_work(start_gateway, start_worker, own_redis):
    """Redis down and the spool full: requests are refused (503, or an error event without
    [DONE]), never claimed; once the spool has no room for a record, /readyz fails and
    requests are refused before any worker generates them."""
    worker = start_worker()
    model = model_of(worker.url)
    gw = start_gateway([worker.url], redis=own_redis.url,
                       env={"DETGATE_SPOOL_MAX_BYTES": "40000"})
    assert send(gw.url, body(model, 0, stream=False))["ok"]
    own_redis.kill()
    outcomes: list[dict] = []
    for i in range(1, 200):
        outcomes.append(send(gw.url, body(model, i, stream=i % 2 == 0)))
        if not outcomes[-1]["ok"]:
            break
    spooled = [o for o in outcomes if o["ok"]]
    assert spooled, "the spool took nothing before it was full"
    assert _refused_properly(outcomes[-1]), outcomes[-1]
    ready = httpx.get(gw.url + "/readyz", timeout=5)
    assert ready.status_code == 503 and ready.json()["spool"]["usable"] is False, ready.text
    generated = finished_on(worker.url)
    refused = [send(gw.url, body(model, 1000 + i, stream=i % 2 == 0)) for i in range(6)]
    for o in refused:
        assert o["status"] == 503 and _refused_properly(o), o
    assert finished_on(worker.url) == generated  # nothing generated for them
    own_redis.start()
    wait_drained(gw.url)
    assert lost_records(gw, outcomes) == []
    assert httpx.get(gw.url + "/readyz", timeout=5).status_code == 200


def test_spool_survives_a_gateway_restart(start_gateway, vllm_worker, own_redis, tmp_path):
    """Records spooled by a gateway that is then killed -9 are drained by the next one."""
    env = {"DETGATE_STATE_DIR": str(tmp_path / "state")}
    gw = start_gateway([vllm_worker.url], redis=own_redis.url, env=env)
    own_redis.kill()
    outcomes = [send(gw.url, {**body("Qwen/Qwen3-8B", i, stream=i % 2 == 0)})
                for i in range(6)]
    assert all(o["ok"] for o in outcomes)
    gw.proc.kill()
    own_redis.start()
    gw2 = start_gateway([vllm_worker.url], redis=own_redis.url, env=env, prefix=gw.prefix)
    wait_drained(gw2.url)
    assert lost_records(gw2, outcomes) == []


def test_hung_worker_requests_are_retried_within_the_health_timeout(start_gateway,
                                                                   start_worker):
    a, b = start_worker(), start_worker()
    model = model_of(a.url)
    gw = start_gateway([a.url, b.url], env={"DETGATE_HEALTH_TIMEOUT_S": "1",
                                            "DETGATE_FIRST_BYTE_TIMEOUT_S": "20"})
    gw.wait_up([a.url, b.url])  # a must be up (routed to) before it hangs
    os.kill(a.popen.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with ThreadPoolExecutor(6) as pool:
            outcomes = list(pool.map(lambda i: send(gw.url, body(model, i, i % 2 == 0)),
                                     range(6)))
        elapsed = time.monotonic() - t0
    finally:
        os.kill(a.popen.pid, signal.SIGCONT)
    assert all(o["ok"] for o in outcomes), outcomes
    assert elapsed < 60  # the attempt timeout is 120 s: nobody waited it out
    assert f"worker {a.url} ejected" in gw.proc.log()
    client = redis.Redis.from_url(gw.redis_url)
    try:
        for o in outcomes:
            record = orjson.loads(client.get(Keys(gw.prefix).record("default", o["id"])))
            assert record["status"] == "complete" and record["worker"] == b.url
    finally:
        client.close()


def _sigterm(gw) -> None:
    os.killpg(gw.proc.popen.pid, signal.SIGTERM)


def _record(gw, rid: str) -> dict:
    client = redis.Redis.from_url(gw.redis_url)
    try:
        raw = client.get(Keys(gw.prefix).record("default", rid))
        return orjson.loads(raw) if raw is not None else {}
    finally:
        client.close()


def test_sigterm_drains_requests_within_the_grace(start_gateway, vllm_worker):
    vllm_worker.delay_s = 1.0
    gw = start_gateway([vllm_worker.url], env={"DETGATE_SHUTDOWN_GRACE_S": "10"})
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(send, gw.url, body("Qwen/Qwen3-8B", i, i % 2 == 0))
                   for i in range(4)]
        time.sleep(0.4)
        _sigterm(gw)
        outcomes = [f.result() for f in futures]
    # uvicorn ends a graceful shutdown by raising the signal it caught once more.
    assert gw.proc.popen.wait(30) in (0, -signal.SIGTERM)
    assert all(o["ok"] for o in outcomes), outcomes
    assert all(_record(gw, o["id"])["status"] == "complete" for o in outcomes)


def test_a_background_loop_stops_even_if_a_library_swallows_its_cancellation():
    """The gateway's background loops (health, Redis, DNS) check `stopping()` each turn: a
    cancellation caught inside a client library on the way (the task's count stays up) still
    ends the loop. Before, a Redis health loop kept running past the shutdown and the gateway
    did not exit (1 SIGTERM in 8)."""

    async def scenario() -> int:
        turns = 0

        async def swallowing_call() -> None:  # a library that catches the cancellation
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(10)

        async def loop() -> None:
            nonlocal turns
            while not stopping():
                turns += 1
                await swallowing_call()

        task = asyncio.create_task(loop())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.wait_for(task, 2)
        return turns

    assert asyncio.run(scenario()) == 1


def test_sigterm_past_the_grace_aborts_in_the_error_shape(start_gateway, vllm_worker):
    vllm_worker.stream_gap_s = 1.0  # a stream of 6 events takes 6 s
    gw = start_gateway([vllm_worker.url], env={"DETGATE_SHUTDOWN_GRACE_S": "1.5"})
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(send, gw.url, body("Qwen/Qwen3-8B", i, True)) for i in range(2)]
        time.sleep(0.3)
        vllm_worker.delay_s = 20  # non-streamed requests now outlast the grace
        wholes = [pool.submit(send, gw.url, body("Qwen/Qwen3-8B", i, False)) for i in range(2)]
        time.sleep(0.5)
        t0 = time.monotonic()
        _sigterm(gw)
        outcomes = [f.result() for f in streams + wholes]
        assert gw.proc.popen.wait(30) in (0, -signal.SIGTERM)
        assert time.monotonic() - t0 < 15  # well within the 20 s the requests would take
    vllm_worker.delay_s = 0
    for o in outcomes:
        assert not o["ok"], o
        if o.get("stream"):
            assert o["status"] == 200 and o["errors"][-1]["code"] == "shutting_down"
            assert b"[DONE]" not in o["raw"]
        else:
            assert o["status"] == 503 and o["json"]["error"]["code"] == "shutting_down"
        assert _record(gw, o["id"])["status"] == "aborted"


def test_client_gone_before_the_first_event_frees_the_worker_and_is_recorded(start_gateway,
                                                                              vllm_worker):
    """The client hangs up while the gateway waits for the worker's first event: the stream
    the gateway then relays has nobody to read it. Its worker must be let go and the request
    recorded (whole, or aborted where the gateway noticed the hang-up first)."""
    vllm_worker.delay_s = 1.0  # the first event comes after the client has left
    gw = start_gateway([vllm_worker.url])
    payload = orjson.dumps(body("Qwen/Qwen3-8B", 0, True))
    host, port = gw.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        time.sleep(0.3)
    time.sleep(2.0)  # the worker answered; the gateway has settled the request
    inflight = [line for line in httpx.get(gw.url + "/metrics").text.splitlines()
                if line.startswith("detgate_worker_inflight{")]
    assert inflight and all(line.endswith(" 0.0") for line in inflight), inflight
    records = [k for k in gw.redis_keys() if b":rec:" in k]
    assert len(records) == 1, records
    client = redis.Redis.from_url(gw.redis_url)
    try:
        rec = orjson.loads(client.get(records[0]))
    finally:
        client.close()
    assert rec["status"] in ("complete", "aborted"), rec
