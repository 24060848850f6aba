"""Structured output, echo, prompt lists and vLLM's extras through a real gateway (real Redis,
a real built-in worker on the tiny model): the fields reach the worker as sent, the answers
are OpenAI-shaped, every request is recorded with its token ids and logprobs, and `/replay`
of a structured request matches (also under load). A vLLM-shaped worker gets the same fields.
Also: every unsupported field named in one 400, `/health` as vLLM's, `x-request-id`.
"""

from __future__ import annotations

import json

import httpx
import orjson
import pytest

from tests.gateway.vllm_worker import fixture

MSG = [{"role": "user", "content": "Where should I go?"}]
CITY = {"type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                       "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "book", "description": "Book a trip",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "wait", "parameters": {
             "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def worker(start_workers_module):
    return start_workers_module(["batch_invariant"])[0]


@pytest.fixture(scope="module")
def gw(start_gateway_module, worker):
    return start_gateway_module([worker.url])


@pytest.fixture(scope="module")
def model(gw):
    return gw.client().models.list().data[0].id


def replay(gw, rid, load=0) -> dict:
    with gw.http() as http:
        r = http.post(f"/replay/{rid}", json={"load": load})
    assert r.status_code == 200, r.text
    return r.json()


def test_json_schema_answer_is_recorded_and_replays(gw, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": CITY,
                                                  "strict": True}}
    answer = gw.client().chat.completions.create(model=model, messages=MSG, max_tokens=40,
                                                 response_format=fmt, temperature=0.7, seed=3)
    doc = json.loads(answer.choices[0].message.content)
    assert doc["city"] in ("Paris", "Rome", "Oslo") and 1 <= doc["days"] <= 9
    rec = gw.record(answer.id)
    assert rec["request"]["response_format"] == fmt and rec["status"] == "complete"
    assert len(rec["choices"][0]["token_ids"]) == len(rec["choices"][0]["logprobs"]) > 5
    for load in (0, 6):
        cmp = replay(gw, answer.id, load)
        assert cmp["match"] is True and cmp["logprob_mse"] == 0.0, cmp


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book"}}])
def test_forced_tool_calls_answer_record_and_replay(gw, model, choice):
    answer = gw.client().chat.completions.create(model=model, messages=MSG, tools=TOOLS,
                                                 tool_choice=choice, max_tokens=60,
                                                 temperature=0)
    c = answer.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name in ("book", "wait")
    json.loads(call.function.arguments)
    rec = gw.record(answer.id)
    assert rec["choices"][0]["tool_calls"][0]["function"]["name"] == call.function.name
    assert replay(gw, answer.id, load=4)["match"] is True


def test_streamed_tool_call_is_recorded_whole_and_replays(gw, model):
    stream = gw.client().chat.completions.create(
        model=model, messages=MSG, tools=TOOLS, max_tokens=60, temperature=0, stream=True,
        tool_choice={"type": "function", "function": {"name": "book"}},
        stream_options={"include_usage": True})
    rid, args, name, finish = None, "", None, None
    for chunk in stream:
        rid = chunk.id
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                name = name or tc.function.name
                args += tc.function.arguments or ""
            finish = c.finish_reason or finish
    assert name == "book" and finish == "tool_calls"
    assert json.loads(args)["city"] in ("Paris", "Rome", "Oslo")
    rec = gw.record(rid)
    assert rec["choices"][0]["tool_calls"][0]["function"] == {"name": "book", "arguments": args}
    assert replay(gw, rid)["match"] is True


def test_echo_with_token_id_prompts_is_recorded_and_replays(gw, model):
    prompts = [[5, 60, 70, 80, 90], [7, 8, 9]]
    with gw.http() as http:
        r = http.post("/v1/completions", json={"model": model, "prompt": prompts, "echo": True,
                                                "logprobs": 1, "max_tokens": 1,
                                                "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert r.headers["x-request-id"] == body["id"] == r.headers["x-detgate-record-id"]
    for choice, prompt in zip(body["choices"], prompts, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
        assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    rec = gw.record(body["id"])
    assert [c["prompt_token_ids"] for c in rec["choices"]] == prompts
    assert all(len(c["logprobs"]) == len(c["token_ids"]) == 1 for c in rec["choices"])
    assert rec["choices"][0]["prompt_logprobs"] == body["choices"][0]["logprobs"][
        "token_logprobs"][:5]
    assert replay(gw, body["id"])["match"] is True


def test_vllm_extras_are_honoured_and_recorded(gw, model):
    with gw.http() as http:
        r = http.post("/v1/chat/completions", json={
            "model": model, "messages": MSG, "max_completion_tokens": 12, "temperature": 0,
            "min_tokens": 12, "ignore_eos": False, "stop_token_ids": [7],
            "skip_special_tokens": True, "include_stop_str_in_output": False, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        events = [orjson.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
    assert r.status_code == 200
    assert all(e.get("usage") for e in events)  # continuous usage: every chunk
    assert events[-1]["usage"]["completion_tokens"] == 12
    rec = gw.record(events[0]["id"])
    assert len(rec["choices"][0]["token_ids"]) == 12
    assert rec["request"]["stream_options"]["continuous_usage_stats"] is True
    assert replay(gw, events[0]["id"])["match"] is True


def test_every_unsupported_field_is_named_at_once(gw, model):
    with gw.http() as http:
        r = http.post("/v1/chat/completions", json={
            "model": model, "messages": MSG, "repetition_penalty": 1.1, "min_p": 0.1,
            "guided_json": {}})
    assert r.status_code == 400
    err = r.json()["error"]
    for name in ("repetition_penalty", "min_p", "guided_json"):
        assert f"'{name}'" in err["message"]
    assert err["code"] == "unknown_parameter" and "x-request-id" in r.headers


def test_worker_names_every_unsupported_field_at_once(worker, model):
    r = httpx.post(worker.url + "/v1/chat/completions", json={
        "model": model, "messages": MSG, "presence_penalty": 0.5, "logit_bias": {"3": 1},
        "frequency_penalty": 0, "repetition_penalty": 1.0}, timeout=60)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "'presence_penalty'" in message and "'logit_bias'" in message
    assert "frequency_penalty" not in message and "repetition_penalty" not in message


def test_health_is_vllms_and_every_answer_has_a_request_id(gw):
    r = httpx.get(gw.url + "/health")
    assert r.status_code == 200 and r.content == b""
    assert r.headers["x-request-id"]
    r = httpx.get(gw.url + "/v1/models", headers={"x-request-id": "client-7"})
    assert r.headers["x-request-id"] == "client-7"


def test_vllm_worker_receives_the_same_fields(vllm_worker, start_gateway):
    labels = orjson.dumps({vllm_worker.url: "vllm"}).decode()
    gw = start_gateway([vllm_worker.url], env={"DETGATE_WORKER_LABELS": labels})
    model = orjson.loads(fixture("vllm_models.json"))["data"][0]["id"]
    gw.client().chat.completions.create(model=model, messages=MSG, tools=TOOLS,
                                        tool_choice="required", parallel_tool_calls=False,
                                        extra_body={"ignore_eos": True, "min_tokens": 2})
    sent = vllm_worker.received[-1][1]
    assert sent["tools"] == TOOLS and sent["tool_choice"] == "required"
    assert sent["parallel_tool_calls"] is False and sent["ignore_eos"] is True
