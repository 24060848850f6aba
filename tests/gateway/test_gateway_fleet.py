"""Several gateway replicas on one Redis, as behind a load balancer (real gateway processes on
the test Redis under one key prefix): a tenant's requests/s hold across all of them, and per
process (the negative control) they do not; records, replays and the listing answer the same
whichever replica is asked; a replica killed -9 under load loses nothing it acknowledged."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest
import redis

from detgate.gateway.keys import Keys

KEYS = "alice:sk-alice-0123456789,bob:sk-bob-9876543210"
ALICE, BOB = "sk-alice-0123456789", "sk-bob-9876543210"
MODEL = "Qwen/Qwen3-8B"  # the vLLM fixture worker's
RATE = 10  # alice's requests/s
CLIENTS = 6  # load threads, two per replica


def _replicas(start_gateway, workers: list[str], n: int = 3, **env: str) -> list:
    """`n` gateways sharing one key prefix (one deployment), started together."""
    first = start_gateway(workers, api_keys=KEYS, env=env)
    with ThreadPoolExecutor(n - 1) as pool:
        rest = list(pool.map(lambda _: start_gateway(workers, api_keys=KEYS, env=env,
                                                     prefix=first.prefix), range(n - 1)))
    return [first, *rest]


@pytest.fixture(scope="module")
def tiny_replicas(start_gateway_module, start_workers_module) -> list:
    """3 replicas in front of a tiny worker, for the module; the last test kills one."""
    workers = start_workers_module(["batch_invariant"])
    return _replicas(start_gateway_module, [w.url for w in workers])


def _load(urls: list[str], key: str, seconds: float) -> tuple[list[int], float]:
    """Chat requests back to back from CLIENTS threads, spread evenly over `urls`, for
    `seconds`: every status, and the time from the first request to the last."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    codes: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(CLIENTS)
    span = [float("inf"), 0.0]

    def client(i: int) -> None:
        with httpx.Client(base_url=urls[i % len(urls)], timeout=30,
                          headers={"Authorization": f"Bearer {key}"}) as http:
            start.wait()
            stop = time.monotonic() + seconds
            while (now := time.monotonic()) < stop:
                status = http.post("/v1/chat/completions", json=body).status_code
                with lock:
                    codes.append(status)
                    span[0], span[1] = min(span[0], now), max(span[1], now)

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(client, range(CLIENTS)))
    return codes, span[1] - span[0]


def _admitted_rate(start_gateway, vllm_worker, mode: str) -> tuple[int, float, int]:
    limits = json.dumps({"alice": {"requests_per_s": RATE}})
    gateways = _replicas(start_gateway, [vllm_worker.url], DETGATE_TENANT_LIMITS=limits,
                         DETGATE_RATE_LIMITS=mode)
    codes, span = _load([gw.url for gw in gateways], ALICE, 3.0)
    assert set(codes) <= {200, 429}, set(codes)
    return codes.count(200), span, len(codes)


def test_a_tenant_gets_its_rate_across_three_replicas(start_gateway, vllm_worker):
    """A tenant of 10 requests/s, loaded for 3 s through 3 replicas: it gets one second's
    burst plus 10 a second, not three times that."""
    admitted, span, sent = _admitted_rate(start_gateway, vllm_worker, "redis")
    expected = RATE + RATE * span  # the full bucket, then its refill
    rate = (admitted - RATE) / span
    print(f"shared: {admitted} of {sent} admitted in {span:.2f} s (expected {expected:.1f}); "
          f"{rate:.2f} requests/s after the burst")
    assert abs(admitted - expected) <= 0.1 * expected
    assert abs(rate - RATE) <= 0.1 * RATE


def test_per_process_rates_give_n_times_the_rate(start_gateway, vllm_worker):
    """Negative control: the same load with the rates kept in each process gets about three
    times the rate (each replica its own bucket)."""
    admitted, span, sent = _admitted_rate(start_gateway, vllm_worker, "process")
    expected = RATE + RATE * span
    print(f"per process: {admitted} of {sent} admitted in {span:.2f} s "
          f"({admitted / expected:.2f}x the shared figure {expected:.1f})")
    assert admitted >= 2.5 * expected


