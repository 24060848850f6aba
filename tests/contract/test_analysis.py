"""The contract's determinism analysis on hand-made answers, edge cases included: N answers to
one request (`analyse`) and sampled against teacher-forced logprobs (`compare_to_teacher`)."""

from __future__ import annotations

import math

import pytest

from detgate.contract.analysis import Answer as Sample
from detgate.contract.analysis import (
    TeacherTotals,
    analyse,
    compare,
    compare_to_teacher,
    comparison_unit,
)


def sample(index: int, ids: list[int] | None = None, logprobs: list[float] | None = None,
           tokens: list[str] | None = None, text: str | None = None) -> Sample:
    if tokens is None and ids is not None:
        tokens = [f"t{i} " for i in ids]
    if text is None:
        text = "".join(tokens or [])
    if logprobs is None and ids is not None:
        logprobs = [-0.5] * len(ids)
    return Sample(index=index, text=text, token_ids=tuple(ids) if ids is not None else None,
                  tokens=tuple(tokens) if tokens is not None else None,
                  logprobs=tuple(logprobs) if logprobs is not None else None)


def test_identical_samples_give_one_completion_and_zero_differences():
    samples = [sample(i, [1, 2, 3], [-0.1, -0.2, -0.3]) for i in range(5)]
    result = analyse(samples)
    assert (result.n, result.unique_completions, result.most_common_count) == (5, 1, 5)
    assert result.first_divergence == []
    assert result.logprob_mse_mean == 0.0
    assert result.max_abs_logprob_diff == 0.0
    assert result.exact_matches == 5 and result.distinct_outputs == 1
    assert result.variants == ()
    assert result.unit == "token_id"


def test_bit_level_logprob_difference_without_token_flip_is_measured():
    lp = -0.25
    nudged = lp + 2.0**-40  # a few ulps: what batch variance does on CPU
    samples = [sample(0, [1, 2], [lp, lp]), sample(1, [1, 2], [lp, lp]),
               sample(2, [1, 2], [lp, nudged])]
    result = analyse(samples)
    assert result.unique_completions == 1
    assert result.first_divergence == []
    assert result.max_abs_logprob_diff == abs(nudged - lp) > 0
    assert result.logprob_mse_mean == pytest.approx((abs(nudged - lp) ** 2 / 2) / 2)
    assert result.exact_matches == 2
    assert result.distinct_outputs == 2


def test_reference_is_the_most_common_completion_and_positions_follow_it():
    a, b, c = [1, 2, 3, 4], [1, 2, 9, 9], [1, 5, 5, 5]
    samples = [sample(0, b), sample(1, a), sample(2, a), sample(3, c), sample(4, a)]
    result = analyse(samples)
    assert result.reference_index == 1
    assert (result.unique_completions, result.most_common_count) == (3, 3)
    # Sample order, the reference excluded, identical samples excluded.
    assert result.first_divergence == [2, 1]
    assert [c.index for c in result.comparisons] == [0, 2, 3, 4]


def test_tie_between_completions_goes_to_the_first_seen():
    result = analyse([sample(0, [1]), sample(1, [2]), sample(2, [2]), sample(3, [1])])
    assert result.reference_index == 0
    assert result.first_divergence == [0, 0]


def test_logprobs_are_compared_only_before_the_first_divergence():
    ref = sample(0, [1, 2, 3, 4], [-1.0, -1.0, -1.0, -1.0])
    other = sample(1, [1, 2, 7, 4], [-1.5, -1.0, -9.0, -9.0])
    result = compare(other, ref, "token_id")
    assert result.first_divergence == 2
    assert result.abs_deltas == (0.5, 0.0)
    assert result.logprob_mse == pytest.approx(0.125)
    assert result.max_abs_logprob_diff == 0.5
    assert not result.exact


def test_shorter_completion_is_compared_over_the_common_prefix():
    ref = sample(0, [1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0])
    short = sample(1, [1, 2], [-1.0, -2.25])
    result = compare(short, ref, "token_id")
    assert result.first_divergence == 2
    assert result.abs_deltas == (0.0, 0.25)


def test_divergence_at_zero_has_no_logprob_positions():
    result = compare(sample(1, [5, 2], [-1.0, -1.0]), sample(0, [1, 2], [-2.0, -1.0]), "token_id")
    assert result.first_divergence == 0
    assert (result.logprob_mse, result.max_abs_logprob_diff, result.abs_deltas) == (None, None, ())


def test_all_diverging_at_zero_gives_null_logprob_measures():
    result = analyse([sample(0, [1]), sample(1, [2]), sample(2, [3])])
    assert result.first_divergence == [0, 0]
    assert result.logprob_mse_mean is None and result.max_abs_logprob_diff is None


def test_missing_logprob_entries_are_skipped():
    ref = Sample(0, "ab", (1, 2), ("a", "b"), (None, -1.0))
    other = Sample(1, "ab", (1, 2), ("a", "b"), (-3.0, -1.5))
    assert compare(other, ref, "token_id").abs_deltas == (0.5,)


def test_without_token_ids_tokens_are_compared():
    samples = [sample(0, tokens=["Queens", ",", " New", " York"], logprobs=[-1.0] * 4),
               sample(1, tokens=["Queens", ",", " New", " York"], logprobs=[-1.0] * 4),
               sample(2, tokens=["New", " York", " City"], logprobs=[-1.0] * 3)]
    assert comparison_unit(samples) == "token"
    result = analyse(samples)
    assert result.unit == "token"
    assert result.first_divergence == [0]
    assert result.variants[0].reference.startswith("Queens, New York")
    assert result.variants[0].variant == "New York City"


