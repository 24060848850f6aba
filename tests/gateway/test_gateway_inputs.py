"""Bad input is refused by the gateway itself: the right 4xx in the OpenAI error shape, and
nothing forwarded to a worker, nothing recorded."""

from __future__ import annotations

import httpx
import orjson
import pytest

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MODEL = "Qwen/Qwen3-8B"
MSG = [{"role": "user", "content": "hi"}]


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


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
    ("prompts of two kinds", "POST", COMP, comp(prompt=["a", [1, 2]]), 400),
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
    # Issue 13, item 8 (5xx for bad input at an earlier commit) and more of the same kind.
    ("role a list", "POST", CHAT, chat(messages=[{"role": ["user"], "content": "x"}]), 400),
    ("role an object", "POST", CHAT, chat(messages=[{"role": {"a": 1}, "content": "x"}]), 400),
    ("role a number", "POST", CHAT, chat(messages=[{"role": 1, "content": "x"}]), 400),
    ("role null", "POST", CHAT, chat(messages=[{"role": None, "content": "x"}]), 400),
    ("message a string", "POST", CHAT, chat(messages=["hi"]), 400),
    ("message a list", "POST", CHAT, chat(messages=[["user", "hi"]]), 400),
    ("messages an object", "POST", CHAT, chat(messages={"role": "user"}), 400),
    ("messages a string", "POST", CHAT, chat(messages="hi"), 400),
    ("content an object", "POST", CHAT, chat(messages=[{"role": "user", "content": {}}]), 400),
    ("content null", "POST", CHAT, chat(messages=[{"role": "user", "content": None}]), 400),
    ("limit a non-ASCII digit", "GET", "/v1/requests?limit=%D9%A1", None, 400),
    ("limit a superscript digit", "GET", "/v1/requests?limit=%C2%B2", None, 400),
    ("limit thousands of digits", "GET", "/v1/requests?limit=" + "9" * 5000, None, 400),
    ("limit negative", "GET", "/v1/requests?limit=-1", None, 400),
    ("limit too large", "GET", "/v1/requests?limit=1001", None, 400),
    ("limit a float", "GET", "/v1/requests?limit=1.5", None, 400),
    ("limit empty", "GET", "/v1/requests?limit=", None, 400),
    ("limit with spaces", "GET", "/v1/requests?limit=%201", None, 400),
    ("status unknown", "GET", "/v1/requests?status=done", None, 400),
    ("replay filter unknown", "GET", "/v1/requests?replay=yes", None, 400),
    ("after unknown", "GET", "/v1/requests?after=chatcmpl-nope", None, 400),
    ("lone surrogate in content", "POST", CHAT,
     b'{"model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": "\\ud800"}]}', 400),
    ("lone surrogate in prompt", "POST", COMP, b'{"model": "Qwen/Qwen3-8B", "prompt": "\\udfff"}',
     400),
    ("invalid utf-8", "POST", CHAT, b'{"model": "\xff\xfe"}', 400),
    ("NaN temperature", "POST", CHAT, b'{"model": "m", "messages": [], "temperature": NaN}', 400),
    ("Infinity top_p", "POST", CHAT, b'{"model": "m", "messages": [], "top_p": Infinity}', 400),
    ("trailing garbage", "POST", CHAT, b'{"model": "m"} x', 400),
    ("deeply nested", "POST", CHAT, b'{"model": ' + b"[" * 2000 + b"]" * 2000 + b"}", 400),
    ("number body", "POST", CHAT, b"7", 400),
    ("string body", "POST", CHAT, b'"hi"', 400),
    ("null body", "POST", CHAT, b"null", 400),
    ("model empty", "POST", CHAT, chat(model=""), 400),
    ("model a list", "POST", CHAT, chat(model=["a"]), 400),
    ("model null", "POST", CHAT, chat(model=None), 400),
    ("max_tokens negative", "POST", CHAT, chat(max_tokens=-1), 400),
    ("max_tokens a float", "POST", CHAT, chat(max_tokens=1.0), 400),
    ("max_tokens beyond int64", "POST", CHAT, chat(max_tokens=2 ** 70), 400),
    ("max_completion_tokens huge", "POST", CHAT, chat(max_completion_tokens=10 ** 9), 400),
    ("max_completion_tokens zero", "POST", CHAT, chat(max_completion_tokens=0), 400),
    ("n a string", "POST", CHAT, chat(n="2"), 400),
    ("n negative", "POST", CHAT, chat(n=-1), 400),
    ("temperature a string", "POST", CHAT, chat(temperature="0"), 400),
    ("temperature a bool", "POST", CHAT, chat(temperature=False), 400),
    ("top_p above one", "POST", CHAT, chat(top_p=1.5), 400),
    ("top_p negative", "POST", CHAT, chat(top_p=-0.1), 400),
    ("top_p a string", "POST", CHAT, chat(top_p="0.5"), 400),
    ("top_k below -1", "POST", CHAT, chat(top_k=-2), 400),
    ("top_k huge", "POST", CHAT, chat(top_k=2 ** 40), 400),
    ("presence_penalty too high", "POST", CHAT, chat(presence_penalty=3), 400),
    ("frequency_penalty too low", "POST", CHAT, chat(frequency_penalty=-3), 400),
    ("seed a string", "POST", CHAT, chat(seed="7"), 400),
    ("seed below int64", "POST", CHAT, chat(seed=-(2 ** 64)), 400),
    ("stop a number", "POST", CHAT, chat(stop=5), 400),
    ("stop empty entry", "POST", CHAT, chat(stop=[""]), 400),
    ("stop an object", "POST", CHAT, chat(stop={"a": 1}), 400),
    ("user a number", "POST", CHAT, chat(user=5), 400),
    ("stream null options", "POST", CHAT, chat(stream=True, stream_options=5), 400),
    ("include_usage not a bool", "POST", CHAT,
     chat(stream=True, stream_options={"include_usage": "yes"}), 400),
    ("return_token_ids a string", "POST", CHAT, chat(return_token_ids="yes"), 400),
    ("top_logprobs negative", "POST", CHAT, chat(logprobs=True, top_logprobs=-1), 400),
    ("top_logprobs a string", "POST", CHAT, chat(logprobs=True, top_logprobs="2"), 400),
    ("tool without a function", "POST", CHAT, chat(tools=[{"type": "function"}]), 400),
    ("tool_choice names no tool", "POST", CHAT, chat(
        tools=[{"type": "function", "function": {"name": "f"}}],
        tool_choice={"type": "function", "function": {"name": "g"}}), 400),
    ("tool_choice required without tools", "POST", CHAT, chat(tool_choice="required"), 400),
    ("json_schema without a schema", "POST", CHAT, chat(
        response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400),
    ("response_format not forwarded", "POST", CHAT, chat(response_format={"type": "json"}), 400),
    ("logit_bias not forwarded", "POST", CHAT, chat(logit_bias={"1": 5}), 400),
    ("completion logprobs negative", "POST", COMP, comp(logprobs=-1), 400),
    ("completion logprobs a bool", "POST", COMP, comp(logprobs=True), 400),
    ("completion echo streamed", "POST", COMP, comp(echo=True, stream=True), 400),
    ("min_tokens negative", "POST", COMP, comp(min_tokens=-1), 400),
    ("ignore_eos a string", "POST", COMP, comp(ignore_eos="yes"), 400),
    ("completion suffix", "POST", COMP, comp(suffix="x"), 400),
    ("completion best_of", "POST", COMP, comp(best_of=2), 400),
    ("prompt a number", "POST", COMP, comp(prompt=5), 400),
    ("prompt null", "POST", COMP, comp(prompt=None), 400),
    ("prompt empty token list", "POST", COMP, comp(prompt=[]), 400),
    ("prompt negative token", "POST", COMP, comp(prompt=[1, -1]), 400),
    ("prompt float tokens", "POST", COMP, comp(prompt=[1.5]), 400),
    ("more prompts than max_n", "POST", COMP, comp(prompt=[[1, 2]] * 17), 400),
    ("prompt_logprobs negative", "POST", COMP, comp(prompt_logprobs=-1), 400),
    ("completion messages field", "POST", COMP, comp(messages=MSG), 400),
    ("chat prompt field", "POST", CHAT, chat(prompt="x"), 400),
    ("score empty body", "POST", "/v1/score", b"", 400),
    ("score token_ids missing", "POST", "/v1/score", {"model": MODEL}, 400),
    ("score one token", "POST", "/v1/score", {"model": MODEL, "token_ids": [1]}, 400),
    ("score start zero", "POST", "/v1/score", {"model": MODEL, "token_ids": [1, 2], "start": 0},
     400),
    ("score start past the end", "POST", "/v1/score",
     {"model": MODEL, "token_ids": [1, 2], "start": 2}, 400),
    ("score negative token", "POST", "/v1/score", {"model": MODEL, "token_ids": [1, -2]}, 400),
    ("score unknown field", "POST", "/v1/score",
     {"model": MODEL, "token_ids": [1, 2], "x": 1}, 400),
    ("score fingerprint empty", "POST", "/v1/score",
     {"model": MODEL, "token_ids": [1, 2], "system_fingerprint": ""}, 400),
    ("replay body not an object", "POST", "/replay/chatcmpl-x", b"[1]", 400),
    ("replay body invalid json", "POST", "/replay/chatcmpl-x", b"{", 400),
    ("replay load huge", "POST", "/replay/chatcmpl-x", {"load": 10 ** 6}, 400),
    ("replay load a float", "POST", "/replay/chatcmpl-x", {"load": 1.0}, 400),
    ("record id with slash", "GET", "/v1/requests/a/b", None, 404),
    ("record id very long", "GET", "/v1/requests/" + "x" * 4000, None, 404),
    ("trailing slash", "POST", CHAT + "/", chat(), 404),
    ("wrong method on completions", "PUT", COMP, comp(), 405),
    ("wrong method on score", "GET", "/v1/score", None, 405),
    ("wrong method on records", "POST", "/v1/requests", {}, 405),
    ("wrong method on replay", "GET", "/replay/chatcmpl-x", None, 405),
    ("delete a record", "DELETE", "/v1/requests/chatcmpl-x", None, 405),
    ("options preflight", "OPTIONS", CHAT, None, 405),
    ("unknown v1 path", "GET", "/v1/files", None, 404),
    # Issue 22: what a worker would refuse, refused here, and inputs that were a 500.
    ("stop sequence too long", "POST", CHAT, chat(stop="x" * 257), 400),
    ("one of the stops too long", "POST", COMP, comp(stop=["a", "y" * 1000]), 400),
    ("image content part", "POST", CHAT, chat(messages=user(
        [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}])), 400),
    ("audio content part", "POST", CHAT, chat(messages=user(
        [{"type": "text", "text": "hi"}, {"type": "input_audio", "input_audio": {}}])), 400),
    ("text part without text", "POST", CHAT, chat(messages=user([{"type": "text"}])), 400),
    ("text part with an extra key", "POST", CHAT, chat(messages=user(
        [{"type": "text", "text": "hi", "cache": {"a": 1}}])), 400),
    ("content nested 300 deep", "POST", CHAT, chat(messages=user(nested(300))), 400),
    ("message field nested 300 deep", "POST", CHAT, chat(messages=[
        {"role": "user", "content": "x", "name": nested(300)}]), 400),
    ("message field nested 65 deep", "POST", CHAT, chat(messages=[
        {"role": "user", "content": "x", "name": nested(65)}]), 400),
    ("prompt nested 1100 deep", "POST", COMP,
     b'{"model": "%s", "prompt": ' % MODEL.encode() + b"[" * 1100 + b"]" * 1100 + b"}", 400),
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


