"""`POST /v1/score` through the gateway, in front of real built-in workers.

One batch-invariant and one default-mode worker serve the same model (their fingerprints
differ), so a score request pinned by `system_fingerprint` shows both that pinning works and,
as the negative control, that a default-mode worker's teacher-forced logprobs differ from the
ones it sampled.
"""

from __future__ import annotations

import json
import os
import subprocess
import time

import httpx
import pytest

from tests.support.floats import bits
from tests.support.procs import detgate_cmd, free_port

IDS = [5, 6, 7, 8, 9, 10, 11, 12]
MAX_SCORE_TOKENS = 64


@pytest.fixture(scope="module")
def workers(start_workers_module):
    return start_workers_module(["batch_invariant", "default"])


@pytest.fixture(scope="module")
def gw(start_gateway_module, workers):
    return start_gateway_module([w.url for w in workers],
                                env={"DETGATE_MAX_SCORE_TOKENS": str(MAX_SCORE_TOKENS)})


@pytest.fixture(scope="module")
def model(gw) -> str:
    return gw.client().models.list().data[0].id


@pytest.fixture(scope="module")
def fingerprints(workers, model) -> dict[str, str]:
    """mode -> the worker's own fingerprint."""
    out = {}
    for mode, w in zip(["batch_invariant", "default"], workers, strict=True):
        r = httpx.post(w.url + "/v1/score", json={"model": model, "token_ids": IDS[:2]},
                       timeout=60)
        out[mode] = r.json()["system_fingerprint"]
    assert out["batch_invariant"] != out["default"]
    return out


def score(gw, body: dict, key: str | None = None) -> httpx.Response:
    with gw.http(key) as http:
        return http.post("/v1/score", json=body)


def upstream_calls(gw, workers) -> float:
    return sum(gw.metric("detgate_upstream_duration_seconds_count", worker=w.url)
               for w in workers)


def test_score_through_the_gateway_equals_the_worker_bitwise(gw, workers, model, fingerprints):
    before = gw.metric("detgate_requests_total", endpoint="/v1/score", code="200")
    keys = gw.redis_keys()
    for mode, worker in zip(["batch_invariant", "default"], workers, strict=True):
        body = {"model": model, "token_ids": IDS, "start": 3}
        direct = httpx.post(worker.url + "/v1/score", json=body, timeout=60)
        assert direct.status_code == 200, direct.text
        r = score(gw, {**body, "system_fingerprint": fingerprints[mode]})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out == direct.json()
        assert bits(out["logprobs"]) == bits(direct.json()["logprobs"])
        assert out["system_fingerprint"] == fingerprints[mode]
        assert (out["start"], out["token_ids"], len(out["logprobs"])) == (3, IDS, len(IDS) - 3)
    after = gw.metric("detgate_requests_total", endpoint="/v1/score", code="200")
    assert after - before == 2
    assert gw.redis_keys() == keys  # a score is not recorded


def test_score_needs_no_redis(start_gateway_module, workers, model):
    # Without a spool, so that no record could be stored at all: /readyz says not ready.
    gw = start_gateway_module([workers[0].url], redis=f"redis://127.0.0.1:{free_port()}/0",
                              wait="/healthz", env={"DETGATE_SPOOL_MAX_BYTES": "0"})
    with gw.http() as http:
        deadline = time.monotonic() + 60
        while not http.get("/v1/models").json()["data"]:  # the worker's first health check
            assert time.monotonic() < deadline, "the gateway never saw the worker"
            time.sleep(0.1)
        assert http.get("/readyz").status_code == 503  # Redis is down...
        r = http.post("/v1/score", json={"model": model, "token_ids": IDS})
    assert r.status_code == 200, r.text  # ...and the read-only score is served all the same


def test_start_defaults_to_one_as_on_the_worker(gw, model):
    r = score(gw, {"model": model, "token_ids": IDS})
    assert r.status_code == 200, r.text
    assert r.json()["start"] == 1 and len(r.json()["logprobs"]) == len(IDS) - 1


def recorded_completions(gw, model) -> dict[str, dict]:
    """fingerprint -> a record generated on that worker (ties rotate between the two)."""
    found: dict[str, dict] = {}
    client = gw.client()
    for i in range(8):
        answer = client.completions.create(model=model, prompt=f"Richard Feynman {i}",
                                           max_tokens=12, temperature=0)
        with gw.http() as http:
            rec = http.get(f"/v1/requests/{answer.id}").json()
        found.setdefault(rec["system_fingerprint"], rec)
        if len(found) == 2:
            return found
    pytest.fail(f"the gateway sent every completion to one worker: {list(found)}")


