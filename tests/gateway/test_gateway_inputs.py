"""Bad input is refused by the gateway itself: the right 4xx in the OpenAI error shape, and
nothing forwarded to a worker, nothing recorded."""

from __future__ import annotations

import httpx
import pytest

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MODEL = "Qwen/Qwen3-8B"
MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return {"model": MODEL, "messages": MSG, **kw}


def comp(**kw):
    return {"model": MODEL, "prompt": "hi", **kw}


# (name, method, path, body (dict, or bytes sent as is), expected status)
CASES = [
    ("invalid json", "POST", CHAT, b"{not json", 400),
    ("empty body", "POST", CHAT, b"", 400),
    ("array body", "POST", CHAT, b"[1, 2]", 400),
    ("model missing", "POST", CHAT, {"messages": MSG}, 400),
    ("model not a string", "POST", CHAT, chat(model=7), 400),
    ("unknown model", "POST", CHAT, chat(model="no-such-model"), 404),
    ("messages missing", "POST", CHAT, {"model": MODEL}, 400),
    ("messages empty", "POST", CHAT, chat(messages=[]), 400),
    ("message without role", "POST", CHAT, chat(messages=[{"content": "x"}]), 400),
    ("message with bad role", "POST", CHAT, chat(messages=[{"role": "x", "content": "y"}]), 400),
    ("content not text", "POST", CHAT, chat(messages=[{"role": "user", "content": 5}]), 400),
    ("max_tokens zero", "POST", CHAT, chat(max_tokens=0), 400),
    ("max_tokens huge", "POST", CHAT, chat(max_tokens=10 ** 9), 400),
    ("max_tokens a string", "POST", CHAT, chat(max_tokens="16"), 400),
    ("max_tokens a bool", "POST", CHAT, chat(max_tokens=True), 400),
    ("n zero", "POST", CHAT, chat(n=0), 400),
    ("n huge", "POST", CHAT, chat(n=1000), 400),
    ("temperature negative", "POST", CHAT, chat(temperature=-0.5), 400),
    ("temperature too high", "POST", CHAT, chat(temperature=5), 400),
    ("top_p zero", "POST", CHAT, chat(top_p=0), 400),
    ("top_logprobs over 20", "POST", CHAT, chat(logprobs=True, top_logprobs=21), 400),
    ("top_logprobs without logprobs", "POST", CHAT, chat(top_logprobs=2), 400),
    ("chat logprobs not a bool", "POST", CHAT, chat(logprobs="yes"), 400),
    ("completion logprobs over 20", "POST", COMP, comp(logprobs=21), 400),
    ("prompt_logprobs over 20", "POST", COMP, comp(prompt_logprobs=50), 400),
    ("prompt_logprobs while streaming", "POST", COMP, comp(prompt_logprobs=1, stream=True), 400),
    ("stop list too long", "POST", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400),
    ("stop entry not text", "POST", CHAT, chat(stop=["a", 3]), 400),
    ("upstream address api_base", "POST", CHAT, chat(api_base="http://evil:1"), 400),
    ("upstream address base_url", "POST", COMP, comp(base_url="http://evil:1"), 400),
    ("engine control kv_transfer_params", "POST", COMP, comp(kv_transfer_params={}), 400),
    ("engine control vllm_xargs", "POST", CHAT, chat(vllm_xargs={"a": 1}), 400),
    ("stream not a bool", "POST", CHAT, chat(stream="yes"), 400),
    ("stream_options without stream", "POST", CHAT,
     chat(stream_options={"include_usage": True}), 400),
    ("stream_options unknown key", "POST", CHAT, chat(stream=True, stream_options={"x": 1}), 400),
    ("seed a float", "POST", CHAT, chat(seed=1.5), 400),
    ("seed beyond int64", "POST", CHAT, chat(seed=2 ** 64), 400),
    ("prompt missing", "POST", COMP, {"model": MODEL}, 400),
    ("prompt empty", "POST", COMP, comp(prompt=""), 400),
    ("several prompts", "POST", COMP, comp(prompt=["a", "b"]), 400),
    ("body too large", "POST", CHAT, chat(messages=[{"role": "user", "content": "x" * 70000}]),
     413),
    ("list limit not a number", "GET", "/v1/requests?limit=abc", None, 400),
    ("list limit zero", "GET", "/v1/requests?limit=0", None, 400),
    ("replay load negative", "POST", "/replay/chatcmpl-x", {"load": -1}, 400),
    ("replay load not a number", "POST", "/replay/chatcmpl-x", {"load": "many"}, 400),
    ("replay unknown field", "POST", "/replay/chatcmpl-x", {"worker": "http://evil"}, 400),
    ("replay unknown id", "POST", "/replay/chatcmpl-nope", {}, 404),
    ("record unknown id", "GET", "/v1/requests/chatcmpl-nope", None, 404),
    ("wrong method", "GET", CHAT, None, 405),
    ("unknown path", "POST", "/v1/engines/davinci/completions", comp(), 404),
]


def assert_error_shape(response: httpx.Response) -> None:
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)
    assert "Traceback" not in response.text


@pytest.fixture(scope="module")
def gateway_and_worker(request):
    """One gateway and one spy worker for the whole table (module scope keeps it fast)."""
    worker = request.getfixturevalue("vllm_worker_module")
    start = request.getfixturevalue("start_gateway_module")
    return start([worker.url], env={"DETGATE_MAX_BODY_BYTES": "65536"}), worker


@pytest.mark.parametrize("name,method,path,body,status", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_and_not_forwarded(gateway_and_worker, name, method, path, body,
                                                status):
    gw, worker = gateway_and_worker
    with gw.http() as http:
        if isinstance(body, bytes):
            r = http.request(method, path, content=body,
                             headers={"Content-Type": "application/json"})
        elif body is None:
            r = http.request(method, path)
        else:
            r = http.request(method, path, json=body)
    assert r.status_code == status, r.text
    assert_error_shape(r)
    assert worker.forwarded() == []
    assert gw.redis_keys() == []


def test_at_least_25_bad_inputs():
    assert len(CASES) >= 25
