"""The batch sizes a built-in worker scheduled during the audit, from its /metrics histogram.

The histogram is read before and after the run; the difference is what the audit's
traffic saw (plus whatever else the worker served meanwhile).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Histogram:
    name: str
    cumulative: dict[float, float]  # upper bound -> cumulative count
    count: float
    total: float


@dataclass(frozen=True)
class BatchSizes:
    metric: str
    # (lower bound exclusive, upper bound inclusive, steps) for each non-empty bucket.
    buckets: tuple[tuple[float, float, float], ...]
    steps: float
    total: float

    @property
    def mean(self) -> float | None:
        return self.total / self.steps if self.steps else None


def find_histogram(text: str) -> Histogram | None:
    """The first histogram whose name speaks of batch size, as exposed in `text`."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError:  # a /metrics route that is not Prometheus text: nothing to read
        return None
    for family in families:
        if family.type != "histogram" or "batch" not in family.name or "size" not in family.name:
            continue
        cumulative: dict[float, float] = {}
        count = total = 0.0
        for s in family.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                cumulative[le] = cumulative.get(le, 0.0) + s.value
            elif s.name.endswith("_count"):
                count += s.value
            elif s.name.endswith("_sum"):
                total += s.value
        return Histogram(family.name, cumulative, count, total)
    return None


def batch_sizes(before: str | None, after: str | None) -> BatchSizes | None:
    """The histogram's growth between two /metrics texts; None without such a histogram."""
    end = find_histogram(after) if after else None
    if end is None:
        return None
    start = (find_histogram(before) if before else None) or Histogram(end.name, {}, 0.0, 0.0)
    buckets = []
    previous_bound, previous_cum = -math.inf, 0.0
    for le in sorted(end.cumulative):
        cum = end.cumulative[le] - start.cumulative.get(le, 0.0)
        if cum - previous_cum > 0:
            buckets.append((previous_bound, le, cum - previous_cum))
        previous_bound, previous_cum = le, cum
    return BatchSizes(end.name, tuple(buckets), end.count - start.count, end.total - start.total)
