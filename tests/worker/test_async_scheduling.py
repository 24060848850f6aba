"""Asynchronous scheduling (worker/engine/scheduler.py, engine.py): step n + 1 is scheduled and
launched before step n's sampled ids reach the host, its PENDING input tokens read on the
device, and a sequence that stops on the token in flight runs once more, that result dropped.

On the CPU nothing overlaps (each launch computes at once) but the bookkeeping is the same as on
CUDA, so these tests run it: the same traffic, scheduled asynchronously or not, gives the same
bits in batch_invariant mode, although the batches differ (admissions a step later, stopped
sequences a step longer). With the split-K control matmul (tests/support/controls.py) the
different batches move the numbers on any CPU (negative control).
"""

from __future__ import annotations

import dataclasses
import random

from detgate.contract.compare import logprob_bits
from detgate.worker.engine import offline as wl
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.engine import Engine
from detgate.worker.engine.sequence import PENDING
from detgate.worker.model.loader import load
from tests.support.controls import SplitKOps, use_ops

_loaded: dict = {}


def loaded_model(tiny_model, control: bool):
    if control not in _loaded:
        loaded = load(tiny_model, dtype="float32", device="cpu", mode="batch_invariant")
        if control:
            use_ops(loaded.model, SplitKOps())
        _loaded[control] = loaded
    return _loaded[control]


def traffic(vocab_size: int) -> list[wl.Request]:
    """Needles sharing a prompt (prefix cache hits) among fillers; a quarter of the requests stop
    on any of half the vocabulary (early stops on the token in flight), some sample with a seed,
    some score their prompt."""
    reqs = wl.determinism_workload(needles=4, fillers=28, prompt_len=37, needle_tokens=12,
                                   filler_prompt=(1, 90), filler_tokens=(2, 16),
                                   vocab_size=vocab_size, seed=11)
    rng = random.Random(12)
    out = []
    for i, r in enumerate(reqs):
        params = r.params
        if i % 4 == 1:
            params = dataclasses.replace(params, stop_token_ids=tuple(range(0, vocab_size, 2)))
        elif i % 4 == 2:
            params = dataclasses.replace(params, temperature=0.8, seed=rng.randrange(1000))
        elif i % 8 == 3:
            params = dataclasses.replace(params, prompt_logprobs=1)
        out.append(dataclasses.replace(r, params=params))
    return out


def run(tiny_model, async_scheduling: bool, control: bool = False):
    loaded = loaded_model(tiny_model, control)
    # 16 blocks of 16 tokens for up to 24 sequences of up to 106 tokens: preemptions; 64 tokens
    # a step: chunked prefills.
    eng = Engine(EngineConfig(model=str(tiny_model), mode="batch_invariant", max_num_seqs=24,
                              max_num_batched_tokens=64, num_kv_blocks=16,
                              async_scheduling=async_scheduling), loaded.model, loaded.config)
    dropped = []
    resolve = eng.scheduler.resolve

    def counting_resolve(batch, sampled):
        dropped.extend(e for e in batch.entries if e.seq.is_finished)
        return resolve(batch, sampled)

    eng.scheduler.resolve = counting_resolve
    out, stats = wl.run(eng, traffic(loaded.config.vocab_size), arrival_seed=13)
    results = {k: (c.token_ids, logprob_bits(c.logprobs), logprob_bits(c.prompt_logprobs or []))
               for k, c in out.items()}
    assert not eng.has_work() and eng.block_manager.num_free_blocks == 16
    return results, stats, dropped, eng.scheduler.num_preemptions


def test_async_scheduling_gives_the_same_bits(tiny_model):
    sync, sync_stats, sync_dropped, sync_preempted = run(tiny_model, async_scheduling=False)
    overlapped, stats, dropped, preempted = run(tiny_model, async_scheduling=True)
    assert overlapped == sync
    # The runs took the paths they claim: the overlapped one ran stopped sequences once more
    # (their results dropped), both preempted, and the batches differed.
    assert dropped and not sync_dropped
    assert preempted and sync_preempted
    assert sync_stats.generated_tokens == sum(len(ids) for ids, _, _ in sync.values())
    assert stats.steps != sync_stats.steps or stats.mean_batch_size != sync_stats.mean_batch_size


def test_negative_control_split_k_sees_the_different_batches(tiny_model):
    sync, *_ = run(tiny_model, async_scheduling=False, control=True)
    overlapped, *_ = run(tiny_model, async_scheduling=True, control=True)
    assert overlapped != sync


def test_abort_while_its_step_is_in_flight(tiny_model):
    loaded = loaded_model(tiny_model, control=False)
    eng = Engine(EngineConfig(model=str(tiny_model), mode="batch_invariant", num_kv_blocks=32,
                              async_scheduling=True), loaded.model, loaded.config)
    params = wl.greedy(8)
    eng.add("kept", list(range(50, 70)), params)
    eng.add("aborted", list(range(80, 95)), params)
    eng.step()  # the prefill's results are in; the first decode step is in flight
    assert eng._in_flight is not None and len(eng._in_flight.batch) == 2
    assert eng.abort("aborted").finish_reason == "abort"
    outputs = []
    while eng.has_work():
        outputs += eng.step()[0]
    assert {o.request_id for o in outputs} == {"kept"}
    assert sum(len(o.new_tokens) for o in outputs) == 7 and outputs[-1].finished
    assert eng.block_manager.num_free_blocks == 32


def test_generated_blocks_reach_the_prefix_cache(tiny_model):
    """Blocks filled by generated tokens are published once their ids are known (a step in
    flight leaves one or two PENDING): a follow-up request holding the conversation so far is
    served from the cache as far as without asynchronous scheduling."""
    loaded = loaded_model(tiny_model, control=False)
    cached = {}
    for overlap in (False, True):
        eng = Engine(EngineConfig(model=str(tiny_model), mode="batch_invariant",
                                  num_kv_blocks=64, async_scheduling=overlap),
                     loaded.model, loaded.config)
        prompt = list(range(100, 120))
        first, _ = wl.run(eng, [wl.Request("a", prompt, wl.greedy(60))], arrival_seed=None)
        assert all(PENDING not in b.token_ids for b in eng.block_manager.blocks)
        follow_up = prompt + first["a"].token_ids + [7]
        eng.add("b", follow_up, wl.greedy(1))
        outputs = []
        while eng.has_work():
            outputs += eng.step()[0]
        cached[overlap] = outputs[0].num_cached_tokens
    assert cached[True] == cached[False] == 64  # blocks 0-3 of the 81 tokens


def test_on_by_default_on_cuda_only_and_the_flags_override():
    """`async_scheduling` None resolves by device (CUDA: on; CPU: off, nothing overlaps there);
    `--async-scheduling` / `--no-async-scheduling` set it either way."""
    import argparse

    from detgate.worker.cli import add_engine_args

    assert EngineConfig(device="cuda").overlaps_steps
    assert not EngineConfig(device="cpu").overlaps_steps
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv, device, want in (([], "cuda", True), ([], "cpu", False),
                               (["--no-async-scheduling"], "cuda", False),
                               (["--async-scheduling"], "cpu", True)):
        args = parser.parse_args([*argv, "--device", device])
        assert EngineConfig.from_args(args).overlaps_steps is want, (argv, device)
