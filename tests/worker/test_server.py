"""The worker's HTTP surface against a real worker process: OpenAI shapes (with the openai SDK),
streaming, bad input as 400s in the OpenAI error shape, and clients that leave mid-request."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from detgate.contract.sampling import UNSUPPORTED
from tests.support.floats import bits

MODEL = "tiny"


@pytest.fixture(scope="module")
def url(module_worker) -> str:
    # Server behaviour does not depend on the numeric mode; default mode is the faster one.
    return module_worker("default", "--max-model-len", "256", "--num-kv-blocks", "64").url


@pytest.fixture(scope="module")
def client(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def gauge(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name)


def aborted(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "detgate_worker_requests_total"
               and s.labels.get("finish_reason") == "abort")


def wait_idle(url: str, timeout: float = 60.0) -> None:
    """Until no request runs or waits and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (gauge(url, "detgate_worker_requests_running") == 0
                and gauge(url, "detgate_worker_requests_waiting") == 0
                and gauge(url, "detgate_worker_kv_cache_free_blocks")
                == gauge(url, "detgate_worker_kv_cache_blocks")):
            return
        time.sleep(0.1)
    raise AssertionError("the worker still holds sequences")


def test_models_health_and_fingerprint(url, client):
    assert httpx.get(f"{url}/health").status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert out.system_fingerprint.startswith("fp_")
    chat = client.chat.completions.create(model=MODEL, max_tokens=3, temperature=0,
                                          messages=[{"role": "user", "content": "Hello"}])
    assert chat.system_fingerprint == out.system_fingerprint
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 3


def test_completion_logprobs_and_token_ids(client):
    out = client.completions.create(model=MODEL, prompt="The sea", max_tokens=5, temperature=0,
                                    logprobs=3, extra_body={"return_token_ids": True,
                                                            "ignore_eos": True})
    choice = out.choices[0]
    token_ids = choice.model_extra["token_ids"]
    assert len(token_ids) == 5 and len(choice.logprobs.token_logprobs) == 5
    # Greedy: the chosen token is the most likely one.
    for lp, top in zip(choice.logprobs.token_logprobs, choice.logprobs.top_logprobs, strict=True):
        assert len(top) <= 3 and lp == max(top.values())
    assert "".join(choice.logprobs.tokens) == choice.text
    # The JSON floats are the engine's float32 values exactly (no float64 arithmetic on the way).
    assert all(float(np.float32(lp)) == lp for lp in choice.logprobs.token_logprobs)


def test_prompt_logprobs(url):
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 1, "prompt_logprobs": 2,
            "return_token_ids": True}
    choice = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 4
    for token_id, entry in zip([6, 7, 8], plp[1:], strict=True):
        assert str(token_id) in entry and len(entry) <= 3
        assert entry[str(token_id)]["rank"] >= 1


def test_stream_matches_non_stream(url):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
            "logprobs": 1, "return_token_ids": True, "ignore_eos": True}
    whole = httpx.post(f"{url}/v1/completions", json=body).json()
    streamed_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=streamed_body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    usage, chunks = chunks[-1], chunks[:-1]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    choice = whole["choices"][0]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == choice["token_ids"]
    streamed = sum((c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks), [])
    assert streamed == choice["logprobs"]["token_logprobs"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["system_fingerprint"] == whole["system_fingerprint"] for c in chunks)


