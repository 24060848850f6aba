"""Live weight updates on a real worker process (POST /update_weights_from_disk): afterwards it
answers exactly as a fresh worker started on the new weights (token ids and logprob bits, the
fingerprint too), from a folder and from a trainer's tensors; the prefix cache is not reused
across an update; requests in flight finish on the weights they started with, or are aborted;
bad and unauthorized updates are refused and the old weights serve on unchanged."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from detgate.contract.constants import WEIGHTS_UPDATED
from detgate.worker.tools.push_weights import update_weights
from tests.support.weights import (
    LONG_PROMPT,
    MODEL,
    PROBES,
    TOKEN,
    exact,
    fingerprint,
    probe,
    start_worker,
    update_worker,
)


@pytest.fixture(scope="module")
def worker(tiny_model, tmp_path_factory):
    proc = start_worker(tiny_model, tmp_path_factory.mktemp("updatable"))
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def expected(fresh_workers) -> dict[str, list]:
    """The probes' answers of fresh workers on each weight set, and their fingerprints."""
    return {key: probe(proc.url) for key, proc in fresh_workers.items()}


def serve(worker, fresh_workers, key: str, model) -> None:
    """Make `worker` serve weight set `key` (if it does not already)."""
    if fingerprint(worker.url) != fingerprint(fresh_workers[key].url):
        assert update_worker(worker.url, model).status_code == 200


def test_after_an_update_the_worker_answers_as_a_fresh_worker_on_the_new_weights(
        worker, fresh_workers, expected, tiny_model, tiny_model_b):
    # Negative control: the two weight sets answer differently, so equality below means
    # something.
    assert expected["a"] != expected["b"]
    serve(worker, fresh_workers, "a", tiny_model)
    assert probe(worker.url) == expected["a"]
    r = update_worker(worker.url, tiny_model_b)
    assert r.status_code == 200, r.text
    answer = r.json()
    fp_b = fingerprint(fresh_workers["b"].url)
    assert answer["success"] and answer["system_fingerprint"] == fp_b
    assert answer["previous_fingerprint"] == fingerprint(fresh_workers["a"].url) != fp_b
    assert fingerprint(worker.url) == fp_b
    assert probe(worker.url) == expected["b"]


def test_an_update_from_a_trainers_tensors_equals_a_fresh_worker(
        worker, fresh_workers, expected, tiny_model, tiny_model_b):
    serve(worker, fresh_workers, "b", tiny_model_b)
    tensors = load_file(tiny_model / "model.safetensors")
    [answer] = update_weights([worker.url], TOKEN, tensors)
    assert answer["system_fingerprint"] == fingerprint(fresh_workers["a"].url)
    assert probe(worker.url) == expected["a"]
    # The worker's own packed names (q/k/v in one tensor) name the same weights.
    b = load_file(tiny_model_b / "model.safetensors")
    for layer in range(4):
        pre = f"model.layers.{layer}.self_attn"
        b[f"{pre}.qkv_proj.weight"] = torch.cat([b.pop(f"{pre}.{n}_proj.weight") for n in "qkv"])
    [answer] = update_weights([worker.url], TOKEN, b)
    assert answer["system_fingerprint"] == fingerprint(fresh_workers["b"].url)
    assert probe(worker.url) == expected["b"]


def test_cached_prefix_blocks_are_not_reused_after_an_update(
        worker, fresh_workers, tiny_model, tiny_model_b):
    serve(worker, fresh_workers, "a", tiny_model)
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0,
            "logprobs": 0, "return_token_ids": True}

    def send(url: str) -> dict:
        return httpx.post(url + "/v1/completions", json=body, timeout=60).json()

    send(worker.url)
    # Control: the prompt's blocks are found in the cache while the weights stay.
    assert send(worker.url)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert update_worker(worker.url, tiny_model_b).status_code == 200
    after = send(worker.url)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert exact(after) == exact(send(fresh_workers["b"].url))


LONG = {"model": MODEL, "prompt": "A long story", "max_tokens": 300, "temperature": 0,
        "ignore_eos": True, "logprobs": 0, "return_token_ids": True}


def stream_in_thread(url: str, body: dict, started: threading.Event) -> dict:
    """Stream `body` in a thread; the returned dict fills with its chunks and error events."""
    result: dict = {"chunks": [], "errors": []}

    def run() -> None:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                          timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    (result["errors"] if "error" in event else result["chunks"]).append(event)
                    started.set()
        started.set()

    result["thread"] = threading.Thread(target=run)
    result["thread"].start()
    return result


