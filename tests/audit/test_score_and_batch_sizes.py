"""The audit's teacher-forced report and the worker's batch-size histogram, on fixed inputs."""

from __future__ import annotations

import math

import pytest

from detgate.audit.batch_sizes import batch_sizes, find_histogram
from detgate.audit.sample import Sample
from detgate.audit.score import ScoreReport, scorable
from detgate.contract.analysis import compare_to_teacher


def test_report_pools_its_samples_by_the_contract():
    report = ScoreReport(scored=[(0, compare_to_teacher([-1.0, -2.0], [-1.5, -2.0])),
                                 (1, compare_to_teacher([-1.0], [-1.0]))])
    assert report.exact == 1
    assert report.totals.max_abs_diff == 0.5 and report.totals.tokens == 3
    assert ScoreReport().totals.kl is None


def test_only_samples_with_ids_and_logprobs_are_scorable():
    assert scorable(Sample(0, "x", (1,), ("x",), (-1.0,), (5, 6)))
    assert not scorable(Sample(0, "x", (1,), ("x",), (-1.0,), None))
    assert not scorable(Sample(0, "x", None, ("x",), (-1.0,), (5, 6)))
    assert not scorable(Sample(0, "", (), (), (), (5, 6)))


def metrics(counts: dict[str, int], total: float) -> str:
    lines = ["# HELP detgate_worker_batch_size_seqs Sequences scheduled in one engine step",
             "# TYPE detgate_worker_batch_size_seqs histogram"]
    cumulative = 0
    for le, n in counts.items():
        cumulative += n
        lines.append(f'detgate_worker_batch_size_seqs_bucket{{le="{le}"}} {cumulative}')
    lines += [f"detgate_worker_batch_size_seqs_count {cumulative}",
              f"detgate_worker_batch_size_seqs_sum {total}",
              "# HELP other_seconds x", "# TYPE other_seconds histogram",
              'other_seconds_bucket{le="+Inf"} 1', "other_seconds_count 1", "other_seconds_sum 1"]
    return "\n".join(lines) + "\n"


def test_batch_sizes_are_the_growth_of_the_histogram():
    before = metrics({"1.0": 5, "2.0": 0, "4.0": 1, "+Inf": 0}, 9.0)
    after = metrics({"1.0": 7, "2.0": 3, "4.0": 5, "+Inf": 0}, 9.0 + 2 + 6 + 14)
    sizes = batch_sizes(before, after)
    assert sizes.metric == "detgate_worker_batch_size_seqs"
    assert sizes.buckets == ((-math.inf, 1.0, 2.0), (1.0, 2.0, 3.0), (2.0, 4.0, 4.0))
    assert sizes.steps == 9 and sizes.mean == pytest.approx(22 / 9)


def test_no_batch_size_histogram_means_no_figures():
    assert batch_sizes(None, "# TYPE x_total counter\nx_total 1\n") is None
    assert batch_sizes(None, None) is None
    assert batch_sizes(None, "<html>not prometheus</html>") is None
    assert find_histogram(metrics({"+Inf": 1}, 1)).name == "detgate_worker_batch_size_seqs"