def test_score_equals_the_recorded_logprobs_on_an_invariant_worker(gw, model, fingerprints):
    records = recorded_completions(gw, model)
    scored = {}
    for fingerprint, rec in records.items():
        prompt = rec["prompt_token_ids"]
        choice = rec["choices"][0]
        r = score(gw, {"model": model, "token_ids": prompt + choice["token_ids"],
                       "start": len(prompt), "system_fingerprint": fingerprint})
        assert r.status_code == 200, r.text
        assert r.json()["system_fingerprint"] == fingerprint
        scored[fingerprint] = (r.json()["logprobs"], choice["logprobs"])
    teacher, sampled = scored[fingerprints["batch_invariant"]]
    assert bits(teacher) == bits(sampled)
    # Negative control: in default mode a full prefill and the decode steps reduce differently.
    teacher, sampled = scored[fingerprints["default"]]
    assert len(teacher) == len(sampled) and bits(teacher) != bits(sampled)


def test_an_unknown_fingerprint_is_a_conflict(gw, workers, model):
    before = upstream_calls(gw, workers)
    r = score(gw, {"model": model, "token_ids": IDS, "system_fingerprint": "fp_nobody"})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["type"] == "conflict_error"
    assert upstream_calls(gw, workers) == before


BAD = [
    (b"{not json", None),
    ({"model": "M", "token_ids": IDS, "temperature": 0}, "temperature"),
    ({"model": "M", "token_ids": IDS, "api_base": "http://elsewhere"}, "api_base"),
    ({"token_ids": IDS}, "model"),
    ({"model": "M"}, "token_ids"),
    ({"model": "M", "token_ids": "5 6 7"}, "token_ids"),
    ({"model": "M", "token_ids": []}, "token_ids"),
    ({"model": "M", "token_ids": [5]}, "token_ids"),
    ({"model": "M", "token_ids": [5] * (MAX_SCORE_TOKENS + 1)}, "token_ids"),
    ({"model": "M", "token_ids": [5, -1, 7]}, "token_ids"),
    ({"model": "M", "token_ids": [5, 6.0, 7]}, "token_ids"),
    ({"model": "M", "token_ids": [5, True, 7]}, "token_ids"),
    ({"model": "M", "token_ids": [5, "6", 7]}, "token_ids"),
    ({"model": "M", "token_ids": IDS, "start": 0}, "start"),
    ({"model": "M", "token_ids": IDS, "start": len(IDS)}, "start"),
    ({"model": "M", "token_ids": IDS, "start": "2"}, "start"),
    ({"model": "M", "token_ids": IDS, "start": 2.0}, "start"),
    ({"model": "M", "token_ids": IDS, "system_fingerprint": 7}, "system_fingerprint"),
    ([IDS], None),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_input_is_a_400_and_nothing_is_forwarded(gw, workers, model, body, param):
    before = upstream_calls(gw, workers)
    with gw.http() as http:
        if isinstance(body, bytes):
            r = http.post("/v1/score", content=body, headers={"Content-Type": "application/json"})
        else:
            if isinstance(body, dict) and body.get("model") == "M":
                body = {**body, "model": model}
            r = http.post("/v1/score", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert set(err) == {"message", "type", "param", "code"}
    assert upstream_calls(gw, workers) == before


def test_an_unknown_model_is_a_404_and_a_workers_refusal_passes_through(gw, model):
    r = score(gw, {"model": "nope", "token_ids": IDS})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # Token ids outside the vocabulary: only the worker knows its vocabulary.
    r = score(gw, {"model": model, "token_ids": [5, 1 << 40]})
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]


def test_keys_are_required_when_configured(start_gateway_module, workers, model):
    gw = start_gateway_module([workers[0].url], api_keys="t1:k-score")
    body = {"model": model, "token_ids": IDS}
    for key in (None, "wrong"):
        r = score(gw, body, key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = score(gw, body, "k-score")
    assert r.status_code == 200, r.text
    assert gw.metric("detgate_requests_total", endpoint="/v1/score", code="401") == 2


def test_a_vllm_worker_is_never_asked_to_score(start_gateway_module, vllm_worker_module):
    gw = start_gateway_module([vllm_worker_module.url])
    r = score(gw, {"model": "Qwen/Qwen3-8B", "token_ids": IDS, "start": 2})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "no_score_worker"
    assert gw.metric("detgate_upstream_duration_seconds_count",
                     worker=vllm_worker_module.url) == 0
    assert vllm_worker_module.forwarded() == []


def test_audit_score_says_once_that_no_worker_behind_the_gateway_scores(
        start_gateway_module, vllm_worker_module, tmp_path):
    gw = start_gateway_module([vllm_worker_module.url])
    out = tmp_path / "audit.json"
    run = subprocess.run(
        detgate_cmd("audit", "--base-url", gw.url + "/v1", "--model", "Qwen/Qwen3-8B",
                    "--prompt", "hello", "-n", "4", "--score", "--json", str(out)),
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert run.returncode == 0, run.stdout + run.stderr
    score = json.loads(out.read_text())["details"]["score"]
    assert score["scored"] == 0 and score["errors"] == []
    assert "built-in" in score["unsupported"], score
