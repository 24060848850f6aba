"""The on-policy check: sampled logprobs against the teacher-forced ones of /v1/score.

A trainer recomputes the logprobs of the sampled tokens in one full forward pass; when the
sampler's numbers equal those bitwise, the sampler-trainer KL estimate is exactly 0 and no
importance weighting is needed. The estimate is the mean over sampled tokens of
logp_sampler - logp_trainer (a Monte Carlo estimate of KL(sampler || trainer)).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from detgate.audit.client import AuditRequestError, EndpointClient
from detgate.audit.sample import Sample
from detgate.contract.compare import same_bits

# Answers meaning "this endpoint has no score route".
NO_ROUTE_STATUSES = frozenset({404, 405})
# The gateway's answer when no worker behind it offers the built-in score (vLLM only).
NO_SCORE_WORKER = (409, "no_score_worker")


@dataclass(frozen=True)
class SampleScore:
    index: int
    tokens: int
    max_abs_logprob_diff: float
    sum_logprob_diff: float
    exact: bool


@dataclass
class ScoreReport:
    scored: list[SampleScore] = field(default_factory=list)
    # Samples without token ids, prompt token ids or logprobs cannot be teacher-forced.
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    # Set when the endpoint has no score route: the remaining samples are not sent.
    unsupported: str | None = None

    @property
    def max_abs_logprob_diff(self) -> float | None:
        return max((s.max_abs_logprob_diff for s in self.scored), default=None)

    @property
    def kl_estimate(self) -> float | None:
        tokens = sum(s.tokens for s in self.scored)
        return sum(s.sum_logprob_diff for s in self.scored) / tokens if tokens else None

    @property
    def exact(self) -> int:
        return sum(s.exact for s in self.scored)


def compare_to_teacher(index: int, sampled: Sequence[float | None],
                       teacher: Sequence[float]) -> SampleScore:
    if len(sampled) != len(teacher):
        raise ValueError(f"{len(sampled)} sampled logprobs but {len(teacher)} teacher-forced ones")
    pairs = [(s, t) for s, t in zip(sampled, teacher, strict=True) if s is not None]
    diffs = [s - t for s, t in pairs]
    return SampleScore(
        index=index, tokens=len(pairs),
        max_abs_logprob_diff=max((abs(d) for d in diffs), default=0.0),
        sum_logprob_diff=sum(diffs),
        exact=same_bits([s for s, _ in pairs], [t for _, t in pairs]),
    )


def no_score_route(exc: AuditRequestError) -> bool:
    if exc.status in NO_ROUTE_STATUSES:
        return True
    if exc.status != NO_SCORE_WORKER[0]:
        return False
    try:
        error = json.loads(exc.body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("code") == NO_SCORE_WORKER[1]


def scorable(sample: Sample) -> bool:
    return (sample.token_ids is not None and sample.prompt_token_ids is not None
            and sample.logprobs is not None and len(sample.token_ids) > 0)


async def score_samples(client: EndpointClient, samples: Sequence[Sample], concurrency: int,
                        report: ScoreReport, on_done: Callable[[], None]) -> None:
    """Fill `report` as answers come, so that an interrupted run still shows what was scored."""
    slots = asyncio.Semaphore(concurrency)

    async def one(sample: Sample) -> None:
        start = len(sample.prompt_token_ids)
        async with slots:
            if report.unsupported is None:
                try:
                    ids = [*sample.prompt_token_ids, *sample.token_ids]
                    teacher = await client.score(ids, start)
                    report.scored.append(compare_to_teacher(sample.index, sample.logprobs, teacher))
                except AuditRequestError as exc:
                    if no_score_route(exc):
                        report.unsupported = str(exc)
                    else:
                        report.errors.append(f"sample {sample.index}: {exc}")
                except (ValueError, KeyError, TypeError) as exc:
                    report.errors.append(f"sample {sample.index}: unreadable answer: {exc!r}")
        on_done()

    todo = [s for s in samples if scorable(s)]
    report.skipped = len(samples) - len(todo)
    await asyncio.gather(*(one(s) for s in todo))
