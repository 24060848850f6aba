"""Per-tenant limits (DETGATE_TENANT_LIMITS): a tenant over its requests/s, tokens/s or storage
budget gets 429 with Retry-After and a code naming the limit while another tenant is served;
the storage budget lives in Redis (shared by gateways, kept over restarts, freed exactly as
records expire); refused and oversize requests are stored as bounded summaries; metrics
label tenants by configured names only."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import orjson
import redis

from detgate.gateway.keys import Keys
from detgate.gateway.recorder import Recorder
from detgate.gateway.store import RedisTarget, Store
from tests.gateway.test_gateway_recorder import make_record

KEYS = ("alice:sk-alice-0123456789,bob:sk-bob-9876543210,carol:sk-carol-1111111111,"
        "dave:sk-dave-2222222222,erin:sk-erin-3333333333")
MODEL = "Qwen/Qwen3-8B"
LIMITS = {
    "alice": {"requests_per_s": 2, "name": "team-a"},
    "carol": {"tokens_per_s": 10},
    "dave": {"storage_bytes": 1, "name": "team-d"},
    "erin": {"max_record_bytes": 4096},
}


def _chat(client, content: str = "hi", stream: bool = False):
    return client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4,
        "temperature": 0, "stream": stream})


def _gateway(start_gateway, worker, prefix=None):
    return start_gateway([worker.url], api_keys=KEYS, prefix=prefix,
                         env={"DETGATE_TENANT_LIMITS": json.dumps(LIMITS)})


def _assert_429(resp, code: str) -> None:
    assert resp.status_code == 429, resp.text
    assert resp.json()["error"]["code"] == code
    assert int(resp.headers["Retry-After"]) >= 1


def test_request_and_token_rates_refuse_one_tenant_only(start_gateway, vllm_worker):
    gw = _gateway(start_gateway, vllm_worker)
    alice, bob, carol = (gw.http(k) for k in ("sk-alice-0123456789", "sk-bob-9876543210",
                                               "sk-carol-1111111111"))
    forwarded = len(vllm_worker.forwarded())
    alice_codes = [_chat(alice) for _ in range(6)]
    bob_codes = [_chat(bob).status_code for _ in range(6)]
    assert [r.status_code for r in alice_codes[:2]] == [200, 200]
    refused = [r for r in alice_codes if r.status_code != 200]
    assert len(refused) >= 3
    for resp in refused:
        _assert_429(resp, "requests_per_s_exceeded")
    assert bob_codes == [200] * 6
    assert len(vllm_worker.forwarded()) - forwarded == 6 + 6 - len(refused)

    # A refusal is recorded as a bounded summary, under its id.
    rid = refused[0].headers["X-Detgate-Record-Id"]
    record = alice.get(f"/v1/requests/{rid}").json()
    assert record["status"] == "failed" and record["summary"]["reason"] == "refused"
    assert "requests/s" in record["error"]

    # Tokens are charged after the answer (19 for the fixture's chat answer): the next request
    # of a 10 tokens/s tenant waits until the debt is paid.
    assert _chat(carol).status_code == 200
    _assert_429(_chat(carol), "tokens_per_s_exceeded")
    assert _chat(bob).status_code == 200
    time.sleep(2.1)
    assert _chat(carol).status_code == 200

    # Metrics name configured tenants only; the rest are "other", never a tenant id or key.
    assert gw.metric("detgate_tenant_requests_total", tenant="team-a",
                     result="requests_per_s_exceeded") == len(refused)
    assert gw.metric("detgate_tenant_requests_total", tenant="team-a", result="admitted") == 2
    assert gw.metric("detgate_tenant_requests_total", tenant="other",
                     result="tokens_per_s_exceeded") == 1
    assert gw.metric("detgate_tenant_tokens_total", tenant="other") == 19 * 9
    text = bob.get("/metrics").text
    for tenant in ("alice", "bob", "carol", "dave", "erin", "sk-"):
        assert f'"{tenant}' not in text


def test_scores_are_held_to_the_rates_but_not_to_the_storage_budget(start_gateway,
                                                                    vllm_worker):
    gw = _gateway(start_gateway, vllm_worker)
    body = {"model": MODEL, "token_ids": [1, 2, 3]}
    alice, dave = gw.http("sk-alice-0123456789"), gw.http("sk-dave-2222222222")
    # The fixture worker is vLLM's, which is never asked to score: admitted scores get 409.
    codes = [alice.post("/v1/score", json=body) for _ in range(4)]
    assert [r.status_code for r in codes[:2]] == [409, 409]
    _assert_429(codes[-1], "requests_per_s_exceeded")
    assert _chat(dave).status_code == 200  # dave's budget is used up by this record
    _assert_429(_chat(dave), "storage_budget_exceeded")
    assert dave.post("/v1/score", json=body).status_code != 429


def test_storage_budget_is_shared_kept_over_restarts(start_gateway, vllm_worker):
    first = _gateway(start_gateway, vllm_worker)
    dave = first.http("sk-dave-2222222222")
    assert _chat(dave).status_code == 200  # under budget until its first record is stored
    _assert_429(_chat(dave), "storage_budget_exceeded")
    assert _chat(first.http("sk-bob-9876543210")).status_code == 200
    assert first.metric("detgate_tenant_stored_bytes", tenant="team-d") > 1

    # A second gateway on the same Redis sees the same budget, and so does one started after
    # both stopped.
    second = _gateway(start_gateway, vllm_worker, prefix=first.prefix)
    _assert_429(_chat(second.http("sk-dave-2222222222")), "storage_budget_exceeded")
    first.proc.stop()
    second.proc.stop()
    third = _gateway(start_gateway, vllm_worker, prefix=first.prefix)
    resp = _chat(third.http("sk-dave-2222222222"), stream=True)
    _assert_429(resp, "storage_budget_exceeded")
    assert _chat(third.http("sk-bob-9876543210"), stream=True).status_code == 200
    assert third.metric("detgate_tenant_requests_total", tenant="team-d",
                        result="storage_budget_exceeded") == 1


def test_oversize_record_is_stored_as_a_bounded_summary(start_gateway, vllm_worker):
    gw = _gateway(start_gateway, vllm_worker)
    erin, bob = gw.http("sk-erin-3333333333"), gw.http("sk-bob-9876543210")
    prompt = "x" * 20000
    answer = _chat(erin, prompt)
    assert answer.status_code == 200  # served: the limit bounds what is stored
    record = erin.get(f"/v1/requests/{answer.json()['id']}").json()
    assert record["summary"] == {"reason": "record_too_large",
                                 "record_bytes": record["summary"]["record_bytes"],
                                 "max_record_bytes": 4096}
    assert record["summary"]["record_bytes"] > 20000
    assert len(orjson.dumps(record)) <= 4096
    assert record["request"]["messages"]["omitted_bytes"] > 20000
    assert record["status"] == "complete" and record["usage"]["total_tokens"] == 19
    replay = erin.post(f"/replay/{answer.json()['id']}")
    assert replay.status_code == 409 and replay.json()["error"]["code"] == "record_summarised"
    # Another tenant's record of the same size, under the default maximum, is kept whole.
    whole = bob.get(f"/v1/requests/{_chat(bob, prompt).json()['id']}").json()
    assert "summary" not in whole
    assert whole["request"]["messages"][0]["content"] == prompt
    assert gw.metric("detgate_records_summarised_total", reason="record_too_large") == 1


async def test_storage_accounting_frees_exactly_as_records_expire(redis_url):
    ttl_s = 1
    rec = Recorder(Store(RedisTarget.parse(redis_url), timeout_s=1.0),
                   prefix=f"detgate-test-acct-{time.time_ns()}", ttl_s=ttl_s, retry_after_s=1)
    try:
        records = [make_record(f"cmpl-{i}", [-0.5] * (i + 1)) for i in range(3)]
        sizes = []
        for record in records:
            stored = await rec.save("t", record)
            sizes.append(len(orjson.dumps(record)))
            assert stored.total == sum(sizes)
            assert 1 <= stored.frees_in_s <= ttl_s
        again = await rec.save("t", records[0])  # a retried write (a drained spool) counts once
        assert again.total == sum(sizes)
        other = make_record("cmpl-9", [-0.5])
        assert (await rec.save("u", other)).total == len(orjson.dumps(other))
        assert (await rec.stored("t")).total == sum(sizes)
        time.sleep(ttl_s + 0.2)
        assert (await rec.stored("t")).total == 0
        assert (await rec.stored("u")).total == 0
        fresh = make_record("cmpl-3", [-0.5])
        assert (await rec.save("t", fresh)).total == len(orjson.dumps(fresh))
        for key in (rec.keys.stored("t"), rec.keys.expiries("t")):
            assert 0 < await rec.store.client.ttl(key) <= ttl_s
    finally:
        keys = [k async for k in rec.store.client.scan_iter(match=f"{rec.keys.prefix}:*")]
        if keys:
            await rec.store.client.delete(*keys)
        await rec.close()


def _tenant_records(gw, tenant: str) -> list[dict]:
    client = redis.Redis.from_url(gw.redis_url)
    try:
        prefix = Keys(gw.prefix).record(tenant, "").encode()
        keys = [k for k in gw.redis_keys() if k.startswith(prefix)]
        return [orjson.loads(v) for v in client.mget(keys) if v is not None] if keys else []
    finally:
        client.close()


def _stored_total(gw, tenant: str) -> int:
    client = redis.Redis.from_url(gw.redis_url)
    try:
        return int(client.get(Keys(gw.prefix).stored(tenant)) or 0)
    finally:
        client.close()


def test_a_refusal_flood_stays_within_the_storage_budget(start_gateway, vllm_worker):
    """1 request/s and 5,000 bytes: 300 requests in a burst, nearly all 429. Refusals are
    stored (as summaries) only while they fit the budget, so the tenant's stored bytes stay
    within it (a tenant of 20,000 bytes stored 112x that); the rest are counted, not stored.
    A tenant without a budget keeps only its newest `DETGATE_REFUSAL_RING` (10) refusals."""
    limits = {"alice": {"requests_per_s": 1, "storage_bytes": 5000, "name": "team-a"},
              "bob": {"requests_per_s": 1}}
    gw = start_gateway([vllm_worker.url], api_keys=KEYS,
                       env={"DETGATE_TENANT_LIMITS": json.dumps(limits),
                            "DETGATE_REFUSAL_RING": "10"})
    alice, bob = gw.http("sk-alice-0123456789"), gw.http("sk-bob-9876543210")
    codes = [_chat(alice).status_code for _ in range(300)]
    refused = codes.count(429)
    assert refused >= 290
    answers = [r for r in _tenant_records(gw, "alice") if "summary" not in r]
    largest = max(len(orjson.dumps(r)) for r in answers)
    total = _stored_total(gw, "alice")
    print(f"refusal flood: {refused} refused, {total} bytes stored of a 5000 budget")
    # Refusals never take it over; only admitted answers may (one per request in flight).
    assert total <= 5000 + largest
    kept = [r for r in _tenant_records(gw, "alice") if r.get("summary", {}).get("reason")
            == "refused"]
    assert 0 < len(kept) <= 10 and all(len(orjson.dumps(r)) <= 4096 for r in kept)
    assert gw.metric("detgate_records_total", result="skipped") >= refused - 10
    assert sum(gw.metric("detgate_tenant_requests_total", tenant="team-a", result=code)
               for code in ("requests_per_s_exceeded", "storage_budget_exceeded")) == refused

    # No budget: the ring alone bounds what refusals store.
    bob_codes = [_chat(bob).status_code for _ in range(50)]
    bob_refusals = [r for r in _tenant_records(gw, "bob")
                    if r.get("summary", {}).get("reason") == "refused"]
    assert bob_codes.count(429) >= 40 and len(bob_refusals) == 10
    assert _stored_total(gw, "bob") == sum(len(orjson.dumps(r))
                                           for r in _tenant_records(gw, "bob"))
    # The newest refusals are the ones kept, and each is readable under its id.
    newest = bob.get("/v1/requests?limit=1").json()["data"][0]
    assert newest["summary"]["reason"] == "refused"


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def test_replays_are_admitted_and_charged_like_requests(start_gateway, start_worker):
    """A tenant of 2 requests/s and 50 tokens/s, its replay load capped at 8, fires 10
    replays at load 8 at once: at most 2 run (429 for the rest, naming the limit), their
    tokens (load included) are charged, so the next replay waits for the debt; load 9 is
    refused. Another tenant's short requests meanwhile stay fast. Before, replays escaped
    every limit: 10 at load 64 ran ~116,500 tokens for a 500 tokens/s tenant, and another
    tenant's 8-token request went from 0.20 s to 23.2 s."""
    workers = [start_worker(), start_worker()]
    limits = {"alice": {"requests_per_s": 2, "tokens_per_s": 50, "max_replay_load": 8,
                        "name": "team-a"}}
    gw = start_gateway([w.url for w in workers], api_keys=KEYS,
                       env={"DETGATE_TENANT_LIMITS": json.dumps(limits)})
    alice, bob = gw.http("sk-alice-0123456789"), gw.http("sk-bob-9876543210")
    model = alice.get("/v1/models").json()["data"][0]["id"]

    def short(client) -> float:
        t0 = time.monotonic()
        r = client.post("/v1/completions", json={"model": model, "prompt": "Hi",
                                                 "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        return time.monotonic() - t0

    rid = alice.post("/v1/completions", json={"model": model, "prompt": "Long story:",
                                              "max_tokens": 32, "temperature": 0}).json()["id"]
    baseline = [short(bob) for _ in range(5)]
    time.sleep(1.1)  # alice's buckets refill
    over = alice.post(f"/replay/{rid}", json={"load": 9})
    assert over.status_code == 400 and over.json()["error"]["param"] == "load"
    time.sleep(1.1)
    during: list[float] = []
    with ThreadPoolExecutor(11) as pool:
        replays = [pool.submit(lambda: gw.http("sk-alice-0123456789").post(
            f"/replay/{rid}", json={"load": 8})) for _ in range(10)]
        while not all(f.done() for f in replays):
            during.append(short(bob))
        results = [f.result() for f in replays]
    print(f"bob's 8-token requests: median {_median(baseline):.3f} s alone, "
          f"{_median(during):.3f} s during alice's replays (max {max(during):.3f} s)")
    ran = [r for r in results if r.status_code == 200]
    refused = [r for r in results if r.status_code == 429]
    assert 1 <= len(ran) <= 2 and len(ran) + len(refused) == 10, [r.text for r in results]
    for r in refused:
        assert r.json()["error"]["code"] in ("requests_per_s_exceeded", "tokens_per_s_exceeded")
        assert int(r.headers["Retry-After"]) >= 1
    assert all(r.json()["match"] for r in ran)
    charged = gw.metric("detgate_tenant_tokens_total", tenant="team-a")
    original = alice.get(f"/v1/requests/{rid}").json()["usage"]["total_tokens"]
    # Each replay's own tokens and at least one per load request: the load is charged.
    assert charged >= original * (1 + len(ran)) + 8 * len(ran)
    time.sleep(1.1)  # requests/s refilled; tokens still in debt (seconds of it at 50/s)
    again = alice.post(f"/replay/{rid}", json={"load": 8})
    _assert_429(again, "tokens_per_s_exceeded")
    # The comparisons are stored, and counted in alice's stored bytes.
    assert len(alice.get(f"/v1/requests/{rid}").json()["replays"]) == len(ran)
    assert _stored_total(gw, "alice") > sum(len(r.content) for r in ran)
    # Stated bound: within 4x plus half a second of its latency alone (2-core CI machine).
    assert _median(during) <= 4 * _median(baseline) + 0.5
