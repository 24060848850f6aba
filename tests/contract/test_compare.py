"""The contract's comparison (detgate/contract/compare.py): one meaning of bitwise equal and of
first divergence, exact and pure."""

from __future__ import annotations

import math
import struct

import pytest

from detgate.contract.compare import (
    bits,
    compare_choices,
    compare_sequences,
    first_divergence,
    logprob_bits,
    same_bits,
)
from detgate.contract.record import RecordChoice

OTHER_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_0001))[0]


def choice(ids, lps, index=0):
    return RecordChoice(index=index, token_ids=ids, logprobs=lps)


@pytest.mark.parametrize(("a", "b", "expected"), [
    ([1, 2, 3], [1, 2, 3], None),
    ([], [], None),
    ([1, 2, 3], [1, 9, 3], 1),
    ([7], [8], 0),
    ([1, 2, 3], [1, 2], 2),          # a length difference counts at the shorter length
    ([1, 2], [1, 2, 3, 4], 2),
    ([], [5], 0),
    ([1, 2, 3], [1, 2, 4, 5, 6], 2),  # a differing token before the length difference wins
    ("abc", "abd", 2),                # any sequence: the audit compares text too
])
def test_first_divergence(a, b, expected):
    assert first_divergence(a, b) == expected
    assert first_divergence(b, a) == expected


def test_bitwise_equal_is_equal_bit_patterns():
    assert same_bits([-0.5, None], [-0.5, None])
    assert not same_bits([0.0], [-0.0])  # == says equal; the bits differ
    assert same_bits([math.nan], [math.nan])  # == says different; the bits agree
    assert not same_bits([math.nan], [OTHER_NAN])  # another payload
    assert not same_bits([-0.5], [-0.5, -0.5])
    assert not same_bits([None], [0.0])
    assert bits(None) is None and logprob_bits(None) is None
    assert len({logprob_bits([0.0]), logprob_bits([-0.0])}) == 2


def test_sequence_comparison_needs_logprobs_to_match():
    assert compare_sequences([1], [-1.0], [1], [-1.0]).match
    assert not compare_sequences([1], None, [1], None).match


def test_non_finite_differences_are_not_averaged():
    pair = compare_sequences([1, 2, 3], [math.nan, -math.inf, -1.0], [1, 2, 3],
                             [math.nan, -math.inf, -1.5])
    assert pair.diffs == (0.5,) and not pair.match


def test_identical_is_a_match():
    a = [choice([1, 2, 3], [-0.1, -0.2, -0.3])]
    got = compare_choices(a, [choice([1, 2, 3], [-0.1, -0.2, -0.3])])
    assert got.as_dict() == {"match": True, "tokens_compared": 3, "first_divergence": None,
                             "token_agreement": 1.0, "logprob_mse": 0.0,
                             "max_abs_logprob_diff": 0.0}


def test_one_ulp_of_logprob_breaks_the_match_but_not_the_tokens():
    x = -0.123456789
    y = math.nextafter(x, 0.0)
    got = compare_choices([choice([5, 6], [x, -1.0])], [choice([5, 6], [y, -1.0])])
    assert got.match is False
    assert got.first_divergence is None
    assert got.max_abs_logprob_diff == abs(x - y) > 0
    assert got.logprob_mse == (x - y) ** 2 / 2


def test_negative_zero_is_a_different_bit_pattern():
    got = compare_choices([choice([1], [0.0])], [choice([1], [-0.0])])
    assert got.match is False and got.max_abs_logprob_diff == 0.0


def test_the_same_nan_matches_and_has_no_difference():
    got = compare_choices([choice([1, 2], [math.nan, -1.0])], [choice([1, 2], [math.nan, -1.0])])
    assert got.match is True and got.logprob_mse == 0.0


def test_divergence_position_and_stats_before_it():
    a = [choice([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0])]
    b = [choice([1, 2, 9, 4], [-1.5, -2.0, -0.1, -4.0])]
    got = compare_choices(a, b)
    assert got.first_divergence == 2
    assert got.logprob_mse == 0.25 / 2  # positions 0 and 1 only
    assert got.max_abs_logprob_diff == 0.5
    assert got.token_agreement == 3 / 4
    assert got.match is False


def test_length_difference_counts_at_the_shorter_length():
    got = compare_choices([choice([1, 2, 3], [-1.0, -1.0, -1.0])], [choice([1, 2], [-1.0, -1.0])])
    assert got.first_divergence == 2
    assert got.match is False
    assert got.logprob_mse == 0.0


def test_divergence_at_zero_has_no_logprob_stats():
    got = compare_choices([choice([1], [-1.0])], [choice([2], [-1.0])])
    assert got.first_divergence == 0
    assert got.logprob_mse is None and got.max_abs_logprob_diff is None


def test_n_choices_smallest_divergence_wins():
    a = [choice([1, 2, 3], [-1.0] * 3, 0), choice([4, 5, 6], [-1.0] * 3, 1)]
    b = [choice([1, 2, 7], [-1.0] * 3, 0), choice([4, 8, 6], [-1.0] * 3, 1)]
    assert compare_choices(a, b).first_divergence == 1


def test_missing_choice_diverges_at_zero():
    a = [choice([1], [-1.0], 0), choice([2], [-1.0], 1)]
    got = compare_choices(a, [choice([1], [-1.0], 0)])
    assert got.first_divergence == 0 and got.match is False
    assert got.token_agreement == 1 / 2


def test_an_extra_choice_breaks_the_match():
    a = [choice([1], [-1.0], 0)]
    got = compare_choices(a, [choice([1], [-1.0], 0), choice([1], [-1.0], 1)])
    assert got.first_divergence is None and got.match is False
