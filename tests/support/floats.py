"""Exact float comparison for tests: two logprob lists are equal only if every bit is."""

from __future__ import annotations

import struct


def bits(xs: list[float]) -> list[bytes]:
    """Each float's IEEE 754 double bytes (so -0.0 != 0.0 and NaN payloads count)."""
    return [struct.pack("<d", x) for x in xs]
