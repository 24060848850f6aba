"""Engine on the tiny model, in process: what a request gets does not depend on how the engine
schedules it (batch-invariant mode), and the engine's bookkeeping (abort, stop, score) holds."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from detgate.worker.engine import offline as wl
from detgate.worker.engine.async_engine import AsyncEngine
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.engine import Engine
from detgate.worker.engine.sequence import SamplingParams
from detgate.worker.errors import EngineDead, InvalidRequest
from detgate.worker.model.loader import load
from tests.support.floats import bits

_loaded: dict = {}


def engine(tiny_model, mode="batch_invariant", **overrides) -> Engine:
    config = EngineConfig(model=str(tiny_model), mode=mode, **overrides)
    if mode not in _loaded:
        _loaded[mode] = load(tiny_model, dtype="float32", device="cpu", mode=mode)
    return Engine(config, _loaded[mode].model, _loaded[mode].config)


def prompts(n: int, seed: int = 0, lo: int = 5, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 2000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def run(eng: Engine, reqs: dict[str, tuple[list[int], SamplingParams]]):
    """Run requests to completion: request id -> [(token id, logprob's bit pattern)], plus the
    step stats. Bit patterns, so that results compare equal only bit for bit (-0.0 != 0.0)."""
    for rid, (ids, params) in reqs.items():
        eng.add(rid, ids, params)
    out: dict[str, list] = {rid: [] for rid in reqs}
    stats = []
    while eng.has_work():
        outputs, st = eng.step()
        stats.append(st)
        for o in outputs:
            out[o.request_id].extend((t.token_id, bits([t.logprob])[0]) for t in o.new_tokens)
    return out, stats


GREEDY = SamplingParams(max_tokens=6, logprobs=0, ignore_eos=True)


def test_batch_and_schedule_do_not_change_results(tiny_model):
    needle = prompts(1, seed=1, lo=40, hi=41)[0]
    alone, _ = run(engine(tiny_model), {"n": (needle, GREEDY)})
    fillers = {f"f{i}": (p, GREEDY) for i, p in enumerate(prompts(8, seed=2, hi=30))}
    crowded, stats = run(engine(tiny_model, max_num_batched_tokens=64, chunk_size=24),
                         {**fillers, "n": (needle, GREEDY)})
    assert max(s.num_seqs for s in stats) > 4  # it really ran in big mixed batches
    assert crowded["n"] == alone["n"]


def test_chunked_prefill_is_bit_identical(tiny_model):
    ids = prompts(1, seed=3, lo=50, hi=51)[0]
    whole, _ = run(engine(tiny_model), {"a": (ids, GREEDY)})
    chunked, stats = run(engine(tiny_model, chunk_size=23), {"a": (ids, GREEDY)})
    assert [s.num_tokens for s in stats[:3]] == [23, 23, 4]
    assert chunked == whole


def test_prefix_cache_hot_equals_cold(tiny_model):
    ids = prompts(1, seed=4, lo=50, hi=51)[0]
    eng = engine(tiny_model)
    cold, _ = run(eng, {"cold": (ids, GREEDY)})
    hot, stats = run(eng, {"hot": (ids, GREEDY)})
    assert stats[0].num_tokens == 50 - 48  # three blocks of 16 came from the cache
    assert hot["hot"] == cold["cold"]


def test_reset_prefix_cache_makes_the_next_run_compute_its_prompts(tiny_model):
    # The offline runner's counts: a second run of the same prompts finds them cached, a run
    # after reset_prefix_cache() computes them again (a benchmark's passes each start cold).
    reqs = [wl.Request(f"r{i}", ids, GREEDY) for i, ids in enumerate(prompts(4, seed=6, lo=40))]
    eng = engine(tiny_model)
    _, cold = wl.run(eng, reqs, arrival_seed=None)
    _, hot = wl.run(eng, reqs, arrival_seed=None)
    eng.reset_prefix_cache()
    _, reset = wl.run(eng, reqs, arrival_seed=None)
    assert cold.cached_prompt_tokens == reset.cached_prompt_tokens == 0
    assert hot.cached_prompt_tokens == sum((len(r.token_ids) - 1) // 16 * 16 for r in reqs)
    eng.add("busy", reqs[0].token_ids, GREEDY)
    with pytest.raises(RuntimeError):
        eng.reset_prefix_cache()


def test_preemption_is_bit_identical(tiny_model):
    # Four sequences of 14-16 tokens grow past a block boundary while holding 6 of 6 blocks.
    reqs = {f"r{i}": (p, SamplingParams(max_tokens=12, logprobs=0, ignore_eos=True))
            for i, p in enumerate(prompts(4, seed=5, lo=14, hi=17))}
    roomy, _ = run(engine(tiny_model), reqs)
    tight_engine = engine(tiny_model, num_kv_blocks=6)
    tight, stats = run(tight_engine, reqs)
    assert sum(s.num_preempted for s in stats) > 0
    assert tight == roomy
    assert tight_engine.block_manager.num_free_blocks == 6


def test_score_equals_sampled_logprobs(tiny_model):
    ids = prompts(1, seed=6)[0]
    eng = engine(tiny_model)
    sampled, _ = run(eng, {"a": (ids, SamplingParams(max_tokens=6, logprobs=0, ignore_eos=True))})
    full = ids + [t for t, _ in sampled["a"]]
    eng.add("s", full, SamplingParams(max_tokens=0, prompt_logprobs=0, single_pass=True))
    scored = None
    while eng.has_work():
        for o in eng.step()[0]:
            scored = o.prompt_logprobs
    assert [t.token_id for t in scored] == full[1:]
    assert bits([t.logprob for t in scored[len(ids) - 1:]]) == tuple(lp for _, lp in sampled["a"])


def test_prompt_logprobs_survive_chunking_and_match_a_single_pass(tiny_model):
    ids = prompts(1, seed=11, lo=45, hi=46)[0]

    def prompt_logprobs(eng, params):
        eng.add("p", ids, params)
        found = None
        while eng.has_work():
            for o in eng.step()[0]:
                found = o.prompt_logprobs if o.prompt_logprobs is not None else found
        return [(t.token_id, t.logprob, t.rank, t.top) for t in found]

    single = prompt_logprobs(engine(tiny_model),
                             SamplingParams(max_tokens=0, prompt_logprobs=3, single_pass=True))
    chunked = prompt_logprobs(engine(tiny_model, chunk_size=7),
                              SamplingParams(max_tokens=2, prompt_logprobs=3))
    assert len(single) == len(ids) - 1 and chunked == single


def test_seeded_sampling_repeats_alone_and_in_a_batch(tiny_model):
    ids = prompts(1, seed=7)[0]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=1234, logprobs=0, ignore_eos=True)
    a, _ = run(engine(tiny_model), {"a": (ids, params)})
    b, _ = run(engine(tiny_model), {"a": (ids, params)})
    others = {f"o{i}": (p, SamplingParams(max_tokens=8, temperature=1.0, seed=i))
              for i, p in enumerate(prompts(4, seed=8, hi=30))}
    c, _ = run(engine(tiny_model), {**others, "a": (ids, params)})
    assert a["a"] == b["a"] == c["a"]
    assert len({t for t, _ in a["a"]}) > 1


def test_stop_token_and_max_tokens(tiny_model):
    ids = prompts(1, seed=9)[0]
    eng = engine(tiny_model)
    free, _ = run(eng, {"a": (ids, GREEDY)})
    stop_at = free["a"][2][0]
    first = next(i for i, (t, _) in enumerate(free["a"]) if t == stop_at)
    stopped, _ = run(eng, {"b": (ids, SamplingParams(max_tokens=8, stop_token_ids=(stop_at,)))})
    assert [t for t, _ in stopped["b"]] == [t for t, _ in free["a"][:first + 1]]


def test_warm_up_has_nothing_to_do_on_the_cpu(tiny_model):
    """No graphs and no cuBLASLt on the CPU: a CPU worker serves at once (its warm-up on CUDA:
    tests/worker/test_gpu_engine.py)."""
    assert engine(tiny_model).warm_up() == {}


def test_validation(tiny_model):
    eng = engine(tiny_model, max_model_len=64)
    with pytest.raises(InvalidRequest, match="context length"):
        eng.validate(list(range(3, 60)), SamplingParams(max_tokens=8))
    with pytest.raises(InvalidRequest, match="empty"):
        eng.validate([], SamplingParams())
    with pytest.raises(InvalidRequest, match="token ids"):
        eng.validate([10**9], SamplingParams())


def test_abort_frees_blocks(tiny_model):
    eng = engine(tiny_model, num_kv_blocks=32)
    eng.add("a", prompts(1, seed=10)[0], SamplingParams(max_tokens=100, ignore_eos=True))
    eng.step()
    assert eng.block_manager.num_free_blocks < 32
    out = eng.abort("a")
    assert out.finished and out.finish_reason == "abort"
    assert eng.block_manager.num_free_blocks == 32 and not eng.has_work()


async def test_async_engine_batches_concurrent_requests_and_aborts(tiny_model):
    steps = []
    eng = engine(tiny_model, num_kv_blocks=64)
    async_engine = AsyncEngine(eng, on_step=steps.append)
    async_engine.start()
    try:
        async def collect(rid, ids):
            return [t.token_id async for o in async_engine.generate(rid, ids, GREEDY)
                    for t in o.new_tokens]

        reqs = prompts(6, hi=20)
        results = await asyncio.gather(*(collect(f"r{i}", p) for i, p in enumerate(reqs)))
        assert all(len(r) == GREEDY.max_tokens for r in results)
        assert max(s.num_seqs for s in steps) > 1  # concurrent requests shared steps

        stream = async_engine.generate("long", prompts(1)[0],
                                       SamplingParams(max_tokens=500, ignore_eos=True))
        await anext(stream)
        await stream.aclose()  # the consumer leaves: the sequence must be aborted and freed
        for _ in range(200):
            if not eng.has_work():
                break
            await asyncio.sleep(0.01)
        assert not eng.has_work() and eng.block_manager.num_free_blocks == 64
    finally:
        await async_engine.stop()


async def test_a_failed_step_fails_its_requests_and_the_loop_goes_on(tiny_model):
    eng = engine(tiny_model, num_kv_blocks=32)
    real_launch, calls = eng.runner.launch, []

    def fails_once(batch, previous):
        calls.append(batch)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return real_launch(batch, previous)

    eng.runner.launch = fails_once
    async_engine = AsyncEngine(eng)
    async_engine.start()
    try:
        ids = prompts(1)[0]
        with pytest.raises(EngineDead, match="injected failure"):
            async for _ in async_engine.generate("a", ids, GREEDY):
                pass
        outputs = [o async for o in async_engine.generate("b", ids, GREEDY)]
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
        assert eng.block_manager.num_free_blocks == 32
    finally:
        await async_engine.stop()


async def test_a_hung_step_is_reported_and_a_slow_one_is_not(tiny_model):
    """What /health reports: a step running longer than the stall limit (injected: a real
    engine does not hang on demand) is a problem while it runs, steps within the limit never
    are, and a stopped loop is one for good."""
    eng = engine(tiny_model, num_kv_blocks=32)
    real_launch, hang = eng.runner.launch, {"s": 0.0}

    def slow(batch, previous):
        time.sleep(hang["s"])
        return real_launch(batch, previous)

    eng.runner.launch = slow
    async_engine = AsyncEngine(eng)
    async_engine.start()
    try:
        ids = prompts(1)[0]
        hang["s"] = 0.05  # slow but progressing: every step within the limit
        seen = []
        async for _ in async_engine.generate("slow", ids, GREEDY):
            seen.append(async_engine.problem(stall_s=0.5))
        assert seen and set(seen) == {None}
        hang["s"] = 1.5
        run = asyncio.create_task(anext(async_engine.generate("hung", ids, GREEDY)))
        await asyncio.sleep(1.0)
        assert "more than 0.5s" in async_engine.problem(stall_s=0.5)
        hang["s"] = 0.0
        await run
        assert async_engine.problem(stall_s=0.5) is None
    finally:
        await async_engine.stop()
    assert async_engine.problem(stall_s=0.5) == "the engine is shut down"