def test_without_tokens_text_is_compared_by_character():
    samples = [Sample(0, "Queens, New York"), Sample(1, "Queens, New York"),
               Sample(2, "Queens, NY")]
    result = analyse(samples)
    assert result.unit == "char"
    assert result.first_divergence == [len("Queens, N")]
    assert result.logprob_mse_mean is None and result.max_abs_logprob_diff is None
    assert result.variants[0].context == "Queens, N"
    assert result.variants[0].variant == "Y"


def test_one_sample_without_ids_switches_every_sample_to_tokens():
    samples = [sample(0, [1, 2]), sample(1, tokens=["t1 ", "t2 "], logprobs=[-0.5, -0.5])]
    result = analyse(samples)
    assert result.unit == "token"
    assert result.unique_completions == 1


def test_variants_group_identical_continuations_and_show_context():
    born = ["He", " was", " born", " in"]
    queens = born + [" Queens", ",", " New", " York"]
    nyc = born + [" New", " York", " City", "."]
    ids = {t: i for i, t in enumerate(sorted(set(queens + nyc)))}
    samples = [sample(i, [ids[t] for t in queens], tokens=queens) for i in range(5)]
    samples += [sample(5 + i, [ids[t] for t in nyc], tokens=nyc) for i in range(2)]
    result = analyse(samples)
    assert (result.unique_completions, result.most_common_count) == (2, 5)
    assert result.first_divergence == [4, 4]
    (variant,) = result.variants
    assert (variant.position, variant.count) == (4, 2)
    assert variant.context == "He was born in"
    assert variant.reference == " Queens, New York"
    assert variant.variant == " New York City."


def test_variants_without_token_strings_show_ids():
    samples = [Sample(0, "x", (1, 2), None, None), Sample(1, "x", (1, 2), None, None),
               Sample(2, "y", (1, 3), None, None)]
    result = analyse(samples)
    assert result.variants[0].variant == "<3>"
    assert result.variants[0].context == "<1>"


def test_exact_needs_logprobs():
    samples = [Sample(0, "x", (1,), None, None), Sample(1, "x", (1,), None, None)]
    result = analyse(samples)
    assert result.unique_completions == 1
    assert result.comparisons[0].exact is False
    assert result.exact_matches == 0
    assert result.max_abs_logprob_diff is None


def test_no_samples():
    result = analyse([])
    assert (result.n, result.unique_completions, result.most_common_count) == (0, 0, 0)
    assert result.first_divergence == [] and result.logprob_mse_mean is None


def test_the_reference_is_the_most_common_exact_variant_of_the_most_common_completion():
    """Three answers share ids; two of them also share bits: the reference is one of those
    two, so only the odd one out counts a logprob difference."""
    odd = sample(0, [1, 2], [-0.5, -1.0000001])
    same = [sample(i, [1, 2], [-0.5, -1.0]) for i in (1, 2)]
    result = analyse([odd, *same, sample(3, [1, 7], [-0.5, -2.0])])
    assert result.reference_index == 1
    assert result.exact_matches == 2 and result.distinct_outputs == 3
    assert result.max_abs_logprob_diff == abs(-1.0000001 - -1.0)
    assert result.first_divergence == [1]


def test_bitwise_equal_logprobs_give_zero_delta_and_zero_kl():
    score = compare_to_teacher([-0.1, -2.5, -0.003], [-0.1, -2.5, -0.003])
    assert (score.tokens, score.identical, score.max_abs_diff, score.sum_kl) == (3, 3, 0.0, 0.0)
    assert score.exact


def test_signed_zero_is_not_identical_to_the_teacher():
    score = compare_to_teacher([0.0, -1.0], [-0.0, -1.0])
    assert (score.identical, score.max_abs_diff, score.exact) == (1, 0.0, False)


def test_kl_estimate_is_the_mean_of_k3_over_all_tokens():
    totals = TeacherTotals.of([compare_to_teacher([-1.0, -2.0], [-1.5, -2.0]),
                               compare_to_teacher([-1.0, None], [-0.75, -9.0])])
    assert totals.tokens == 3  # a missing sampled logprob is skipped
    k3 = [math.exp(-d) - 1 + d for d in (0.5, 0.0, -0.25)]
    assert math.isclose(totals.kl, sum(k3) / 3)
    assert totals.max_abs_diff == 0.5
    assert (totals.identical, totals.all_identical) == (1, False)


def test_kl_estimate_is_positive_whenever_logprobs_differ():
    """Differences of either sign, down to rounding noise, give a KL above 0 (the mean of
    the differences themselves would be 0 here)."""
    totals = TeacherTotals.of([compare_to_teacher([-1.0, -2.0], [-1.0 + 2e-7, -2.0 - 2e-7])])
    assert totals.kl > 0.0
    assert math.isclose(totals.kl, (2e-7) ** 2 / 2, rel_tol=1e-3)


def test_teacher_length_mismatch_is_an_error():
    with pytest.raises(ValueError):
        compare_to_teacher([-1.0], [-1.0, -2.0])


def test_no_tokens_give_no_figures():
    totals = TeacherTotals.of([])
    assert totals.kl is None and totals.max_abs_diff is None and totals.all_identical