def _completion(http: httpx.Client, model: str, i: int) -> dict:
    body = {"model": model, "prompt": f"replica test {i}", "max_tokens": 8,
            "temperature": 0.0 if i % 2 else 0.8, "logprobs": 1}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_records_replays_and_listing_answer_the_same_on_every_replica(tiny_replicas):
    gateways = tiny_replicas
    clients = [gw.http(ALICE) for gw in gateways]
    model = clients[0].get("/v1/models").json()["data"][0]["id"]
    ids = [_completion(clients[i % 3], model, i)["id"] for i in range(6)]
    # A replay asked of another replica than the one that recorded, and seen from a third.
    for i, rid in enumerate(ids[:3]):
        replay = clients[(i + 1) % 3].post(f"/replay/{rid}", json={"load": 2})
        assert replay.status_code == 200 and replay.json()["match"] is True, replay.text
    listings, records = [], []
    for http in clients:
        page = http.get("/v1/requests?limit=4").json()
        rest = http.get(f"/v1/requests?limit=4&after={page['data'][-1]['id']}").json()
        listings.append([r["id"] for r in page["data"] + rest["data"]])
        records.append([http.get(f"/v1/requests/{rid}").json() for rid in ids])
        # Another tenant sees none of it, on every replica.
        bob = gateways[clients.index(http)].http(BOB)
        assert bob.get(f"/v1/requests/{ids[0]}").status_code == 404
        assert bob.get("/v1/requests").json()["data"] == []
    assert listings[0] == list(reversed(ids))
    assert listings[1] == listings[0] and listings[2] == listings[0]
    assert records[1] == records[0] and records[2] == records[0]
    assert [len(r["replays"]) for r in records[0]] == [1, 1, 1, 0, 0, 0]
    assert all(r["replays"][0]["match"] for r in records[0][:3])
    for http in clients:
        http.close()


def test_a_replica_killed_under_load_loses_nothing_it_acknowledged(tiny_replicas):
    gateways = tiny_replicas
    with gateways[0].http(ALICE) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    answered = threading.Semaphore(0)

    def one(i: int) -> tuple[int, str | None]:
        try:
            r = httpx.post(gateways[i % 3].url + "/v1/chat/completions", timeout=30, json=body,
                           headers={"Authorization": f"Bearer {ALICE}"})
        except httpx.HTTPError:
            return 0, None  # the killed replica's connection
        finally:
            answered.release()
        return r.status_code, r.headers.get("X-Detgate-Record-Id")

    with ThreadPoolExecutor(CLIENTS) as pool:
        futures = [pool.submit(one, i) for i in range(90)]
        for _ in range(30):
            answered.acquire()
        gateways[0].proc.kill()
        outcomes = [f.result() for f in futures]
    ok = [rid for status, rid in outcomes if status == 200]
    killed = [o for i, o in enumerate(outcomes) if i % 3 == 0 and o[0] != 200]
    assert killed, "the replica was killed before it failed any request"
    keys = Keys(gateways[0].prefix)
    client = redis.Redis.from_url(gateways[0].redis_url)
    try:
        missing = [rid for rid in ok if client.get(keys.record("alice", rid)) is None]
        stored = [orjson.loads(client.get(keys.record("alice", rid))) for rid in ok[:5]]
    finally:
        client.close()
    print(f"replica killed: {len(ok)} acknowledged, {len(killed)} failed with it, "
          f"{len(missing)} acknowledged records missing")
    assert missing == []
    assert all(r["status"] == "complete" for r in stored)
    # The survivors list every acknowledged record.
    with gateways[1].http(ALICE) as http:
        listed = {r["id"] for r in http.get("/v1/requests?limit=1000").json()["data"]}
    assert set(ok) <= listed
