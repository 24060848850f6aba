"""Serving a choice (worker/server/generation.py): incremental detokenisation (O(length) decoding,
partial UTF-8 held back, stop strings across token boundaries) and one choice served without
merging queues."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from detgate.worker.engine.engine import RequestOutput
from detgate.worker.engine.sequence import SamplingParams, TokenLogprob
from detgate.worker.model.tokenizer import Tokenizer
from detgate.worker.server.generation import Choice, Generation


class CountingTokenizer:
    """The real tokenizer, counting the token ids it is asked to decode."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.decoded = 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        self.decoded += len(ids)
        return self.tok.decode(ids, skip_special_tokens)


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer.from_folder(tiny_model)


def output(ids: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [TokenLogprob(i, -1.0) for i in ids], finished,
                         "length" if finished else None, 3, 0)


def stream(choice: Choice, ids: list[int], per_step: int = 1) -> list[str]:
    """Feed `ids` a few per step, as the engine does; the text sent after each step."""
    sent = []
    for at in range(0, len(ids), per_step):
        choice.add(output(ids[at:at + per_step], finished=at + per_step >= len(ids)))
        sent.append(choice.new_text())
        if choice.finish_reason == "stop":
            break
    return sent


def test_a_2000_token_completion_decodes_each_token_a_bounded_number_of_times(tok):
    rng = random.Random(0)
    ids = [rng.randrange(tok.vocab_size) for _ in range(2000)]
    counting = CountingTokenizer(tok)
    sent = stream(Choice(0, counting, []), ids)
    assert "".join(sent) == tok.decode(ids)
    # O(n): a few decodes of each token. Decoding the whole text on every step (the quadratic
    # way) would be about n^2 / 2 = 2,001,000 tokens.
    assert counting.decoded <= 4 * len(ids)


def test_partial_utf8_is_held_back_until_the_character_is_complete(tok):
    text = "naïve café, 日本語, emoji 🙂 and more 🙂🙂 text"
    ids = tok.encode(text)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # some tokens split characters
    sent = stream(Choice(0, tok, []), ids)
    assert "".join(sent) == text
    assert not any("\ufffd" in piece for piece in sent)


def test_an_unfinished_character_at_the_end_is_sent_as_decoded(tok):
    ids = tok.encode("ok 🙂")
    cut = next(i for i in range(len(ids)) if tok.decode(ids[:i + 1]).endswith("\ufffd"))
    assert "".join(stream(Choice(0, tok, []), ids[:cut + 1])) == tok.decode(ids[:cut + 1])


@pytest.mark.parametrize("per_step", [1, 3])
def test_a_stop_string_spanning_tokens_cuts_the_text(tok, per_step):
    ids = tok.encode("The river and the town by the bridge.")
    choice = Choice(0, tok, ["town by", "never"])
    sent = stream(choice, ids, per_step)
    assert "".join(sent) == "The river and the "
    assert choice.finish_reason == "stop"


def test_one_choice_is_served_without_a_merging_queue(tok, monkeypatch):
    class EngineStream:
        def __init__(self, request_id, ids, params, validated=False):
            assert validated  # the endpoint validated it once, before submitting
            self.outs = iter([output([ids[0] + i], finished=i == 4) for i in range(5)])

        def __aiter__(self):
            return self

        async def __anext__(self):
            try:
                return next(self.outs)
            except StopIteration:
                raise StopAsyncIteration from None

        def close(self):
            pass

    ctx = SimpleNamespace(engine=SimpleNamespace(generate=EngineStream), fingerprint="fp_x")

    def no_queue(*args, **kwargs):
        raise AssertionError("n = 1 needs no queue")

    monkeypatch.setattr(asyncio, "Queue", no_queue)
    choice = Choice(0, tok, [], prompt_ids=[40])

    async def run() -> int:
        async with Generation(ctx, "r", [SamplingParams(max_tokens=5)], [choice]) as gen:
            outs = [o async for _, o in gen]
        return len(outs)

    assert asyncio.run(run()) == 5
    assert choice.text == tok.decode([40, 41, 42, 43, 44])
