"""vLLM as a worker: its documented response shapes (fixtures/), through a real gateway.

vLLM sends no system_fingerprint, so the gateway derives one from /v1/models, /version and
the operator's labels; token ids come from `return_token_ids`; errors carry an integer code.
"""

from __future__ import annotations

import re
import time

import openai
import orjson
import pytest

from detgate.gateway.config import Settings
from detgate.gateway.metrics import ENDPOINTS
from detgate.gateway.router import derived_fingerprint
from tests.gateway.vllm_worker import VllmFixtureWorker, fixture, sse_payloads
from tests.support.floats import bits

MODEL = "Qwen/Qwen3-8B"
LABELS = "VLLM_BATCH_INVARIANT=1,attention=FLASH_ATTN,gpu=H200"
MSG = [{"role": "user", "content": "hi"}]


def expected_fingerprint(labels: str = LABELS) -> str:
    cards = orjson.loads(fixture("vllm_models.json"))["data"]
    return derived_fingerprint(cards, "0.11.0", labels)


@pytest.fixture(scope="module")
def setup(request):
    worker = request.getfixturevalue("vllm_worker_module")
    start = request.getfixturevalue("start_gateway_module")
    labels = orjson.dumps({worker.url: LABELS, "*": "unused"}).decode()
    gw = start([worker.url], env={"DETGATE_WORKER_LABELS": labels})
    return gw, worker


def test_derived_fingerprint_depends_on_what_changes_numbers():
    fp = expected_fingerprint()
    assert fp.startswith("fp_") and fp == expected_fingerprint()
    assert fp != expected_fingerprint("VLLM_BATCH_INVARIANT=0")
    cards = orjson.loads(fixture("vllm_models.json"))["data"]
    assert fp != derived_fingerprint(cards, "0.11.1", LABELS)
    longer = [{**cards[0], "max_model_len": 8192}]
    assert fp != derived_fingerprint(longer, "0.11.0", LABELS)


def test_chat_plain(setup):
    gw, worker = setup
    answer = gw.client().chat.completions.create(model=MODEL, messages=MSG)
    assert answer.system_fingerprint == expected_fingerprint()
    assert answer.choices[0].logprobs is None  # not asked for
    assert answer.choices[0].message.content == "Hello! How can I help?"
    dumped = answer.model_dump()
    assert "token_ids" not in dumped["choices"][0] and "prompt_token_ids" not in dumped
    sent = worker.received[-1][1]
    assert sent["logprobs"] is True and sent["top_logprobs"] == 0
    assert sent["return_token_ids"] is True and isinstance(sent["seed"], int)

    rec = gw.record(answer.id)
    src = orjson.loads(fixture("vllm_chat.json"))
    want_lp = [e["logprob"] for e in src["choices"][0]["logprobs"]["content"]]
    assert rec["choices"][0]["token_ids"] == src["choices"][0]["token_ids"]
    assert bits(rec["choices"][0]["logprobs"]) == bits(want_lp)
    assert rec["prompt_token_ids"] == src["prompt_token_ids"]
    assert rec["system_fingerprint"] == expected_fingerprint()
    assert rec["request"] == sent and rec["status"] == "complete"
    assert rec["usage"]["completion_tokens"] == 7


