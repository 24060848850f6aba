"""The record's one shape (detgate/contract/record.py): what is stored is what is read back."""

from __future__ import annotations

import orjson

from detgate.contract.record import Record, RecordChoice


def test_a_record_round_trips_through_json_with_its_logprob_bits():
    rec = Record(id="chatcmpl-1", created=1.5, endpoint="/v1/chat/completions", model="m",
                 request={"model": "m", "seed": 3}, worker="http://w", system_fingerprint="fp_1",
                 status="complete",
                 choices=[RecordChoice(0, "hi", "stop", [1, 2], [-0.0, -2.5e-300])],
                 usage={"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3})
    stored = orjson.loads(orjson.dumps(rec.as_dict()))
    assert "error" not in stored and "replays" not in stored
    back = Record.from_dict(stored)
    assert back == rec
    assert str(back.choices[0].logprobs[0]) == "-0.0"


def test_optional_fields_appear_only_when_set():
    rec = Record(id="cmpl-1", created=1.0, endpoint="/v1/completions", model="m", request={},
                 worker=None, system_fingerprint=None, status="failed", choices=[],
                 error="worker failed")
    assert rec.as_dict()["error"] == "worker failed"
    assert "tokens" not in RecordChoice(0).as_dict()
    assert RecordChoice(0, tokens=["a"]).as_dict()["tokens"] == ["a"]


def test_the_machine_is_kept_and_records_without_it_still_load():
    """`machine` (the answering worker's CPU, threads, versions) round-trips; a record stored
    before it existed loads as it was and is written back without it."""
    machine = {"cpu": "AMD EPYC", "torch_threads": 2, "isa_class": "x86-64 avx2+fma"}
    rec = Record(id="cmpl-2", created=2.0, endpoint="/v1/completions", model="m",
                 request={"model": "m"}, worker="http://w", system_fingerprint="fp_2",
                 status="complete", choices=[RecordChoice(0, "a", "stop", [5], [-1.0])],
                 machine=machine)
    assert Record.from_dict(orjson.loads(orjson.dumps(rec.as_dict()))).machine == machine
    old = {"id": "cmpl-3", "created": 3.0, "endpoint": "/v1/completions", "model": "m",
           "request": {"model": "m"}, "worker": "http://w", "system_fingerprint": "fp_3",
           "status": "complete", "choices": [{"index": 0, "text": "a", "finish_reason": "stop",
                                              "token_ids": [5], "logprobs": [-1.0]}],
           "usage": None}
    back = Record.from_dict(old)
    assert back.machine is None
    assert back.as_dict() == old