def test_at_least_100_bad_inputs():
    assert len(CASES) >= 100
    assert len({c[0] for c in CASES}) == len(CASES)


def test_still_serving_after_the_table(gateway_and_worker):
    gw, _ = gateway_and_worker
    with gw.http() as http:
        r = http.post(CHAT, json=chat(max_tokens=4))
    assert r.status_code == 200, r.text


def test_worker_refuses_a_lone_surrogate_and_top_p_keeps_the_top_token(start_worker):
    """Straight to a built-in worker: a lone surrogate is a 400 (it was a 500); a top_p that
    is 0 in fp32 still samples the most likely token (it was token 0)."""
    worker = start_worker()
    with httpx.Client(base_url=worker.url, timeout=60) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        for raw in (b'{"model": "%s", "prompt": "\\ud800"}',
                    b'{"model": "%s", "messages": [{"role": "user", "content": "a\\udfffb"}]}'):
            path = "/v1/completions" if b"prompt" in raw else "/v1/chat/completions"
            r = http.post(path, content=raw % model.encode(),
                          headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text
            assert_error_shape(r)
        greedy = http.post("/v1/completions", json={
            "model": model, "prompt": "The", "max_tokens": 8, "temperature": 0,
            "return_token_ids": True}).json()
        tiny_p = http.post("/v1/completions", json={
            "model": model, "prompt": "The", "max_tokens": 8, "temperature": 1.0,
            "top_p": 1e-300, "seed": 3, "return_token_ids": True}).json()
        assert tiny_p["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]
        assert http.get("/health").status_code == 200


def test_every_unknown_parameter_is_named_at_once(gateway_and_worker):
    """A client that sends two fields the gateway does not forward learns of both in one
    400, not one per attempt."""
    gw, worker = gateway_and_worker
    forwarded = len(worker.forwarded())
    with gw.http() as http:
        r = http.post(CHAT, json=chat(foo=1, bar={"x": 2}, stream_options=None))
    assert r.status_code == 400
    err = r.json()["error"]
    assert "'foo'" in err["message"] and "'bar'" in err["message"], err
    assert err["code"] == "unknown_parameter" and err["param"] in ("foo", "bar")
    assert len(worker.forwarded()) == forwarded


def _finished(worker_url: str) -> float:
    text = httpx.get(worker_url + "/metrics", timeout=10).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("detgate_worker_requests_total{"))


def test_what_the_worker_would_refuse_is_refused_before_forwarding(start_gateway,
                                                                   start_worker):
    """Against a real worker (its card: context 2048 tokens, its vocabulary, the parameters
    it refuses): each case is a 4xx from the gateway, the worker generates nothing, and at
    most a bounded summary is stored. They were forwarded, refused by the worker and stored
    whole (a 1 MB prompt as a 1,048,680-byte record)."""
    worker = start_worker()
    card = httpx.get(worker.url + "/v1/models").json()["data"][0]
    model, context, vocab = card["id"], card["max_model_len"], card["vocab_size"]
    gw = start_gateway([worker.url], env={"DETGATE_MAX_BODY_BYTES": str(2 << 20)})
    cases = {
        "1 MB text prompt": (COMP, {"model": model, "prompt": "word " * 200_000}),
        "1 MB chat message": (CHAT, {"model": model, "messages": user("x" * (1 << 20))}),
        "token ids beyond the context": (COMP, {"model": model, "prompt": [5] * (context + 1)}),
        "token id beyond the vocabulary": (COMP, {"model": model, "prompt": [1, vocab]}),
        "max_tokens at the context": (COMP, {"model": model, "prompt": "a",
                                             "max_tokens": context}),
        "prompt + max_tokens beyond": (COMP, {"model": model, "prompt": [5] * 100,
                                              "max_tokens": context - 50}),
        "presence_penalty": (CHAT, {"model": model, "messages": MSG, "presence_penalty": 0.5}),
        "frequency_penalty": (COMP, {"model": model, "prompt": "a", "frequency_penalty": -1}),
        "image_url part": (CHAT, {"model": model, "messages": user(
            [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}])}),
        "a 1,000,000-character stop": (COMP, {"model": model, "prompt": "a",
                                              "stop": "s" * 1_000_000}),
    }
    before = _finished(worker.url)
    with gw.http() as http:
        for name, (path, payload) in cases.items():
            r = http.post(path, json=payload)
            assert r.status_code == 400, (name, r.text)
            assert_error_shape(r)
        assert _finished(worker.url) == before
        assert gw.redis_keys() == []
        # Neutral values of the unsupported parameters are fine.
        ok = http.post(COMP, json={"model": model, "prompt": "a", "max_tokens": 2,
                                   "presence_penalty": 0, "frequency_penalty": 0.0})
        assert ok.status_code == 200, ok.text
        # Past the gateway's lower bound but over the worker's context: the worker refuses,
        # and the record is a bounded summary, never the whole body.
        near = http.post(COMP, json={"model": model, "prompt": "ab " * 3000,
                                     "max_tokens": 16})
        assert near.status_code == 400, near.text
        rec = http.get(f"/v1/requests/{near.headers['x-detgate-record-id']}").json()
    assert rec["status"] == "failed" and rec["summary"]["reason"] == "rejected"
    assert len(orjson.dumps(rec)) <= 4096 < rec["summary"]["record_bytes"]