def test_completion_with_logprobs_token_ids_and_prompt_logprobs(setup):
    gw, _ = setup
    with gw.http() as http:
        r = http.post("/v1/completions", json={
            "model": MODEL, "prompt": "The capital of France is", "logprobs": 1,
            "return_token_ids": True, "prompt_logprobs": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    src = orjson.loads(fixture("vllm_completion_prompt_logprobs.json"))["choices"][0]
    assert body["id"] == r.headers["x-detgate-record-id"]
    assert body["choices"][0]["token_ids"] == src["token_ids"]
    assert body["choices"][0]["prompt_logprobs"] == src["prompt_logprobs"]
    rec = gw.record(body["id"])
    assert rec["prompt_logprobs"] == src["prompt_logprobs"]
    assert "seed" not in rec["request"]  # greedy: nothing to seed
    assert bits(rec["choices"][0]["logprobs"]) == bits(src["logprobs"]["token_logprobs"])


def test_completion_logprobs_zero_gives_no_alternatives(setup):
    gw, worker = setup
    answer = gw.client().completions.create(model=MODEL, prompt="x", logprobs=0)
    assert worker.received[-1][1]["logprobs"] == 1
    assert answer.choices[0].logprobs.token_logprobs[0] == -0.0478133261203766
    assert all(d == {} for d in answer.choices[0].logprobs.top_logprobs)


def test_chat_stream(setup):
    gw, _ = setup
    stream = gw.client().chat.completions.create(model=MODEL, messages=MSG, stream=True)
    chunks = list(stream)
    rid = chunks[0].id
    assert all(c.id == rid for c in chunks)
    assert all(c.system_fingerprint == expected_fingerprint() for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello! How"
    assert all(c.usage is None for c in chunks)  # usage not asked for: dropped
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
    rec = gw.record(rid)
    src = sse_payloads(fixture("vllm_chat_stream.txt"))
    assert rec["status"] == "complete"
    assert rec["choices"][0]["token_ids"] == [9707, 0, 2585]
    want = [e["logprob"] for c in src[1:4] for e in c["choices"][0]["logprobs"]["content"]]
    assert bits(rec["choices"][0]["logprobs"]) == bits(want)
    assert rec["usage"] == src[-1]["usage"]
    assert rec["prompt_token_ids"] == src[0]["prompt_token_ids"]
    assert rec["choices"][0]["finish_reason"] == "length"


def test_completion_stream_with_usage_and_logprobs(setup):
    gw, worker = setup
    stream = gw.client().completions.create(model=MODEL, prompt="x", stream=True, logprobs=1,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert worker.received[-1][1]["stream_options"] == {"include_usage": True}
    assert chunks[-1].usage.completion_tokens == 2
    lps = [lp for c in chunks if c.choices for lp in c.choices[0].logprobs.token_logprobs]
    assert lps == [-0.0478133261203766, -0.5810661911964417]
    rec = gw.record(chunks[0].id)
    assert rec["choices"][0]["token_ids"] == [12095, 13]
    assert rec["choices"][0]["text"] == " Paris."


@pytest.mark.parametrize("variant", ["current", "legacy"])
def test_vllm_error_with_integer_code(setup, variant):
    gw, _ = setup
    prompt = "trigger-error legacy" if variant == "legacy" else "trigger-error"
    with pytest.raises(openai.BadRequestError) as info:
        gw.client().completions.create(model=MODEL, prompt=prompt)
    err = info.value.response.json()["error"]
    name = "vllm_error_legacy.json" if variant == "legacy" else "vllm_error.json"
    src = orjson.loads(fixture(name))
    assert err["message"] == (src.get("error") or src)["message"]
    assert err["code"] is None or isinstance(err["code"], str)
    with gw.http() as http:
        latest = http.get("/v1/requests?limit=1").json()["data"][0]
    assert latest["status"] == "failed" and latest["choices"] == []
    assert info.value.response.headers["x-detgate-record-id"] == latest["id"]


def test_worker_labels_setting_accepts_a_string_or_a_map(monkeypatch):
    monkeypatch.setenv("DETGATE_WORKER_LABELS", LABELS)
    assert Settings().worker_labels == {"*": LABELS}
    monkeypatch.setenv("DETGATE_WORKER_LABELS", '{"http://10.0.0.5:8000": "gpu=H200"}')
    assert Settings().worker_labels == {"http://10.0.0.5:8000": "gpu=H200"}


def test_replay_against_derived_fingerprint(setup):
    gw, _ = setup
    answer = gw.client().chat.completions.create(model=MODEL, messages=MSG, temperature=0)
    with gw.http() as http:
        cmp = http.post(f"/replay/{answer.id}", json={"load": 3}).json()
    assert cmp["match"] is True and cmp["replay_fingerprint"] == expected_fingerprint()


def test_one_retry_on_another_worker_and_never_more(start_gateway, vllm_worker):
    other = VllmFixtureWorker()
    other.start()
    try:
        gw = start_gateway([vllm_worker.url, other.url])
        other.fail_status = 500
        client = gw.client()
        for _ in range(4):  # whichever worker is chosen first, the answer comes
            assert client.chat.completions.create(model=MODEL, messages=MSG).choices
        vllm_worker.fail_status = 503
        deadline = time.monotonic() + 30  # both back in rotation (their /health is fine)
        while not (gw.metric("detgate_worker_up", worker=vllm_worker.url)
                   == gw.metric("detgate_worker_up", worker=other.url) == 1):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        before = len(vllm_worker.forwarded()) + len(other.forwarded())
        with gw.http() as http:
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG})
        assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error"
        assert len(vllm_worker.forwarded()) + len(other.forwarded()) - before == 2
    finally:
        other.stop()


def test_whole_answer_timeout_follows_the_tokens_asked(start_gateway, vllm_worker):
    """A whole answer may take first_byte + token_timeout x max_tokens x n: 0.66 s for 16
    tokens (a 504, a failed record), 3.5 s for 300 (the same 3 s worker answers). A flat
    attempt timeout would cut both or neither; and a timeout never ejects the worker."""
    gw = start_gateway([vllm_worker.url], env={"DETGATE_FIRST_BYTE_TIMEOUT_S": "0.5",
                                               "DETGATE_TOKEN_TIMEOUT_S": "0.01"})
    vllm_worker.delay_s = 3.0
    with gw.http() as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "slow"})
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "upstream_timeout"
        rec = http.get(f"/v1/requests/{r.headers['x-detgate-record-id']}").json()
        assert rec["status"] == "failed" and rec["choices"] == []
        assert len(vllm_worker.forwarded()) == 1  # the only worker: no second attempt
        long = http.post("/v1/completions", json={"model": MODEL, "prompt": "slow",
                                                  "max_tokens": 300})
        assert long.status_code == 200, long.text
    assert gw.metric("detgate_worker_up", worker=vllm_worker.url) == 1
    assert "ejected" not in gw.proc.log()