def streamed(chunks: list[dict]) -> tuple[list[int], list[str]]:
    ids = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids") or []]
    lps = [lp.hex() for c in chunks for ch in c["choices"]
           for lp in (ch.get("logprobs") or {}).get("token_logprobs") or []]
    return ids, lps


def test_requests_in_flight_finish_on_their_weights_and_later_ones_wait_for_the_new(
        worker, fresh_workers, expected, tiny_model, tiny_model_b):
    serve(worker, fresh_workers, "a", tiny_model)
    fp_a, fp_b = (fingerprint(fresh_workers[k].url) for k in "ab")
    started = threading.Event()
    long = stream_in_thread(worker.url, LONG, started)
    assert started.wait(60)
    answer: dict = {}

    def update_to_b() -> None:
        answer.update(update_worker(worker.url, tiny_model_b).json())

    updating = threading.Thread(target=update_to_b)
    updating.start()
    time.sleep(0.5)  # the update waits for the long request; this one arrives meanwhile
    assert long["thread"].is_alive(), "the long request ended before the update came"
    path, body = PROBES[0]
    later = httpx.post(worker.url + path, json={"model": MODEL, **body}, timeout=120).json()
    updating.join()
    long["thread"].join()
    assert answer["num_finished_requests"] >= 1 and answer["num_aborted_requests"] == 0
    assert not long["errors"]
    assert {c["system_fingerprint"] for c in long["chunks"]} == {fp_a}
    reference = httpx.post(fresh_workers["a"].url + "/v1/completions", json=LONG,
                           timeout=120).json()["choices"][0]
    assert streamed(long["chunks"]) == (reference["token_ids"],
                                        [lp.hex() for lp in reference["logprobs"]
                                         ["token_logprobs"]])
    assert later["system_fingerprint"] == fp_b and exact(later) == expected["b"][0]


def test_abort_all_requests_ends_requests_in_flight_with_a_clear_error(
        worker, fresh_workers, expected, tiny_model, tiny_model_b):
    serve(worker, fresh_workers, "b", tiny_model_b)
    started = threading.Event()
    long = stream_in_thread(worker.url, {**LONG, "max_tokens": 1500}, started)
    whole: dict = {}
    blocking = threading.Thread(target=lambda: whole.update(response=httpx.post(
        worker.url + "/v1/completions", json={**LONG, "max_tokens": 1500}, timeout=120)))
    blocking.start()
    assert started.wait(60)
    time.sleep(0.3)  # both requests are in the engine
    r = update_worker(worker.url, tiny_model, abort=True)
    long["thread"].join(30)
    blocking.join(30)
    assert r.status_code == 200 and r.json()["num_aborted_requests"] == 2
    [error] = long["errors"]
    assert error["error"]["code"] == WEIGHTS_UPDATED and "weights" in error["error"]["message"]
    assert {c["system_fingerprint"] for c in long["chunks"]} == {fingerprint(
        fresh_workers["b"].url)}
    refused = whole["response"]
    assert refused.status_code == 409 and refused.json()["error"]["code"] == WEIGHTS_UPDATED
    assert probe(worker.url) == expected["a"]


def _bad_folder(tmp_path, tiny_model, change) -> str:
    """A copy of the demo checkpoint with `change(tensors, folder)` applied to its tensors (or
    a path returned by it); the path to update from."""
    folder = tmp_path / "bad"
    shutil.copytree(tiny_model, folder)
    tensors = load_file(tiny_model / "model.safetensors")
    target = change(tensors, folder)
    if not isinstance(target, Path):
        save_file(tensors, folder / "model.safetensors")
    return str(target if isinstance(target, Path) else folder)


def _truncated(tensors, folder):
    file = folder / "model.safetensors"
    save_file(tensors, file)
    data = file.read_bytes()
    file.write_bytes(data[:-1000])
    return folder


def _not_safetensors(tensors, folder):
    (folder / "model.safetensors").write_text("this is not a checkpoint")
    return folder


def _other_config(tensors, folder):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))


