"""Live weight updates behind a real gateway and Redis: under concurrent load no record mixes
two weight versions (each record equals, bit for bit, a fresh worker on the weights its
fingerprint names), requests aborted by an update are recorded `aborted`, the gateway follows
the new fingerprint without a restart, /replay of a record made before the update answers 409
saying no worker has its weights, and the gateway has no route to the admin endpoint."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from detgate.contract.compare import compare_choices
from detgate.contract.constants import UPDATE_WEIGHTS_PATH, WEIGHTS_UPDATED
from detgate.contract.record import Record
from detgate.gateway import protocol, responses
from tests.support.weights import MODEL, TOKEN, fingerprint, start_worker, update_worker


@pytest.fixture(scope="module")
def worker(tiny_model, tmp_path_factory):
    proc = start_worker(tiny_model, tmp_path_factory.mktemp("updatable"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def gw(start_gateway_module, worker):
    return start_gateway_module([worker.url])


def body(i: int, max_tokens: int) -> tuple[str, dict]:
    """Request i of a load: chat or completion, streamed or not, greedy or a seeded draw."""
    sampling = {"temperature": 0} if i % 3 else {"temperature": 1.0, "seed": i}
    words = " ".join(["river", "town", "bridge", "story", "sea"][: 1 + i % 5])
    req = {"model": MODEL, "max_tokens": max_tokens + i % 7, "stream": i % 2 == 0, **sampling}
    if i % 4 < 2:
        return protocol.CHAT, {**req, "messages": [{"role": "user", "content": f"{i} {words}"}]}
    return protocol.COMPLETIONS, {**req, "prompt": f"{i} {words}"}


def send(gw, endpoint: str, req: dict) -> str:
    """The record id of one request through the gateway (whatever its outcome)."""
    with httpx.Client(base_url=gw.url, timeout=120) as http:
        if not req["stream"]:
            return http.post(endpoint, json=req).headers["X-Detgate-Record-Id"]
        with http.stream("POST", endpoint, json=req) as r:
            for _ in r.iter_lines():
                pass
            return r.headers["X-Detgate-Record-Id"]


def running(worker_url: str) -> float:
    """The worker's requests admitted and running, from its /metrics."""
    text = httpx.get(worker_url + "/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("detgate_worker_requests_running "))
    return float(line.split()[1])


def wave(gw, first: int, n: int, max_tokens: int, during=None, worker_url: str = "") -> list[str]:
    """n concurrent requests; `during()` runs once the worker runs some of them (waited for, not
    slept: on a loaded machine the requests may take seconds to arrive)."""
    ids: list[str] = []
    threads = [threading.Thread(target=lambda i=i: ids.append(send(gw, *body(i, max_tokens))))
               for i in range(first, first + n)]
    for t in threads:
        t.start()
    if during is not None:
        deadline = time.monotonic() + 60
        while running(worker_url) < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        during()
    for t in threads:
        t.join()
    return ids


def records(gw, ids: list[str]) -> list[dict]:
    with gw.http() as http:
        return [http.get(f"/v1/requests/{rid}").json() for rid in ids]


def matches(record: dict, url: str) -> bool:
    """Whether the worker at `url` gives the record's tokens and logprobs bit for bit."""
    rec = Record.from_dict(record)
    r = httpx.post(url + rec.endpoint, json=protocol.replay_body(rec.request), timeout=120)
    r.raise_for_status()
    again = responses.record_choices(rec.endpoint == protocol.CHAT, r.json())
    return compare_choices(rec.choices, again).match


def test_an_update_under_load_never_yields_a_record_that_mixes_versions(
        gw, worker, fresh_workers, tiny_model, tiny_model_b):
    fp = {fingerprint(p.url): key for key, p in fresh_workers.items()}
    assert fingerprint(worker.url) in fp and fp[fingerprint(worker.url)] == "a"
    updates: list[dict] = []

    def to(model, abort: bool = False):
        return lambda: updates.append(update_worker(worker.url, model, abort=abort).json())

    before = wave(gw, 0, 4, 16)
    during = wave(gw, 4, 10, 40, during=to(tiny_model_b), worker_url=worker.url)
    on_b = wave(gw, 14, 4, 16)
    aborting = wave(gw, 18, 6, 400, during=to(tiny_model, abort=True), worker_url=worker.url)
    after = wave(gw, 24, 4, 16)
    assert updates[0]["num_finished_requests"] > 0 and updates[1]["num_aborted_requests"] > 0

    checked = 0
    for group, expected in ((before, {"a"}), (during, {"a", "b"}), (on_b, {"b"}),
                            (aborting, {"a", "b"}), (after, {"a"})):
        for rec in records(gw, group):
            if rec["status"] == "aborted":
                assert group is aborting and "weights were updated" in rec["error"], rec
                continue
            assert rec["status"] == "complete", rec
            key = fp[rec["system_fingerprint"]]
            assert key in expected
            assert matches(rec, fresh_workers[key].url), rec["id"]
            checked += 1
    assert checked >= 18
    assert sum(r["status"] == "aborted" for r in records(gw, aborting)) > 0
    # Negative control: a record checked against the other weights would be caught.
    assert not any(matches(rec, fresh_workers["b"].url) for rec in records(gw, before))


def test_an_aborted_request_is_recorded_and_answered_as_such(gw, worker, fresh_workers,
                                                              tiny_model, tiny_model_b):
    result: dict = {}
    req = {"model": MODEL, "prompt": "A long story", "max_tokens": 1500, "temperature": 0}

    def long() -> None:
        with httpx.Client(base_url=gw.url, timeout=120) as http:
            result["response"] = http.post(protocol.COMPLETIONS, json=req)

    t = threading.Thread(target=long)
    t.start()
    time.sleep(1.0)
    on_a = fingerprint(worker.url) == fingerprint(fresh_workers["a"].url)
    update = update_worker(worker.url, tiny_model_b if on_a else tiny_model, abort=True)
    assert update.status_code == 200 and update.json()["num_aborted_requests"] == 1
    t.join()
    r = result["response"]
    assert r.status_code == 409 and r.json()["error"]["code"] == WEIGHTS_UPDATED
    [rec] = records(gw, [r.headers["X-Detgate-Record-Id"]])
    assert rec["status"] == "aborted" and "weights were updated" in rec["error"]


def test_the_gateway_follows_the_update_and_refuses_replays_of_old_weights(
        gw, worker, fresh_workers, tiny_model, tiny_model_b):
    fp_a, fp_b = (fingerprint(fresh_workers[k].url) for k in "ab")
    if fingerprint(worker.url) != fp_a:
        assert update_worker(worker.url, tiny_model).status_code == 200
    client = gw.client()
    old = client.completions.create(model=MODEL, prompt="Before", max_tokens=6, temperature=0)
    assert old.system_fingerprint == fp_a
    assert update_worker(worker.url, tiny_model_b).status_code == 200
    new = client.completions.create(model=MODEL, prompt="After", max_tokens=6, temperature=0)
    assert new.system_fingerprint == fp_b
    with gw.http() as http:
        # The gateway routes by the new fingerprint (no restart): a replay of a new record
        # and a score pinned to it are served.
        deadline = time.monotonic() + 10
        while (r := http.post(f"/replay/{new.id}", json={})).status_code != 200:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.1)
        assert r.json()["match"] and r.json()["replay_fingerprint"] == fp_b
        score = {"model": MODEL, "token_ids": [5, 80, 200, 31], "system_fingerprint": fp_b}
        assert http.post("/v1/score", json=score).status_code == 200
        # A record made on the old weights has no worker left.
        refused = http.post(f"/replay/{old.id}", json={})
        assert refused.status_code == 409, refused.text
        message = refused.json()["error"]["message"]
        assert f"no healthy worker has fingerprint {fp_a}" in message and fp_b in message
        assert http.post("/v1/score", json={**score, "system_fingerprint": fp_a}
                         ).status_code == 409


@pytest.mark.parametrize("path", [UPDATE_WEIGHTS_PATH, "/v1" + UPDATE_WEIGHTS_PATH])
def test_the_gateway_has_no_route_to_the_admin_endpoint(gw, worker, tiny_model_b, path):
    before = fingerprint(worker.url)
    r = httpx.post(gw.url + path, json={"model_path": str(tiny_model_b)},
                   headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 404 and "error" in r.json()
    assert fingerprint(worker.url) == before
