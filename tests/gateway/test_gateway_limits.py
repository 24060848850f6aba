"""Per-tenant limits (DETGATE_TENANT_LIMITS): a tenant over its requests/s, tokens/s or storage
budget gets 429 with Retry-After and a code naming the limit while another tenant is served;
the storage budget lives in Redis (shared by gateways, kept over restarts, freed exactly as
records expire); refused and oversize requests are stored as bounded summaries; metrics
label tenants by configured names only."""

from __future__ import annotations

import json
import time

import orjson

from gateway.recorder import Recorder
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
    rec = Recorder(redis_url, prefix=f"detgate-test-acct-{time.time_ns()}", ttl_s=ttl_s,
                   timeout_s=1.0, retry_after_s=1)
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
            assert 0 < await rec.redis.ttl(key) <= ttl_s
    finally:
        keys = [k async for k in rec.redis.scan_iter(match=f"{rec.keys.prefix}:*")]
        if keys:
            await rec.redis.delete(*keys)
        await rec.close()
