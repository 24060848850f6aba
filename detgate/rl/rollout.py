"""Rollouts through the gateway: one seeded completions request per problem, its n choices a
group, each choice's token ids and sampled logprobs as the gateway recorded them.

The prompt is sent as token ids (tokenized once, here, by the policy's tokenizer), so the
trainer scores exactly the tokens the sampler saw; `return_token_ids` brings the sampled ids
back beside their logprobs. Every request is recorded by the gateway (its `id`) and carries an
explicit seed, so any rollout can be replayed with `POST /replay/<id>`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from detgate.rl.task import Problem


@dataclass(frozen=True)
class Rollout:
    problem: Problem
    prompt: list[int]
    token_ids: list[int]
    logprobs: list[float | None]  # the sampler's, one per token of token_ids
    text: str
    record_id: str
    fingerprint: str


class RolloutError(RuntimeError):
    """The gateway refused or failed a rollout request."""


@dataclass(frozen=True)
class Sampling:
    group_size: int
    max_tokens: int
    temperature: float


def sample_groups(client: httpx.Client, model: str, prompts: list[tuple[Problem, list[int]]],
                  sampling: Sampling, seeds: list[int]) -> list[list[Rollout]]:
    """One group of `sampling.group_size` rollouts per (problem, prompt ids), all in flight at
    once; groups in the order of `prompts`."""
    with ThreadPoolExecutor(max(1, len(prompts))) as pool:
        return list(pool.map(lambda args: _group(client, model, sampling, *args),
                             [(p, ids, seed) for (p, ids), seed in zip(prompts, seeds,
                                                                        strict=True)]))


def _group(client: httpx.Client, model: str, sampling: Sampling, problem: Problem,
           prompt: list[int], seed: int) -> list[Rollout]:
    body = {"model": model, "prompt": prompt, "n": sampling.group_size,
            "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
            "seed": seed, "logprobs": 0, "return_token_ids": True}
    try:
        r = client.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        raise RolloutError(f"the gateway did not answer: {exc}") from exc
    if r.status_code != 200:
        raise RolloutError(f"the gateway answered {r.status_code}: {r.text[:500]}")
    answer = r.json()
    return [Rollout(problem=problem, prompt=prompt, token_ids=choice["token_ids"],
                    logprobs=choice["logprobs"]["token_logprobs"], text=choice["text"],
                    record_id=answer["id"], fingerprint=answer["system_fingerprint"])
            for choice in sorted(answer["choices"], key=lambda c: c["index"])]