def test_replay_needs_a_worker_with_the_same_fingerprint(start_gateway, vllm_worker):
    """The same worker under other operator labels counts as another configuration: 409."""
    first = start_gateway([vllm_worker.url], env={"DETGATE_WORKER_LABELS": "gpu=H200"})
    rid = first.client().chat.completions.create(model=MODEL, messages=MSG).id
    first.proc.stop()
    second = start_gateway([vllm_worker.url], env={"DETGATE_WORKER_LABELS": "gpu=A100"},
                           prefix=first.prefix)
    with second.http() as http:
        assert http.get(f"/v1/requests/{rid}").status_code == 200
        r = http.post(f"/replay/{rid}", json={})
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "no_matching_worker"
    assert second.metric("detgate_replays_total", result="error") == 1


def test_worker_dying_mid_stream_is_an_error_event_and_a_failed_record(setup):
    gw, worker = setup
    with gw.http() as http, http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "stream": True,
            "messages": [{"role": "user", "content": "trigger-break"}]}) as r:
        rid = r.headers["x-detgate-record-id"]
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    # Cut after its first bytes: an error event ends it, never `[DONE]` (a client that
    # takes `[DONE]` for success would keep a truncated answer).
    assert "[DONE]" not in events, events
    assert orjson.loads(events[-1])["error"]["type"] == "upstream_error"
    rec = gw.record(rid)
    assert rec["status"] == "failed" and rec["choices"][0]["token_ids"] == [9707]
    # Its health check passes (only the connection was cut): in rotation.
    deadline = time.monotonic() + 30
    while gw.metric("detgate_worker_up", worker=worker.url) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)


CONTRACT_METRICS = {
    "detgate_requests_total": "counter", "detgate_request_duration_seconds": "histogram",
    "detgate_upstream_duration_seconds": "histogram",
    "detgate_gateway_overhead_seconds": "histogram", "detgate_records_total": "counter",
    "detgate_replays_total": "counter", "detgate_replay_logprob_mse": "histogram",
    "detgate_replay_max_abs_logprob_diff": "histogram",
    "detgate_replay_first_divergence_position": "histogram", "detgate_worker_up": "gauge",
    "detgate_worker_inflight": "gauge",
    # Beyond the contract's table: the record spool's depth (records durable on disk while
    # Redis is away).
    "detgate_spool_records": "gauge", "detgate_spool_bytes": "gauge",
    # Per-tenant limits (labelled by configured tenant names only), and records stored as
    # bounded summaries.
    "detgate_tenant_requests_total": "counter", "detgate_tenant_tokens_total": "counter",
    "detgate_tenant_stored_bytes": "gauge", "detgate_records_summarised_total": "counter",
    # Lookups of DNS worker names, and each tenant's last drift report.
    "detgate_dns_lookups_total": "counter", "detgate_drift_records": "gauge",
    "detgate_drift_identical_ratio": "gauge", "detgate_drift_logprob_mse": "gauge",
    "detgate_drift_max_abs_logprob_diff": "gauge",
    "detgate_drift_last_run_timestamp_seconds": "gauge",
    # Admission and connections: worker capacity, the gateway's queue, requests sent again
    # on a fresh connection.
    "detgate_worker_capacity": "gauge", "detgate_queue_depth": "gauge",
    "detgate_upstream_reconnects_total": "counter",
}


def test_metrics_are_exactly_the_contracts(setup):
    gw, worker = setup
    gw.client().completions.create(model=MODEL, prompt="x")
    with gw.http() as http:
        text = http.get("/metrics").text
    types = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name.removesuffix("_total") + ("_total" if kind == "counter" else "")] = kind
    assert types == CONTRACT_METRICS
    assert "detgate_replay_logprob_mse_bucket{le=\"1e-12\"}" in text
    assert "detgate_replay_first_divergence_position_bucket{le=\"4096.0\"}" in text
    assert f'detgate_worker_up{{worker="{worker.url}"}} 1.0' in text
    for line in text.splitlines():
        if line.startswith("detgate_requests_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            assert set(labels) == {"endpoint", "code"}
            assert labels["endpoint"] in ENDPOINTS + ("other",)
