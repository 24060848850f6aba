"""Everything one audit run produced, as the reports read it."""

from __future__ import annotations

from dataclasses import dataclass

from detgate.audit.batch_sizes import BatchSizes
from detgate.audit.client import ClientStats
from detgate.audit.runner import Collected
from detgate.audit.score import ScoreReport
from detgate.contract.analysis import Analysis


@dataclass(frozen=True)
class AuditSettings:
    base_url: str
    model: str
    endpoint: str
    prompt: str
    n: int
    concurrency: int
    mix: int
    max_tokens: int
    temperature: float
    seed: int | None


@dataclass(frozen=True)
class AuditResult:
    settings: AuditSettings
    analysis: Analysis
    collected: Collected
    stats: ClientStats
    score: ScoreReport | None
    batch_sizes: BatchSizes | None
    score_outcome: str | None = None
