"""The gateway in front of real built-in workers, with the openai SDK as the client.

Two batch-invariant workers serve the first tests (answers and records, replays, an
abandoned stream, then a worker killed and restarted); one default-mode worker serves the
negative control, which must see replays differ.
"""

from __future__ import annotations

import threading
import time

import httpx
import orjson
import pytest

from tests.support.floats import bits
from tests.support.procs import Proc

MSG = [{"role": "user", "content": "Tell me about Richard Feynman."}]


@pytest.fixture(scope="module")
def workers(start_workers_module):
    return start_workers_module(["batch_invariant", "batch_invariant"])


@pytest.fixture(scope="module")
def gw(start_gateway_module, workers):
    return start_gateway_module([w.url for w in workers])


@pytest.fixture(scope="module")
def model(gw):
    return gw.client().models.list().data[0].id


def direct(worker_url: str, rec: dict) -> dict:
    """The recorded request sent straight to a worker (not streamed), its choices' view."""
    body = {**rec["request"], "stream": False}
    body.pop("stream_options", None)
    r = httpx.post(worker_url + rec["endpoint"], json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = []
    for c in r.json()["choices"]:
        lp = c["logprobs"]
        lps = ([e["logprob"] for e in lp["content"]] if "content" in lp
               else lp["token_logprobs"])
        out.append((c["token_ids"], lps))
    return out


def assert_record_is_the_workers_answer(rec: dict) -> None:
    assert rec["status"] == "complete"
    assert rec["system_fingerprint"].startswith("fp_")
    again = direct(rec["worker"], rec)
    assert len(again) == len(rec["choices"])
    for choice, (ids, lps) in zip(rec["choices"], again, strict=True):
        assert choice["token_ids"] == ids and len(ids) > 0
        assert bits(choice["logprobs"]) == bits(lps)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
def test_chat_answers_and_records(gw, model, stream, logprobs):
    kw = {"logprobs": True, "top_logprobs": 2} if logprobs else {}
    client = gw.client()
    if stream:
        chunks = list(client.chat.completions.create(
            model=model, messages=MSG, max_tokens=12, stream=True, **kw))
        rid = chunks[0].id
        assert all(c.id == rid and c.system_fingerprint for c in chunks)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        got_lps = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
                   for e in c.choices[0].logprobs.content]
        fingerprint = chunks[-1].system_fingerprint
    else:
        answer = client.chat.completions.create(model=model, messages=MSG, max_tokens=12, **kw)
        rid, text, fingerprint = answer.id, answer.choices[0].message.content, \
            answer.system_fingerprint
        assert answer.object == "chat.completion" and answer.usage.completion_tokens > 0
        got_lps = ([e.logprob for e in answer.choices[0].logprobs.content]
                   if answer.choices[0].logprobs else [])
        if logprobs:
            assert all(len(e.top_logprobs) == 2 for e in answer.choices[0].logprobs.content)
    rec = gw.record(rid)
    assert rec["id"] == rid and rec["system_fingerprint"] == fingerprint
    assert rec["choices"][0]["text"] == text
    assert isinstance(rec["request"]["seed"], int)  # sampled (default temperature): seeded
    if logprobs:
        assert bits(got_lps) == bits(rec["choices"][0]["logprobs"])
    else:
        assert got_lps == []
    assert_record_is_the_workers_answer(rec)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("logprobs", [None, 3])
def test_completion_answers_and_records(gw, model, stream, logprobs):
    client = gw.client()
    kw = {"logprobs": logprobs} if logprobs is not None else {}
    if stream:
        chunks = list(client.completions.create(
            model=model, prompt="The history of", max_tokens=10, temperature=0, n=2,
            stream=True, stream_options={"include_usage": True}, **kw))
        rid = chunks[0].id
        assert chunks[-1].usage is not None and not chunks[-1].choices
        got = {}
        for c in chunks:
            for ch in c.choices:
                if ch.logprobs:
                    got.setdefault(ch.index, []).extend(ch.logprobs.token_logprobs)
    else:
        answer = client.completions.create(model=model, prompt="The history of",
                                           max_tokens=10, temperature=0, n=2, **kw)
        rid = answer.id
        assert answer.object == "text_completion" and len(answer.choices) == 2
        got = {c.index: c.logprobs.token_logprobs for c in answer.choices if c.logprobs}
    rec = gw.record(rid)
    assert "seed" not in rec["request"]  # greedy
    assert len(rec["choices"]) == 2
    if logprobs:
        for c in rec["choices"]:
            assert bits(got[c["index"]]) == bits(c["logprobs"])
    else:
        assert got == {}
    assert_record_is_the_workers_answer(rec)


def test_listing_is_newest_first(gw, model):
    ids = [gw.client().completions.create(model=model, prompt=f"p{i}", max_tokens=2).id
           for i in range(3)]
    with gw.http() as http:
        listed = [r["id"] for r in http.get("/v1/requests?limit=3").json()["data"]]
    assert listed == ids[::-1]


