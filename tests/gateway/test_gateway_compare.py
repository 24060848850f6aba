"""The contract's comparison (gateway/compare.py): exact, pure, no I/O."""

from __future__ import annotations

import math

from gateway.compare import compare_choices


def choice(ids, lps, index=0):
    return {"index": index, "token_ids": ids, "logprobs": lps}


def test_identical_is_a_match():
    a = [choice([1, 2, 3], [-0.1, -0.2, -0.3])]
    got = compare_choices(a, [choice([1, 2, 3], [-0.1, -0.2, -0.3])])
    assert got == {"match": True, "tokens_compared": 3, "first_divergence": None,
                   "token_agreement": 1.0, "logprob_mse": 0.0, "max_abs_logprob_diff": 0.0}


def test_one_ulp_of_logprob_breaks_the_match_but_not_the_tokens():
    x = -0.123456789
    y = math.nextafter(x, 0.0)
    got = compare_choices([choice([5, 6], [x, -1.0])], [choice([5, 6], [y, -1.0])])
    assert got["match"] is False
    assert got["first_divergence"] is None
    assert got["max_abs_logprob_diff"] == abs(x - y) > 0
    assert got["logprob_mse"] == (x - y) ** 2 / 2


def test_negative_zero_is_a_different_bit_pattern():
    got = compare_choices([choice([1], [0.0])], [choice([1], [-0.0])])
    assert got["match"] is False and got["max_abs_logprob_diff"] == 0.0


def test_divergence_position_and_stats_before_it():
    a = [choice([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0])]
    b = [choice([1, 2, 9, 4], [-1.5, -2.0, -0.1, -4.0])]
    got = compare_choices(a, b)
    assert got["first_divergence"] == 2
    assert got["logprob_mse"] == 0.25 / 2  # positions 0 and 1 only
    assert got["max_abs_logprob_diff"] == 0.5
    assert got["token_agreement"] == 3 / 4
    assert got["match"] is False


def test_length_difference_counts_at_the_shorter_length():
    got = compare_choices([choice([1, 2, 3], [-1.0, -1.0, -1.0])], [choice([1, 2], [-1.0, -1.0])])
    assert got["first_divergence"] == 2
    assert got["match"] is False
    assert got["logprob_mse"] == 0.0


def test_divergence_at_zero_has_no_logprob_stats():
    got = compare_choices([choice([1], [-1.0])], [choice([2], [-1.0])])
    assert got["first_divergence"] == 0
    assert got["logprob_mse"] is None and got["max_abs_logprob_diff"] is None


def test_n_choices_smallest_divergence_wins():
    a = [choice([1, 2, 3], [-1.0] * 3, 0), choice([4, 5, 6], [-1.0] * 3, 1)]
    b = [choice([1, 2, 7], [-1.0] * 3, 0), choice([4, 8, 6], [-1.0] * 3, 1)]
    assert compare_choices(a, b)["first_divergence"] == 1


def test_missing_choice_diverges_at_zero():
    a = [choice([1], [-1.0], 0), choice([2], [-1.0], 1)]
    got = compare_choices(a, [choice([1], [-1.0], 0)])
    assert got["first_divergence"] == 0 and got["match"] is False
