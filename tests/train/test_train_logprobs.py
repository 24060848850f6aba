"""The trainer's logprob of every sampled token is the sampler's, bit for bit (issue 21, item 1).

The sampler is a batch_invariant engine under load: continuous batching, chunked prefill,
prefix-cache hits and preemption. The trainer computes the same completions in many batch
layouts (packed in any order, right-padded, one sequence at a time, subsets of 1..N). Negative
controls: a default-mode sampler, a sampler with a batch-dependent matmul (split-K below 16
rows: batch-variant by construction on any CPU) and the trainer on plain torch ops must each
find differences.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
import torch

from detgate.kernels.selfcheck import same_bits
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.engine import Engine
from detgate.worker.model.loader import load
from tests.support.controls import SplitKOps, use_ops
from tests.support.floats import bits
from tests.train.conftest import EngineRun, as_fp32, prompts, run_engine

MAX_TOKENS = 12
CHUNK = 13
# A busy engine: prefill chunks of 13 tokens under a 48-token step budget, and too few KV
# blocks for every sequence at once (preemption).
BUSY = {"chunk_size": CHUNK, "max_num_batched_tokens": 48, "num_kv_blocks": 14,
        "max_num_seqs": 16}


def waves() -> list[dict[str, list[int]]]:
    """Wave 1: prompts of 5-60 tokens, two of them sharing a 40-token prefix; wave 2 (after
    wave 1 is done): new tails on that prefix and a repeated prompt (prefix-cache hits)."""
    prefix = prompts(1, seed=7, lo=40, hi=41)[0]
    first = {f"a{i}": p for i, p in enumerate(prompts(6, seed=8, lo=5, hi=60))}
    first |= {f"p{i}": prefix + tail for i, tail in enumerate(prompts(2, seed=9, lo=3, hi=9))}
    second = {f"q{i}": prefix + tail for i, tail in enumerate(prompts(3, seed=10, lo=1, hi=20))}
    second["again"] = first["a2"]
    return [first, second]


def sample(engine: Engine) -> EngineRun:
    run = run_engine(engine, waves(), MAX_TOKENS)
    assert run.preempted > 0 and run.max_batch > 4
    assert max(s.cached_tokens for s in run.samples.values()) >= 32
    assert max(len(s.prompt) for s in run.samples.values()) > CHUNK
    return run


_RUNS: dict[tuple[str, str], EngineRun] = {}


@pytest.fixture
def sampled(engines):
    """`sampled(mode, dtype)` -> the busy engine's run of the waves (once per key)."""
    def get(mode: str, dtype: str) -> EngineRun:
        if (mode, dtype) not in _RUNS:
            _RUNS[(mode, dtype)] = sample(engines(mode, dtype, **BUSY))
        return _RUNS[(mode, dtype)]

    return get


def completion_logprobs(policy, samples: list) -> list[torch.Tensor]:
    return [t.detach().cpu() for t in policy.completion_logprobs(
        [s.prompt for s in samples], [s.token_ids for s in samples])]


def padded_logprobs(policy, samples: list) -> list[torch.Tensor]:
    """The [B, T] right-padded layout, prompts not scored (`start`)."""
    seqs = [s.prompt + s.token_ids for s in samples]
    width = max(map(len, seqs)) + 3  # padding past the longest too
    ids = torch.tensor([q + [0] * (width - len(q)) for q in seqs])
    mask = torch.tensor([[1] * len(q) + [0] * (width - len(q)) for q in seqs])
    out = policy.token_logprobs(ids, attention_mask=mask, start=[len(s.prompt) for s in samples])
    return [out[i, len(s.prompt):len(s.prompt) + len(s.token_ids)].detach().cpu()
            for i, s in enumerate(samples)]


def layouts(samples: list, seed: int):
    """(name, the samples in that batch, how to compute them): every batch the trainer runs."""
    rng = random.Random(seed)
    shuffled = rng.sample(samples, len(samples))
    yield "packed", samples, completion_logprobs
    yield "packed, shuffled", shuffled, completion_logprobs
    yield "padded, shuffled", shuffled, padded_logprobs
    for s in samples[:3]:
        yield "alone", [s], completion_logprobs
    for size in (2, 3, 5, len(samples) - 1):
        yield f"subset of {size}", rng.sample(samples, size), padded_logprobs


def differences(policy, run: EngineRun) -> dict[str, int]:
    """Layout -> tokens whose trainer logprob differs from the sampled one (bit patterns)."""
    samples = list(run.samples.values())
    found = {}
    for name, batch, compute in layouts(samples, seed=len(samples)):
        got = compute(policy, batch)
        found[name] = found.get(name, 0) + sum(
            int((g.view(torch.int32) != as_fp32(s.logprobs).view(torch.int32)).sum())
            for g, s in zip(got, batch, strict=True))
    return found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_logprobs_are_the_sampled_bits(policies, sampled, dtype):
    run = sampled("batch_invariant", dtype)
    assert sum(len(s.token_ids) for s in run.samples.values()) == MAX_TOKENS * len(run.samples)
    found = differences(policies(dtype), run)
    assert len(found) == 8 and not any(found.values()), found