def test_replays_match_on_batch_invariant_workers(gw, model):
    before = gw.metric("detgate_replays_total", result="match")
    mse_before = gw.metric("detgate_replay_logprob_mse_count")
    client = gw.client()
    greedy = client.chat.completions.create(model=model, messages=MSG, max_tokens=24,
                                            temperature=0).id
    sampled = client.completions.create(model=model, prompt="Once upon a time",
                                        max_tokens=24, temperature=1.0).id
    with gw.http() as http:
        for rid in (greedy, sampled):
            for load in (0, 16):
                cmp = http.post(f"/replay/{rid}", json={"load": load}).json()
                assert cmp["match"] is True, cmp
                assert cmp["first_divergence"] is None and cmp["logprob_mse"] == 0.0
                assert cmp["max_abs_logprob_diff"] == 0.0 and cmp["load"] == load
                assert cmp["tokens_compared"] == len(gw.record(rid)["choices"][0]["token_ids"])
                assert cmp["original_fingerprint"] == cmp["replay_fingerprint"]
    assert len(gw.record(greedy)["replays"]) == 2
    assert gw.metric("detgate_replays_total", result="match") == before + 4
    assert gw.metric("detgate_replay_logprob_mse_count") == mse_before + 4


def test_client_leaving_a_stream_records_it_aborted(gw, model):
    with httpx.Client(base_url=gw.url, timeout=60) as http, http.stream(
            "POST", "/v1/completions", json={"model": model, "prompt": "Long story:",
                                             "max_tokens": 1500, "temperature": 0,
                                             "stream": True}) as r:
        rid = r.headers["x-detgate-record-id"]
        for i, _ in enumerate(r.iter_lines()):
            if i >= 3:
                break
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with gw.http() as http:
            got = http.get(f"/v1/requests/{rid}")
        if got.status_code == 200:
            break
        time.sleep(0.2)
    rec = got.json()
    assert rec["status"] == "aborted", rec
    assert 0 < len(rec["choices"][0]["token_ids"]) < 1500


def wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.2)


def test_killed_worker_is_ejected_and_returns(gw, model, workers):
    victim, survivor = workers
    results: list[tuple[int, str | None]] = []
    stop = threading.Event()

    def traffic() -> None:
        with gw.http() as http:
            while not stop.is_set():
                r = http.post("/v1/completions", json={"model": model, "prompt": "Keep going",
                                                       "max_tokens": 16})
                results.append((r.status_code, r.headers.get("x-detgate-record-id")))

    threads = [threading.Thread(target=traffic) for _ in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: len(results) >= 8)
    victim.kill()
    wait_for(lambda: gw.metric("detgate_worker_up", worker=victim.url) == 0)
    n_at_kill = len(results)
    wait_for(lambda: len(results) >= n_at_kill + 12)
    stop.set()
    for t in threads:
        t.join()

    assert results and all(code == 200 for code, _ in results), results
    for _, rid in results[n_at_kill:]:
        rec = gw.record(rid)
        assert rec["status"] == "complete" and rec["worker"] == survivor.url
        assert rec["choices"][0]["token_ids"]
    with gw.http() as http:
        recent = http.get("/v1/requests?limit=1000").json()["data"]
    answered = {rid for _, rid in results}
    for rec in recent:  # nothing is recorded complete that the client did not get
        if rec["status"] == "complete" and rec["request"].get("prompt") == "Keep going":
            assert rec["id"] in answered

    restarted = Proc(victim.args, victim.url, victim.log_path).start("/health", timeout=180)
    workers[0] = restarted
    wait_for(lambda: gw.metric("detgate_worker_up", worker=victim.url) == 1)
    seen = {gw.record(gw.client().completions.create(
        model=model, prompt=f"back {i}", max_tokens=2).id)["worker"] for i in range(6)}
    assert victim.url in seen


@pytest.fixture(scope="module")
def default_gw(start_gateway_module, start_workers_module):
    (worker,) = start_workers_module(["default"])
    return start_gateway_module([worker.url])


def test_negative_control_default_mode_replays_differ(default_gw):
    """Invariance off: replays under load must show a difference, or the test proves nothing."""
    gw = default_gw
    model = gw.client().models.list().data[0].id
    before = gw.metric("detgate_replays_total", result="diverged")
    comparisons = []
    with gw.http() as http:
        for i in range(4):
            rid = gw.client().chat.completions.create(
                model=model, messages=[{"role": "user", "content": f"Story number {i}:"}],
                max_tokens=32, temperature=0).id
            comparisons.append(http.post(f"/replay/{rid}", json={"load": 16}).json())
            if not comparisons[-1]["match"]:
                break
    diverged = [c for c in comparisons if not c["match"]]
    assert diverged, orjson.dumps(comparisons).decode()
    assert (diverged[0]["max_abs_logprob_diff"] or 0) > 0 or \
        diverged[0]["first_divergence"] is not None
    assert gw.metric("detgate_replays_total", result="diverged") == before + len(diverged)
