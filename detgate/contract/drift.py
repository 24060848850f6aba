"""A drift report's arithmetic (pure, no I/O): records made on one fingerprint, replayed on
workers of another, each compared by the contract's one comparison (compare.py, as `/replay`
does), then pooled per endpoint and per tenant. The gateway builds its report and metrics
with it, and `detgate drift` merges several tenants' reports with it again.

A row is one record: its comparison's fields (`match`, `first_divergence`, `logprob_mse`,
`max_abs_logprob_diff`, `tokens_compared`, `token_agreement`) or an `error` code when the
replay could not run. Errors are counted apart: `identical_share` is over replayed records.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

ROW_FIELDS = ("match", "first_divergence", "tokens_compared", "token_agreement",
              "logprob_mse", "max_abs_logprob_diff")


def row(record_id: str, tenant: str, endpoint: str, comparison: dict | None = None,
        error: str | None = None) -> dict:
    """One record's line of the report, from its comparison (or the error that stopped it)."""
    out = {"id": record_id, "tenant": tenant, "endpoint": endpoint, "error": error}
    out.update({k: (comparison or {}).get(k) for k in ROW_FIELDS})
    return out


@dataclass(frozen=True)
class DriftSummary:
    records: int
    replayed: int
    identical: int
    errors: int
    identical_share: float | None  # None when nothing was replayed
    # Generated-token index of each diverged replay's first differing token, in row order.
    first_divergence: list[int]
    logprob_mse_mean: float | None  # mean of the replays' MSE (before their divergence)
    max_abs_logprob_diff: float | None

    @classmethod
    def of(cls, rows: Sequence[dict]) -> DriftSummary:
        replayed = [r for r in rows if r["error"] is None]
        identical = sum(1 for r in replayed if r["match"])
        mses = [r["logprob_mse"] for r in replayed if r["logprob_mse"] is not None]
        return cls(
            records=len(rows), replayed=len(replayed), identical=identical,
            errors=len(rows) - len(replayed),
            identical_share=identical / len(replayed) if replayed else None,
            first_divergence=[r["first_divergence"] for r in replayed
                              if r["first_divergence"] is not None],
            logprob_mse_mean=sum(mses) / len(mses) if mses else None,
            max_abs_logprob_diff=max((r["max_abs_logprob_diff"] for r in replayed
                                      if r["max_abs_logprob_diff"] is not None), default=None),
        )

    def as_dict(self) -> dict:
        return asdict(self)


def by(rows: Iterable[dict], key: str) -> dict[str, DriftSummary]:
    """Summaries per value of `key` ("endpoint" or "tenant"), in sorted order."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    return {k: DriftSummary.of(groups[k]) for k in sorted(groups)}


def summaries(rows: Sequence[dict]) -> dict:
    """The report's summary part: overall, per endpoint, per tenant."""
    return {"summary": DriftSummary.of(rows).as_dict(),
            "by_endpoint": {k: s.as_dict() for k, s in by(rows, "endpoint").items()},
            "by_tenant": {k: s.as_dict() for k, s in by(rows, "tenant").items()}}
