"""Structured output in the engine (worker/engine/constraint.py, worker/model/grammar.py), in
process on the tiny model: a grammar's mask is applied row by row, so a constrained request
gets the same bits alone and in any batch (batch_invariant), its answer follows the grammar,
and /v1/score under the same mask reproduces its sampled logprobs bit for bit. Negative
control: with the split-K matmul (tests/support/controls.py) the same needle differs between
alone and in the batch, on any CPU.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.constraint import Constraint, apply_masks, fill_masks, mask_words
from detgate.worker.engine.engine import Engine
from detgate.worker.engine.sequence import SamplingParams
from detgate.worker.model.grammar import GrammarCompiler
from detgate.worker.model.loader import load
from detgate.worker.server.protocol import ResponseFormat
from detgate.worker.server.structured import structure
from tests.support.controls import SplitKOps, use_ops
from tests.support.floats import bits

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                         "rank": {"type": "integer", "minimum": 0, "maximum": 99},
                         "ok": {"type": "boolean"}},
          "required": ["city", "rank", "ok"], "additionalProperties": False}

_loaded: dict = {}


def loaded(tiny_model, control: bool = False):
    if control not in _loaded:
        model = load(tiny_model, dtype="float32", device="cpu", mode="batch_invariant")
        if control:
            use_ops(model.model, SplitKOps())
        _loaded[control] = model
    return _loaded[control]


def grammar(tiny_model, schema=SCHEMA):
    m = loaded(tiny_model)
    compiler = GrammarCompiler(m.tokenizer, m.config.vocab_size)
    fmt = ResponseFormat.model_validate({"type": "json_schema",
                                         "json_schema": {"name": "s", "schema": schema}})
    return structure(compiler, fmt, None, None, True).grammar


def engine(tiny_model, control: bool = False, **overrides) -> Engine:
    m = loaded(tiny_model, control)
    config = EngineConfig(model=str(tiny_model), mode="batch_invariant", **overrides)
    return Engine(config, m.model, m.config)


def run(eng: Engine, reqs: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """request id -> [(token id, logprob bits)]"""
    for rid, (ids, params) in reqs.items():
        eng.add(rid, ids, params)
    out: dict[str, list] = {rid: [] for rid in reqs}
    while eng.has_work():
        for o in eng.step()[0]:
            out[o.request_id].extend((t.token_id, bits([t.logprob])[0]) for t in o.new_tokens)
    return out


def constrained(tiny_model, **kw) -> SamplingParams:
    eos = tuple(loaded(tiny_model).config.eos_token_ids)
    return SamplingParams(max_tokens=40, logprobs=0,
                          constraint=Constraint(grammar(tiny_model), 0, eos), **kw)


def fillers(tiny_model, n: int, seed: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """Traffic of random lengths, every third request constrained too (seeded sampling)."""
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        ids = [rng.randrange(3, 2000) for _ in range(rng.randrange(3, 90))]
        params = (constrained(tiny_model, temperature=0.9, seed=i) if i % 3 == 0
                  else SamplingParams(max_tokens=rng.randrange(2, 20), logprobs=0,
                                      ignore_eos=True))
        out[f"f{i}"] = (ids, params)
    return out


NEEDLE = [(11 * k) % 1900 + 40 for k in range(23)]


def needle_alone_and_crowded(tiny_model, control: bool) -> tuple[list, list, list]:
    greedy, seeded = constrained(tiny_model), constrained(tiny_model, temperature=0.8, seed=5)
    alone = run(engine(tiny_model, control), {"g": (NEEDLE, greedy), "s": (NEEDLE, seeded)})
    crowd = fillers(tiny_model, 20, seed=3)
    reqs = dict(list(crowd.items())[:9]) | {"g": (NEEDLE, greedy)} \
        | dict(list(crowd.items())[9:]) | {"s": (NEEDLE, seeded)}
    crowded = run(engine(tiny_model, control), reqs)
    return alone, crowded, crowded["g"]


def test_a_constrained_request_is_bit_identical_alone_and_in_a_batch(tiny_model):
    alone, crowded, _ = needle_alone_and_crowded(tiny_model, control=False)
    for rid in ("g", "s"):
        assert alone[rid] == crowded[rid]
    text = loaded(tiny_model).tokenizer.decode([t for t, _ in alone["g"]])
    doc = json.loads(text)  # the grammar held: valid JSON of the schema, whatever the weights
    assert set(doc) == {"city", "rank", "ok"} and doc["city"] in ("Paris", "Rome", "Oslo")


def test_negative_control_split_k_moves_the_constrained_needle(tiny_model):
    alone, crowded, _ = needle_alone_and_crowded(tiny_model, control=True)
    assert any(alone[rid] != crowded[rid] for rid in ("g", "s"))


def test_async_scheduling_gives_a_constrained_request_the_same_bits(tiny_model):
    reqs = fillers(tiny_model, 10, seed=8) | {"g": (NEEDLE, constrained(tiny_model))}
    assert run(engine(tiny_model, async_scheduling=True), reqs) == run(engine(tiny_model), reqs)


def test_score_under_the_mask_equals_the_sampled_logprobs(tiny_model):
    params = constrained(tiny_model)
    sampled = run(engine(tiny_model), {"g": (NEEDLE, params)})["g"]
    full = NEEDLE + [t for t, _ in sampled]
    eng = engine(tiny_model)
    eng.add("s", full, SamplingParams(max_tokens=0, prompt_logprobs=0, single_pass=True,
                                      constraint=params.constraint, score_start=len(NEEDLE)))
    scored = None
    while eng.has_work():
        for o in eng.step()[0]:
            scored = o.prompt_logprobs
    tail = [t.logprob for t in scored[len(NEEDLE) - 1:]]
    assert bits(tail) == tuple(lp for _, lp in sampled)
    # Unmasked, the same tokens score differently (the mask renormalises): the check can fail.
    eng.add("u", full, SamplingParams(max_tokens=0, prompt_logprobs=0, single_pass=True))
    while eng.has_work():
        for o in eng.step()[0]:
            scored = o.prompt_logprobs
    assert bits([t.logprob for t in scored[len(NEEDLE) - 1:]]) != tuple(lp for _, lp in sampled)


def test_apply_masks_is_exact_and_row_local():
    torch.manual_seed(0)
    logits = torch.randn(4, 70)
    before = logits.clone()
    words = mask_words(70)
    bitmask = torch.zeros(2, words, dtype=torch.int32)
    bitmask[0, 0] = 0b1011  # tokens 0, 1, 3
    bitmask[1, 2] = 1 << 3  # token 67
    apply_masks(logits, torch.tensor([1, 3]), bitmask)
    assert torch.equal(logits[[0, 2]].view(torch.int32), before[[0, 2]].view(torch.int32))
    for row, kept in ((1, [0, 1, 3]), (3, [67])):
        assert torch.equal(logits[row, kept].view(torch.int32), before[row, kept].view(torch.int32))
        others = [t for t in range(70) if t not in kept]
        assert torch.isneginf(logits[row, others]).all()


def test_min_tokens_bans_the_stop_tokens_until_reached():
    state = Constraint(None, 2, (5, 31, 32)).state()
    bitmask = fill_masks([(state, ())], mask_words(64))
    allowed = {t for t in range(64) if bitmask[0, t // 32] >> (t % 32) & 1}
    assert allowed == set(range(64)) - {5, 31, 32}
    state.accept(7)
    state.accept(8)
    assert fill_masks([(state, ())], mask_words(64)).eq(-1).all()


def test_seeded_constrained_sampling_repeats(tiny_model):
    params = dataclasses.replace(constrained(tiny_model), temperature=1.0, seed=42)
    first = run(engine(tiny_model), {"a": (NEEDLE, params)})["a"]
    assert first == run(engine(tiny_model), {"a": (NEEDLE, params)})["a"]
