"""Teacher-forced comparison and the worker's batch-size histogram, on fixed inputs."""

from __future__ import annotations

import math

import pytest

from detgate.audit.batch_sizes import batch_sizes, find_histogram
from detgate.audit.sample import Sample
from detgate.audit.score import ScoreReport, compare_to_teacher, scorable


def test_bitwise_equal_logprobs_give_zero_delta_and_zero_kl():
    score = compare_to_teacher(0, [-0.1, -2.5, -0.003], [-0.1, -2.5, -0.003])
    assert (score.tokens, score.max_abs_logprob_diff, score.sum_logprob_diff) == (3, 0.0, 0.0)
    assert score.exact


def test_kl_estimate_is_the_mean_of_sampler_minus_trainer_over_all_tokens():
    report = ScoreReport(scored=[compare_to_teacher(0, [-1.0, -2.0], [-1.5, -2.0]),
                                 compare_to_teacher(1, [-1.0, None], [-0.75, -9.0])])
    assert report.scored[1].tokens == 1  # a missing sampled logprob is skipped
    assert report.kl_estimate == pytest.approx((0.5 + 0.0 - 0.25) / 3)
    assert report.max_abs_logprob_diff == 0.5
    assert report.exact == 0


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError):
        compare_to_teacher(0, [-1.0], [-1.0, -2.0])


def test_empty_report_has_no_figures():
    assert ScoreReport().kl_estimate is None and ScoreReport().max_abs_logprob_diff is None


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
