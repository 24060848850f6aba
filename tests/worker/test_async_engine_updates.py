"""Weight updates in the engine's loop, in process (engine/async_engine.py): a sequence
submitted before an update runs entirely on the old weights, one submitted after it entirely
on the new, or the older one ends with WeightsUpdated. Negative control: the same new weights
written between two steps of a running sequence, outside the update protocol, give a
sequence that matches neither weight set, which is what the checks below would catch."""

from __future__ import annotations

import asyncio

import pytest

from detgate.worker.engine.async_engine import AsyncEngine
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.engine import Engine
from detgate.worker.engine.sequence import SamplingParams
from detgate.worker.errors import WeightsUpdated
from detgate.worker.model.loader import load
from detgate.worker.model.weight_update import WeightStager
from tests.support.floats import bits

LONG = SamplingParams(max_tokens=40, logprobs=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=8, logprobs=0, ignore_eos=True)
PROMPT_L, PROMPT_S = [5, 80, 200, 31, 7], [9, 400, 1200]


@pytest.fixture(scope="module")
def setup(tiny_model, tiny_model_b):
    loaded = load(tiny_model, dtype="float32", device="cpu", mode="batch_invariant")
    stager = WeightStager(loaded.model, loaded.config)
    return loaded, stager, {"a": tiny_model, "b": tiny_model_b}


def new_engine(loaded) -> Engine:
    return Engine(EngineConfig(num_kv_blocks=64), loaded.model, loaded.config)


def serve(setup, key: str) -> None:
    loaded, stager, folders = setup
    stager.stage(folders[key]).commit()


def reference(setup, key: str, prompt: list[int], params: SamplingParams) -> list:
    """What a fresh engine on weight set `key` gives for one sequence (ids, logprob bits)."""
    serve(setup, key)
    eng = new_engine(setup[0])
    eng.add("r", prompt, params)
    out = []
    while eng.has_work():
        for o in eng.step()[0]:
            out += [(t.token_id, bits([t.logprob])[0]) for t in o.new_tokens]
    return out


async def collect(stream) -> list:
    return [(t.token_id, bits([t.logprob])[0]) async for o in stream for t in o.new_tokens]


def test_an_update_comes_between_the_sequences_before_and_after_it(setup):
    ref = {(k, p): reference(setup, k, *p_) for k in "ab"
           for p, p_ in (("l", (PROMPT_L, LONG)), ("s", (PROMPT_S, SHORT)))}
    assert ref["a", "l"] != ref["b", "l"] and ref["a", "s"] != ref["b", "s"]
    serve(setup, "a")
    loaded, stager, folders = setup

    async def scenario():
        engine = AsyncEngine(new_engine(loaded))
        engine.start()
        try:
            long = asyncio.create_task(collect(engine.generate("l", PROMPT_L, LONG)))
            await asyncio.sleep(0.05)  # the long sequence is running
            update = engine.update_weights(stager.stage(folders["b"]).commit, abort=False)
            short = await collect(engine.generate("s", PROMPT_S, SHORT))
            return await long, short, await update
        finally:
            await engine.stop()

    long, short, outcome = asyncio.run(scenario())
    assert long == ref["a", "l"] and short == ref["b", "s"]
    assert outcome.finished == 1 and outcome.aborted == 0


def test_abort_ends_the_older_sequences_and_the_newer_run_on_the_new_weights(setup):
    ref_s = reference(setup, "b", PROMPT_S, SHORT)
    serve(setup, "a")
    loaded, stager, folders = setup

    async def scenario():
        engine = AsyncEngine(new_engine(loaded))
        engine.start()
        try:
            long = asyncio.create_task(collect(engine.generate("l", PROMPT_L, LONG)))
            await asyncio.sleep(0.05)
            update = engine.update_weights(stager.stage(folders["b"]).commit, abort=True)
            short = await collect(engine.generate("s", PROMPT_S, SHORT))
            with pytest.raises(WeightsUpdated):
                await long
            return short, await update
        finally:
            await engine.stop()

    short, outcome = asyncio.run(scenario())
    assert short == ref_s and outcome.aborted == 1


def test_negative_control_weights_written_mid_sequence_mix_versions(setup):
    ref = {k: reference(setup, k, PROMPT_L, LONG) for k in "ab"}
    serve(setup, "a")
    loaded, stager, folders = setup
    staged = stager.stage(folders["b"])
    steps = []

    def on_step(_) -> None:  # in the loop thread, between two steps: no protocol
        steps.append(1)
        if len(steps) == 10:
            staged.commit()

    async def scenario():
        engine = AsyncEngine(new_engine(loaded), on_step=on_step)
        engine.start()
        try:
            return await collect(engine.generate("l", PROMPT_L, LONG))
        finally:
            await engine.stop()

    mixed = asyncio.run(scenario())
    assert mixed != ref["a"] and mixed != ref["b"]
    assert mixed[:9] == ref["a"][:9]