def test_chat_stream_with_the_openai_sdk(client):
    messages = [{"role": "user", "content": "Tell me about the sea"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                           temperature=0, logprobs=True, top_logprobs=2)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                            temperature=0, logprobs=True, top_logprobs=2,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    streamed = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert bits(streamed) == bits([t.logprob for t in whole.choices[0].logprobs.content])
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_n_choices_are_seeded_one_after_the_other(client):
    kwargs = {"model": MODEL, "prompt": "A day", "max_tokens": 8, "temperature": 1.0,
              "extra_body": {"ignore_eos": True}}
    both = client.completions.create(n=2, seed=10, **kwargs)
    second = client.completions.create(seed=11, **kwargs)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[1].text == second.choices[0].text
    assert both.usage.completion_tokens == 16


def test_stop_string_cuts_the_text(client):
    free = client.completions.create(model=MODEL, prompt="The", max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[len(free) // 2:len(free) // 2 + 3]
    cut = client.completions.create(model=MODEL, prompt="The", max_tokens=16, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free[:free.index(stop)]
    # Streamed, no part of the stop string may leak out before the match is known.
    chunks = list(client.completions.create(model=MODEL, prompt="The", max_tokens=16,
                                            temperature=0, stop=[stop], stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == cut.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_null_fields_mean_defaults(url):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": None, "temperature": None,
            "top_p": None, "n": None, "seed": None, "logprobs": None, "stop": None}
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 16


def test_score(url):
    body = {"model": MODEL, "token_ids": [5, 6, 7, 8, 9], "start": 2}
    out = httpx.post(f"{url}/v1/score", json=body).json()
    assert out["token_ids"] == body["token_ids"] and out["start"] == 2
    assert len(out["logprobs"]) == 3 and all(lp <= 0 for lp in out["logprobs"])
    assert out["system_fingerprint"].startswith("fp_")


LONG = [5] * 300
BAD_INPUT = [
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, "model"),
    ("/v1/completions", {"prompt": "hi"}, "model"),
    ("/v1/completions", {"model": MODEL, "prompt": LONG}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 1000}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": 123}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**8]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "echo": True, "stream": True}, "echo"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True, "prompt_logprobs": 1},
     "prompt_logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 1.0},
     "presence_penalty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
     "messages.0.role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
     "model"),
    ("/v1/score", {"model": MODEL, "token_ids": [5, 6], "start": 0}, "start"),
    ("/v1/score", {"model": MODEL, "token_ids": [5, 6], "start": 2}, "start"),
    ("/v1/score", {"model": MODEL, "token_ids": [5]}, "token_ids"),
    ("/v1/score", {"model": "nope", "token_ids": [5, 6]}, "model"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_INPUT)
def test_bad_input_is_a_400_in_the_openai_shape(url, path, body, param):
    r = httpx.post(f"{url}{path}", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param)


@pytest.mark.parametrize("raw", [b"{bad json", b"", b"[1, 2]", b"null"])
def test_malformed_body_is_a_400(url, raw):
    r = httpx.post(f"{url}/v1/completions", content=raw,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_route_is_a_404_in_the_openai_shape(url):
    r = httpx.get(f"{url}/v1/nothing")
    assert r.status_code == 404 and "message" in r.json()["error"]


def test_engine_keeps_serving_after_bad_input(client):
    for _ in range(3):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text


def test_stream_disconnect_aborts_and_frees(url):
    body = {"model": MODEL, "prompt": "Go on", "max_tokens": 240, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break  # leave mid-stream: the connection closes
    wait_idle(url)
    assert aborted(url) >= 1


def test_non_stream_disconnect_aborts_and_frees(url):
    body = {"model": MODEL, "prompt": "Go on", "max_tokens": 240, "ignore_eos": True, "n": 2}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    wait_idle(url)
    assert aborted(url) >= 2


def test_model_card_advertises_what_a_gateway_checks(url):
    (card,) = httpx.get(f"{url}/v1/models").json()["data"]
    assert card["max_model_len"] == 256 and card["max_num_seqs"] == 64
    assert card["vocab_size"] >= 2048 and card["max_token_chars"] > 1
    # Every field the worker refuses unless neutral (the contract's list).
    assert card["unsupported_parameters"] == sorted(UNSUPPORTED)
    assert {"presence_penalty", "frequency_penalty"} <= set(card["unsupported_parameters"])
    # The card's bound holds: no token's text is longer.
    out = httpx.post(f"{url}/v1/completions", json={
        "model": MODEL, "prompt": "Go on", "max_tokens": 64, "ignore_eos": True,
        "logprobs": 0}).json()
    assert max(map(len, out["choices"][0]["logprobs"]["tokens"])) < card["max_token_chars"]


def test_abort_request_answers_a_whole_request_with_its_tokens_so_far(url):
    """The gateway's way to stop a non-streamed request whose client left: the request
    answers at once with the tokens generated until then, finish_reason "abort"."""
    before = aborted(url)
    # The counter is the worker's since its start (earlier tests add to it): 4 tokens more
    # are two decode steps of this request's 2 sequences, so each choice has tokens to keep.
    tokens_before = gauge(url, "detgate_worker_generated_tokens_total")
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{url}/v1/completions", json={
            "model": MODEL, "prompt": "Go on", "max_tokens": 240, "ignore_eos": True,
            "return_token_ids": True, "n": 2}, headers={"X-Request-Id": "cmpl-abort-me"},
            timeout=60)
        deadline = time.monotonic() + 30
        while gauge(url, "detgate_worker_generated_tokens_total") < tokens_before + 4 or \
                (r := httpx.post(f"{url}/abort_request", json={"rid": "cmpl-abort-me"})
                 ).status_code == 404:
            assert time.monotonic() < deadline and not pending.done()
            time.sleep(0.02)
        assert r.json() == {"aborted": True}
        answer = pending.result()
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    assert [c["finish_reason"] for c in choices] == ["abort", "abort"]
    assert all(0 < len(c["token_ids"]) < 240 for c in choices)
    assert answer.json()["usage"]["completion_tokens"] == sum(len(c["token_ids"])
                                                              for c in choices)
    wait_idle(url)
    assert aborted(url) >= before + 2
    gone = httpx.post(f"{url}/abort_request", json={"rid": "cmpl-abort-me"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found_error"


def test_metrics_show_batches(url, client):
    client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    text = httpx.get(f"{url}/metrics").text
    for name in ("detgate_worker_batch_size_seqs_bucket", "detgate_worker_batch_size_tokens_bucket",
                 "detgate_worker_generated_tokens_total",
                 "detgate_worker_generation_tokens_per_second", "detgate_worker_requests_waiting"):
        assert name in text
