"""The drift report's pooling (detgate.contract.drift) over rows made from the contract's
comparisons: errors apart, shares over replayed records only, groups per endpoint and tenant."""

from __future__ import annotations

from detgate.contract.compare import compare_choices
from detgate.contract.drift import DriftSummary, row, summaries
from detgate.contract.record import RecordChoice


def choice(ids, lps):
    return [RecordChoice(index=0, token_ids=ids, logprobs=lps)]


SAME = compare_choices(choice([1, 2, 3], [-0.5, -1.0, -2.0]),
                       choice([1, 2, 3], [-0.5, -1.0, -2.0])).as_dict()
# Same tokens, one logprob a bit off; then a token that differs at position 1.
BITS = compare_choices(choice([1, 2, 3], [-0.5, -1.0, -2.0]),
                       choice([1, 2, 3], [-0.5, -1.0, -2.0 + 2 ** -20])).as_dict()
TOKEN = compare_choices(choice([1, 2, 3], [-0.5, -1.0, -2.0]),
                        choice([1, 4, 3], [-0.5, -1.5, -2.0])).as_dict()


def test_summary_counts_identical_over_replayed_records():
    rows = [row("a", "t1", "/v1/completions", SAME), row("b", "t1", "/v1/completions", BITS),
            row("c", "t2", "/v1/chat/completions", TOKEN),
            row("d", "t2", "/v1/chat/completions", error="no_healthy_worker")]
    s = DriftSummary.of(rows)
    assert (s.records, s.replayed, s.identical, s.errors) == (4, 3, 1, 1)
    assert s.identical_share == 1 / 3
    assert s.first_divergence == [1]
    assert s.max_abs_logprob_diff == 2 ** -20
    # BITS' MSE over 3 positions, SAME's 0, TOKEN's 0 (its one position before divergence).
    assert s.logprob_mse_mean == (2 ** -40 / 3) / 3
    out = summaries(rows)
    assert list(out["by_endpoint"]) == ["/v1/chat/completions", "/v1/completions"]
    assert out["by_tenant"]["t1"]["identical_share"] == 0.5
    assert out["by_tenant"]["t2"]["errors"] == 1


def test_nothing_replayed_has_no_share():
    s = DriftSummary.of([row("d", "t", "/v1/completions", error="deadline")])
    assert s.identical_share is None and s.logprob_mse_mean is None
    assert DriftSummary.of([]).records == 0