NORM = "model.norm.weight"
UP2 = "model.layers.2.mlp.up_proj.weight"
Q0 = "model.layers.0.self_attn.q_proj.weight"
BAD = {  # case -> (the change, the error code, what the message must name)
    "unknown tensor": (lambda t, f: t.update({"model.layers.0.extra.weight": torch.zeros(2)}),
                       "unknown_tensor", "model.layers.0.extra.weight"),
    "wrong shape": (lambda t, f: t.update({NORM: t[NORM][:-1].clone()}), "shape_mismatch", NORM),
    "wrong dtype": (lambda t, f: t.update({NORM: t[NORM].double()}), "dtype_mismatch", NORM),
    "integer dtype": (lambda t, f: t.update({UP2: t[UP2].to(torch.int32)}), "dtype_mismatch",
                      UP2),
    "missing tensor": (lambda t, f: t.pop(UP2), "missing_tensors", UP2),
    "given twice": (lambda t, f: t.update({"model.layers.0.self_attn.qkv_proj.weight":
                                           torch.zeros(384, 256)}), "duplicate_tensor", Q0),
    "truncated file": (_truncated, "truncated_file", ""),  # the last tensor in the file
    "not safetensors": (_not_safetensors, "bad_file", "model.safetensors"),
    "no such path": (lambda t, f: f / "nowhere", "weights_not_found", "nowhere"),
    "other config": (_other_config, "config_mismatch", "rms_norm_eps"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_update_is_refused_and_the_old_weights_keep_serving(
        case, worker, fresh_workers, tiny_model, tmp_path):
    serve(worker, fresh_workers, "a", tiny_model)
    before, fp = probe(worker.url), fingerprint(worker.url)
    change, code, named = BAD[case]
    r = update_worker(worker.url, _bad_folder(tmp_path, tiny_model, change))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == code and named in error["message"], error
    if error["param"] != "model_path":
        assert error["param"] in error["message"]
    assert "the old ones keep serving" in error["message"]
    assert fingerprint(worker.url) == fp
    assert probe(worker.url) == before


def test_updates_need_the_admin_token(worker, fresh_workers, tiny_model_b):
    fp = fingerprint(worker.url)
    for token in (None, "wrong", f"{TOKEN}x"):
        r = update_worker(worker.url, tiny_model_b, token=token)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    basic = httpx.post(worker.url + "/update_weights_from_disk", json={"model_path": "x"},
                       headers={"Authorization": f"Basic {TOKEN}"})
    assert basic.status_code == 401
    # Without a token configured, updates are off altogether.
    off = update_worker(fresh_workers["a"].url, tiny_model_b)
    assert off.status_code == 403 and "disabled" in off.json()["error"]["message"]
    assert fingerprint(worker.url) == fp


def _spec(**change) -> dict:
    """A well-formed description of one shared tensor (as weight_ipc.share writes it), with
    handles that open nothing."""
    return {"name": NORM, "dtype": "float32", "shape": [256], "stride": [1], "offset": 0,
            "device": 0, "handle": "AAAA", "storage_bytes": 1024, "storage_offset_bytes": 0,
            "ref_counter_handle": "AAAA", "ref_counter_offset": 0, "event_handle": None,
            "event_sync_required": False, **change}


@pytest.mark.parametrize("case", ["cpu worker", "extra field", "missing field", "no tensors",
                                  "string for an int", "unauthorized"])
def test_shared_tensor_updates_are_refused_where_they_cannot_be_read(
        case, worker, fresh_workers, tiny_model):
    """POST /update_weights_from_tensor carries CUDA IPC handles: a CPU worker refuses them
    with `ipc_unavailable` (push_weights then writes the file), a malformed body is a 400, no
    token a 401; the old weights keep serving in every case. (The update itself: the GPU
    test, tests/worker/test_gpu_weight_update.py.)"""
    serve(worker, fresh_workers, "a", tiny_model)
    before, fp = probe(worker.url), fingerprint(worker.url)
    body = {"tensors": [_spec()]}
    status, code = 400, "ipc_unavailable"
    if case == "extra field":
        body["tensors"] = [_spec(pickle="x")]
        code = None
    elif case == "missing field":
        spec = _spec()
        del spec["handle"]
        body["tensors"], code = [spec], None
    elif case == "no tensors":
        body["tensors"], code = [], None
    elif case == "string for an int":
        body["tensors"], code = [_spec(offset="0")], None
    headers = {} if case == "unauthorized" else {"Authorization": f"Bearer {TOKEN}"}
    if case == "unauthorized":
        status, code = 401, None
    r = httpx.post(worker.url + "/update_weights_from_tensor", json=body, headers=headers,
                   timeout=30)
    assert r.status_code == status, r.text
    if code:
        error = r.json()["error"]
        assert error["code"] == code and "handoff file" in error["message"], error
    assert fingerprint(worker.url) == fp
    assert probe(worker.url) == before
