"""Backpressure and cancellation: the gateway sends a worker no more sequences than its
advertised max_num_seqs, queues a bounded number more, refuses the rest at once (503
`overloaded` with Retry-After), and a client that leaves stops its work on the worker, a
non-streamed request's included (recorded `aborted` with the tokens so far).

Failures these catch: 512 requests at once were all admitted, piled up inside two workers,
kept generating for 120 s after their clients had given up, and then both workers were
ejected; a non-streamed request whose client hung up generated every token and was
recorded `complete`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import httpx
import orjson
import pytest
import redis

from detgate.gateway.admission import Admission, Fits
from tests.gateway.test_gateway_faults import model_of
from tests.support.worker_metrics import assert_all_work_stopped, idle, wait_until, worker_gauge


def records(gw) -> list[dict]:
    client = redis.Redis.from_url(gw.redis_url)
    try:
        return [orjson.loads(client.get(k)) for k in gw.redis_keys() if b":rec:" in k
                and client.get(k) is not None]
    finally:
        client.close()


# Greedy from this prompt, the tiny model runs to max_tokens (no end-of-text on the way).
LONG = "Long story:"
ABORTED = 'detgate_worker_requests_total{finish_reason="abort"}'


def unhandled(gw) -> list[str]:
    """The gateway's own 5xx (503 `overloaded` is a refusal, not a fault) and logged errors."""
    codes = [f"{code} on {endpoint}" for endpoint in ("/v1/completions", "/v1/chat/completions")
             for code in ("500", "502", "504")
             if gw.metric("detgate_requests_total", code=code, endpoint=endpoint)]
    return codes + [line for line in gw.proc.log().splitlines() if "unhandled error" in line]


@dataclass(eq=False)
class _Slots:
    """A worker as admission sees it: sequences held against a capacity."""

    capacity: int
    seqs: int = 0

    def need(self, weight: int) -> int:
        return min(weight, self.capacity)


def test_waiters_cancelled_in_one_turn_hand_no_slot_to_each_other():
    """A load tool cancelling everything it sent: a waiter just handed a slot and the waiters
    behind it are cancelled in the same loop turn. The first gives its slot back as it
    leaves; the hand-off must skip the others (their futures already cancelled, their tasks
    not yet run) instead of failing on them. Before: InvalidStateError, a 500 per request."""

    async def scenario() -> tuple[list, int]:
        admission = Admission(queue_factor=4, timeout_s=30, retry_after_s=1)
        worker = _Slots(capacity=1, seqs=1)  # full: everyone waits

        def acquire(w: _Slots, weight: int) -> None:
            w.seqs += w.need(weight)

        async def take() -> _Slots:
            waiter = Fits(lambda w: True, 1)
            try:
                return await admission.wait(waiter, 8, time.monotonic() + 30)
            except BaseException:
                if waiter.handed is not None:  # as the router does: give the slot back
                    waiter.handed.seqs -= 1
                    admission.hand_off(waiter.handed, acquire)
                raise

        tasks = [asyncio.create_task(take()) for _ in range(4)]
        await asyncio.sleep(0)
        worker.seqs = 0
        admission.hand_off(worker, acquire)  # the first waiter is handed the slot ...
        for t in tasks:  # ... and every client leaves before any of them runs again
            t.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        return [type(o).__name__ for o in outcomes], worker.seqs, admission.depth

    outcomes, held, depth = asyncio.run(scenario())
    assert outcomes == ["CancelledError"] * 4
    assert (held, depth) == (0, 0)


@pytest.fixture(scope="module")
def small_workers(start_workers_module):
    """Two workers that run 8 sequences at once each (idle again after every test)."""
    return start_workers_module(["batch_invariant"] * 2, ("--max-num-seqs", "8"))


async def _burst_then_cancel(url: str, model: str, n: int, cancel_after_s: float) -> dict:
    """`n` long requests at once (half streamed); after `cancel_after_s` every client still
    waiting gives up. The statuses seen, with the overload refusals' Retry-After."""
    out = {"refused": 0, "retry_after": set(), "cancelled": 0, "other": []}
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        async def one(i: int) -> None:
            body = {"model": model, "prompt": LONG, "max_tokens": 1500, "temperature": 0,
                    "stream": i % 2 == 0}
            try:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code == 503:
                        out["refused"] += 1
                        out["retry_after"].add(r.headers.get("retry-after"))
                        return
                    async for _ in r.aiter_bytes():
                        pass
                    out["other"].append(r.status_code)
            except asyncio.CancelledError:
                out["cancelled"] += 1
                raise

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        await asyncio.sleep(cancel_after_s)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return out