def test_a_default_mode_sampler_differs(policies, sampled):
    """Negative control: the same workload sampled by default-mode numerics (MKL matmuls,
    torch norms, SDPA) disagrees with the trainer somewhere."""
    assert sum(differences(policies("float32"), sampled("default", "float32")).values()) > 0


def test_a_batch_dependent_matmul_in_the_sampler_differs(tiny_model, policies):
    """Negative control that holds on every CPU: batch_invariant mode but for matmuls of fewer
    than 16 rows (decode steps), reduced in two halves as a split-K GEMM does."""
    loaded = load(tiny_model, dtype="float32", device="cpu", mode="batch_invariant")
    model = use_ops(loaded.model, SplitKOps())
    engine = Engine(EngineConfig(model=str(tiny_model), mode="batch_invariant", **BUSY),
                    model, loaded.config)
    assert sum(differences(policies("float32"), sample(engine)).values()) > 0


def test_the_trainer_on_plain_torch_ops_differs(policies, sampled):
    """Negative control on the trainer's side: its `default` mode (what a plain PyTorch
    trainer computes) does not reproduce the batch_invariant sampler."""
    run = sampled("batch_invariant", "float32")
    assert sum(differences(policies("float32", "default"), run).values()) > 0


def test_trainer_equals_a_worker_process_and_its_score(start_worker, policies):
    """A real batch_invariant worker: concurrent seeded completions over HTTP, then /v1/score
    of each prompt + completion; the trainer's logprobs equal both, bit for bit."""
    url = start_worker("batch_invariant").url
    asked = prompts(6, seed=21, lo=3, hi=70)

    async def served():
        async with httpx.AsyncClient(timeout=600) as client:
            async def one(i: int, prompt: list[int]) -> tuple[list[int], list[float], list]:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 1.0,
                        "seed": 50 + i, "logprobs": 0, "return_token_ids": True,
                        "ignore_eos": True}
                r = await client.post(f"{url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                ids = choice["token_ids"]
                s = await client.post(f"{url}/v1/score", json={
                    "model": "tiny", "token_ids": prompt + ids, "start": len(prompt)})
                assert s.status_code == 200, s.text
                return ids, choice["logprobs"]["token_logprobs"], s.json()["logprobs"]

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(asked)))

    results = asyncio.run(served())
    trained = policies("float32").completion_logprobs(asked, [ids for ids, _, _ in results])
    for (_, sampled_lp, scored_lp), mine in zip(results, trained, strict=True):
        assert bits(mine.tolist()) == bits(sampled_lp) == bits(scored_lp)


def test_padded_and_packed_layouts_give_the_same_bits(policies):
    policy = policies("bfloat16")
    seqs = prompts(4, seed=30, lo=1, hi=40)
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    packed = policy.token_logprobs(torch.tensor(sum(seqs, [])), cu_seqlens=cu)
    width = max(map(len, seqs))
    ids = torch.tensor([s + [5] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    padded = policy.token_logprobs(ids, attention_mask=mask)
    assert padded.shape == (4, width) and packed.shape == (cu[-1],)
    assert same_bits(padded[mask.bool()].detach(), packed.detach())
    assert bool((padded[:, 0] == 0).all()) and bool((padded[~mask.bool()] == 0).all())


@pytest.mark.parametrize("layout, message", [
    ({"attention_mask": torch.tensor([[1, 0, 1]])}, "right-padded"),
    ({"attention_mask": torch.tensor([[0, 0, 0]])}, "at least one token"),
    ({"attention_mask": torch.tensor([[1, 2, 0]])}, "only 0 and 1"),
    ({"cu_seqlens": [0, 2]}, "from 0 to N"),
    ({"cu_seqlens": [0, 3, 3]}, "increase strictly"),
    ({}, "exactly one of"),
])
def test_bad_layouts_are_refused_by_name(policies, layout, message):
    ids = torch.tensor([[5, 6, 7]]) if "attention_mask" in layout or not layout else \
        torch.tensor([5, 6, 7])
    with pytest.raises(ValueError, match=message):
        policies("float32").token_logprobs(ids, **layout)


def test_bad_token_ids_are_refused(policies):
    policy = policies("float32")
    with pytest.raises(ValueError, match="token ids must lie"):
        policy.token_logprobs(torch.tensor([5, policy.config.vocab_size]), cu_seqlens=[0, 2])
    with pytest.raises(ValueError, match="at least one token"):
        policy.completion_logprobs([[]], [[5]])
