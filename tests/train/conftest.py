"""The trainer's tests: policies on the tiny model, and an in-process engine that samples the
completions whose logprobs the trainer must reproduce."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from detgate.train import Policy
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.engine import Engine
from detgate.worker.engine.sequence import SamplingParams
from detgate.worker.model.loader import load


@dataclass
class Sampled:
    """One request's prompt and what the engine gave it: ids, logprobs, how it was computed."""

    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


@dataclass
class EngineRun:
    samples: dict[str, Sampled]
    max_batch: int = 0
    preempted: int = 0


def sampling(i: int, max_tokens: int) -> SamplingParams:
    """Greedy for even i, seeded sampling at temperature 1 for odd i: the trainer sees the
    logprob of the token drawn, whichever way it was chosen."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0,
                              ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 + i, logprobs=0,
                          ignore_eos=True)


def run_engine(engine: Engine, waves: list[dict[str, list[int]]], max_tokens: int
               ) -> EngineRun:
    """Each wave's prompts join at once; a wave starts when the one before it is done (so its
    shared prefixes can hit the prefix cache)."""
    run = EngineRun({})
    for wave in waves:
        for rid, prompt in wave.items():
            run.samples[rid] = Sampled(list(prompt))
            engine.add(rid, prompt, sampling(len(run.samples), max_tokens))
        while engine.has_work():
            outputs, stats = engine.step()
            run.max_batch = max(run.max_batch, stats.num_seqs)
            run.preempted += stats.num_preempted
            for o in outputs:
                s = run.samples[o.request_id]
                s.token_ids += [t.token_id for t in o.new_tokens]
                s.logprobs += [t.logprob for t in o.new_tokens]
                s.cached_tokens = max(s.cached_tokens, o.num_cached_tokens)
    return run


def prompts(n: int, seed: int, lo: int, hi: int, vocab: int = 2000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="session")
def policies(tiny_model):
    """`policies(dtype, mode="batch_invariant")` -> a Policy on the tiny model (one per key)."""
    made: dict[tuple[str, str], Policy] = {}

    def get(dtype: str, mode: str = "batch_invariant") -> Policy:
        if (dtype, mode) not in made:
            made[(dtype, mode)] = Policy.from_pretrained(tiny_model, dtype=dtype, mode=mode)
        return made[(dtype, mode)]

    return get


@pytest.fixture(scope="session")
def engines(tiny_model):
    """`engines(mode, dtype, **config)` -> a fresh Engine on the tiny model (weights loaded
    once per mode and dtype)."""
    loaded: dict[tuple[str, str], object] = {}

    def get(mode: str, dtype: str, **config) -> Engine:
        if (mode, dtype) not in loaded:
            loaded[(mode, dtype)] = load(tiny_model, dtype=dtype, device="cpu", mode=mode)
        m = loaded[(mode, dtype)]
        return Engine(EngineConfig(model=str(tiny_model), mode=mode, dtype=dtype, **config),
                      m.model, m.config)

    return get


def as_fp32(values: list[float]) -> torch.Tensor:
    """Logprobs as served (fp32 values carried in Python floats) back to fp32, exactly."""
    return torch.tensor(values, dtype=torch.float32)
