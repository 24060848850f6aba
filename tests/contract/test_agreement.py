"""`/replay`, the audit and the engine experiment judge the same pair of answers alike: each
takes its answers its own way (the gateway's record choices, the audit's samples, the
experiment's completions) and compares them with the contract's one comparison.

The pairs include the cases `==` gets wrong for logprobs: -0.0 against 0.0 (equal by `==`,
different bits) and NaN (different by `==`, the same bits)."""

from __future__ import annotations

import math

import pytest

from detgate.audit.client import parse_response
from detgate.contract.analysis import analyse
from detgate.contract.compare import compare_choices
from detgate.gateway import responses
from detgate.worker.engine.offline import Completion, determinism_measures


def answer(ids: list[int], logprobs: list[float]) -> dict:
    """A completions answer as a worker sends it (vLLM's shape, with token ids)."""
    tokens = [f"t{i}" for i in ids]
    return {"id": "cmpl-x", "object": "text_completion", "model": "m", "choices": [{
        "index": 0, "text": "".join(tokens), "finish_reason": "length", "token_ids": ids,
        "logprobs": {"tokens": tokens, "token_logprobs": logprobs,
                     "top_logprobs": [{t: lp} for t, lp in zip(tokens, logprobs, strict=True)],
                     "text_offset": list(range(len(ids)))}}]}


def replay_verdict(original: dict, replay: dict) -> dict:
    # What POST /replay does: both answers as record choices, then the comparison.
    cmp = compare_choices(responses.record_choices(False, original),
                          responses.record_choices(False, replay))
    return {"match": cmp.match, "first_divergence": cmp.first_divergence,
            "max_abs_logprob_diff": cmp.max_abs_logprob_diff}


def audit_verdict(original: dict, replay: dict) -> dict:
    analysis = analyse([parse_response(original, "completions", 0),
                        parse_response(replay, "completions", 1)])
    (c,) = analysis.comparisons
    return {"match": analysis.exact_matches == 2, "first_divergence": c.first_divergence,
            "max_abs_logprob_diff": analysis.max_abs_logprob_diff}


def experiment_verdict(original: dict, replay: dict) -> dict:
    def completion(a: dict) -> Completion:
        c = a["choices"][0]
        return Completion(c["token_ids"], c["logprobs"]["token_logprobs"], [1])

    m = determinism_measures([completion(original), completion(replay)])
    return {"match": m["most_common_exact_count"] == 2,
            "first_divergence": (m["first_divergence"] or [None])[0],
            "max_abs_logprob_diff": m["max_abs_logprob_diff"]}


# (name, original, replay, expected match, expected first divergence, expected max |diff|)
PAIRS = [
    ("identical", answer([1, 2, 3], [-0.5, -1.0, -2.0]), answer([1, 2, 3], [-0.5, -1.0, -2.0]),
     True, None, 0.0),
    ("negative zero", answer([1, 2], [0.0, -1.0]), answer([1, 2], [-0.0, -1.0]),
     False, None, 0.0),
    ("the same NaN", answer([1, 2], [math.nan, -1.0]), answer([1, 2], [math.nan, -1.0]),
     True, None, 0.0),
    ("NaN against a number", answer([1, 2], [math.nan, -1.0]), answer([1, 2], [-0.25, -1.0]),
     False, None, 0.0),
    ("one ulp", answer([1, 2], [-0.5, -1.0]), answer([1, 2], [-0.5, math.nextafter(-1.0, 0)]),
     False, None, 1.0 - -math.nextafter(-1.0, 0)),
    ("token flip", answer([1, 2, 3], [-0.5, -1.0, -2.0]), answer([1, 9, 3], [-0.75, -3.0, -2.0]),
     False, 1, 0.25),
]


@pytest.mark.parametrize("name,original,replay,match,first,max_diff", PAIRS,
                         ids=[p[0] for p in PAIRS])
def test_replay_audit_and_experiment_agree(name, original, replay, match, first, max_diff):
    want = {"match": match, "first_divergence": first, "max_abs_logprob_diff": max_diff}
    assert replay_verdict(original, replay) == want
    assert audit_verdict(original, replay) == want
    assert experiment_verdict(original, replay) == want