def test_burst_of_512_is_bounded_and_its_cancellation_stops_all_work(start_gateway,
                                                                     small_workers):
    workers = small_workers
    model = model_of(workers[0].url)
    gw = start_gateway([w.url for w in workers], env={"DETGATE_QUEUE_FACTOR": "1"})
    gw.wait_up([w.url for w in workers])
    assert [gw.metric("detgate_worker_capacity", worker=w.url) for w in workers] == [8, 8]
    out = asyncio.run(_burst_then_cancel(gw.url, model, 512, cancel_after_s=6))
    # 16 running, 16 queued: the other 480 are refused at once, with a Retry-After.
    print(f"512 at once: {out['refused']} refused (503), {out['cancelled']} cancelled by "
          f"their clients, others {out['other']}")
    assert out["refused"] == 512 - 32, out
    assert out["retry_after"] and all(int(v) >= 1 for v in out["retry_after"])
    assert out["cancelled"] == 32 and out["other"] == []
    # Every cancelled request stops: the workers go idle, nothing waits in the gateway.
    stopped_s = assert_all_work_stopped(gw, [w.url for w in workers])
    print(f"workers idle {stopped_s:.1f} s after the cancellation")
    assert unhandled(gw) == []
    # What reached a worker is recorded `aborted`: the 16 running, and any queued one that
    # got a freed slot before its own client's hang-up was seen; the others never ran.
    wait_until(lambda: len(records(gw)) >= 16)
    recs = records(gw)
    assert 16 <= len(recs) <= 32 and {r["status"] for r in recs} == {"aborted"}, \
        sorted(r["status"] for r in recs)
    # ... the non-streamed ones too, with the tokens generated until then (none, and no
    # choice at all, for one that got a freed slot just before its client's hang-up was seen).
    whole = [sum(len(c["token_ids"]) for c in r["choices"])
             for r in recs if not r["request"].get("stream")]
    assert whole and max(whole) > 0 and all(n < 1500 for n in whole), whole


def test_queue_depth_is_on_metrics_and_a_full_queue_answers_at_once(start_gateway,
                                                                    small_workers):
    workers = small_workers
    model = model_of(workers[0].url)
    gw = start_gateway([w.url for w in workers], env={"DETGATE_QUEUE_FACTOR": "0.5"})
    gw.wait_up([w.url for w in workers])

    async def run() -> tuple[list[float], float, list[int]]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=120) as http:
            long = [asyncio.create_task(http.post("/v1/completions", json={
                "model": model, "prompt": LONG, "max_tokens": 600, "temperature": 0}))
                for i in range(16 + 8)]
            await asyncio.sleep(1.0)
            depth = gw.metric("detgate_queue_depth")
            t0 = time.monotonic()
            extra = await http.post("/v1/completions", json={
                "model": model, "prompt": "one more", "max_tokens": 4})
            waited = time.monotonic() - t0
            codes = [(await t).status_code for t in long]
            return [depth], waited, [extra.status_code, *codes]

    depths, waited, codes = asyncio.run(run())
    assert depths == [8]
    assert codes[0] == 503  # refused at once, not after the long ones
    assert waited < 5
    assert codes[1:] == [200] * 24  # the queued ones ran when slots freed


def test_client_leaving_a_whole_request_aborts_it_with_the_tokens_so_far(start_gateway,
                                                                         small_workers):
    worker = small_workers[0]
    model = model_of(worker.url)
    gw = start_gateway([worker.url])
    aborted_before = worker_gauge(worker.url, ABORTED)
    with httpx.Client(base_url=gw.url, timeout=1.5) as http, \
            pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"model": model, "prompt": LONG, "max_tokens": 1500,
                                           "temperature": 0})
    wait_until(lambda: len(records(gw)) == 1)
    (rec,) = records(gw)
    assert rec["status"] == "aborted"
    assert 0 < len(rec["choices"][0]["token_ids"]) < 1500
    assert rec["choices"][0]["finish_reason"] == "abort"
    assert rec["usage"]["completion_tokens"] == len(rec["choices"][0]["token_ids"])
    wait_until(lambda: idle(worker.url))
    assert worker_gauge(worker.url, ABORTED) == aborted_before + 1
