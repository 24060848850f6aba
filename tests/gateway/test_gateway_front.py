"""The ASGI front (gateway/front.py) in a real gateway process on real Redis: the two hot
POSTs are served directly and everything else by the app, and a client sees no difference:
record ids in `id`, `X-Detgate-Record-Id` and `x-request-id`, errors in the OpenAI shape,
requests counted per endpoint and status with their overhead, open mode's guard. Concurrent
requests (recorded in shared round trips, gateway/batching.py) each get their own record."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.gateway.test_gateway_inputs import assert_error_shape

MODEL = "Qwen/Qwen3-8B"  # the vLLM fixture worker's
KEY = "front-key"
CHAT = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def gw(start_gateway_module, vllm_worker_module):
    return start_gateway_module([vllm_worker_module.url], api_keys=f"alice:{KEY}")


@pytest.fixture(scope="module")
def open_gw(start_gateway_module, vllm_worker_module):
    return start_gateway_module([vllm_worker_module.url])


def test_hot_posts_carry_the_record_id_and_are_counted(gw):
    counted = gw.metric("detgate_requests_total", endpoint="/v1/chat/completions", code="200")
    overhead = gw.metric("detgate_gateway_overhead_seconds_count")
    with gw.http(KEY) as http:
        chat = http.post("/v1/chat/completions", json=CHAT)
        done = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                   "max_tokens": 3})
        for r in (chat, done):
            assert r.status_code == 200, r.text
            rid = r.json()["id"]
            assert r.headers["x-request-id"] == r.headers["x-detgate-record-id"] == rid
            record = http.get(f"/v1/requests/{rid}").json()
            assert record["id"] == rid and record["status"] == "complete"
    assert gw.metric("detgate_requests_total", endpoint="/v1/chat/completions",
                     code="200") == counted + 1
    assert gw.metric("detgate_gateway_overhead_seconds_count") == overhead + 2


def test_errors_on_the_hot_path_keep_the_shape_and_are_counted(gw):
    before = gw.metric("detgate_requests_total", endpoint="/v1/chat/completions", code="400")
    with gw.http(KEY) as http:
        r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert_error_shape(r)
        assert r.headers["x-request-id"].startswith("req-")
        r = http.post("/v1/chat/completions", content=b"{not json",
                      headers={"x-request-id": "client-7", "Content-Type": "application/json"})
        assert r.status_code == 400 and r.headers["x-request-id"] == "client-7"
        assert_error_shape(r)
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "api_base": "y"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"
        assert_error_shape(r)
    assert gw.metric("detgate_requests_total", endpoint="/v1/chat/completions",
                     code="400") == before + 1


def test_other_methods_and_paths_go_to_the_app(gw):
    with gw.http(KEY) as http:
        r = http.get("/v1/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert_error_shape(r)
        r = http.post("/v1/completions/", json={})
        assert r.status_code == 404 and "location" not in r.headers
        assert_error_shape(r)
        assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
        assert http.get("/healthz").status_code == 200
        assert "x-request-id" in http.get("/readyz").headers


def test_open_mode_guard_on_the_hot_paths(open_gw):
    with open_gw.http() as http:
        r = http.post("/v1/chat/completions", json=CHAT, headers={"Host": "evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
        assert_error_shape(r)
        r = http.post("/v1/completions", content=b'{"model": "x", "prompt": "p"}',
                      headers={"Content-Type": "text/plain"})
        assert r.status_code == 415
        assert_error_shape(r)
        r = http.post("/v1/chat/completions", json=CHAT,
                      headers={"Content-Type": "application/json; charset=utf-8"})
        assert r.status_code == 200, r.text


def test_concurrent_requests_each_get_their_own_record(gw):
    stored = gw.metric("detgate_records_total", result="stored")

    def ask(i: int) -> tuple[int, httpx.Response]:
        body = {**CHAT, "messages": [{"role": "user", "content": f"question {i}"}]}
        with gw.http(KEY) as http:
            return i, http.post("/v1/chat/completions", json=body)

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, range(96)))
    ids = set()
    with gw.http(KEY) as http:
        for i, r in answers:
            assert r.status_code == 200, r.text
            rid = r.json()["id"]
            ids.add(rid)
            record = http.get(f"/v1/requests/{rid}").json()
            assert record["request"]["messages"][0]["content"] == f"question {i}"
    assert len(ids) == 96
    assert gw.metric("detgate_records_total", result="stored") == stored + 96
