"""Exact float comparison for tests: the contract's own (detgate/contract/compare.py), so that
a test's "bitwise equal" is the product's."""

from __future__ import annotations

from detgate.contract.compare import logprob_bits


def bits(xs: list[float]) -> tuple[bytes | None, ...]:
    """Each float's IEEE 754 double bytes (so -0.0 != 0.0 and NaN payloads count)."""
    return logprob_bits(xs)
