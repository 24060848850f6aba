"""The on-policy check: sampled logprobs against the teacher-forced ones of /v1/score.

A trainer recomputes the logprobs of the sampled tokens in one full forward pass; when the
sampler's numbers equal those bitwise, the sampler-trainer KL estimate is exactly 0 and no
importance weighting is needed. The comparison and the estimate are the contract's
(`detgate.contract.analysis.compare_to_teacher`); this module sends the score requests.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from detgate.audit.client import AuditRequestError, EndpointClient
from detgate.audit.sample import Sample
from detgate.contract.analysis import TeacherComparison, TeacherTotals, compare_to_teacher

# Answers meaning "this endpoint has no score route".
NO_ROUTE_STATUSES = frozenset({404, 405})
# The gateway's answer when no worker behind it offers the built-in score (vLLM only).
NO_SCORE_WORKER = (409, "no_score_worker")


@dataclass
class ScoreReport:
    # (sample index, its comparison) in the order the answers came
    scored: list[tuple[int, TeacherComparison]] = field(default_factory=list)
    # Samples without token ids, prompt token ids or logprobs cannot be teacher-forced.
    skipped: int = 0
    errors: list[str] = field(default_factory=list)
    # Set when the endpoint has no score route: the remaining samples are not sent.
    unsupported: str | None = None

    @property
    def totals(self) -> TeacherTotals:
        return TeacherTotals.of([c for _, c in self.scored])

    @property
    def exact(self) -> int:
        """Samples whose every sampled logprob has the teacher-forced one's bits."""
        return sum(c.exact for _, c in self.scored)


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
                    compared = compare_to_teacher(sample.logprobs, teacher)
                    report.scored.append((sample.index, compared))
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
