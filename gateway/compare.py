"""The replay comparison of the contract, as a pure function over recorded choices.

Logprobs are compared as the floats the workers sent (Python floats parsed from their JSON):
`match` needs every one bitwise equal, so -0.0 vs 0.0 or NaN payloads count as differences.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence


def _bits(x: float | None) -> bytes | None:
    return None if x is None else struct.pack("<d", x)


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_choices(original: list[dict], replay: list[dict]) -> dict:
    """Compare two recorded choice lists ({"index", "token_ids", "logprobs"} each).

    `first_divergence` is the smallest over choices; MSE and max |diff| pool every position
    before each choice's own divergence. A missing choice diverges at 0.
    """
    by_index = {c["index"]: c for c in replay}
    divergences: list[int] = []
    diffs: list[float] = []
    bitwise = True
    compared = 0
    for choice in original:
        other = by_index.get(choice["index"])
        ids_a = choice.get("token_ids") or []
        ids_b = (other or {}).get("token_ids") or []
        if other is None:
            divergences.append(0)
            bitwise = False
            continue
        div = _first_divergence(ids_a, ids_b)
        if div is not None:
            divergences.append(div)
        upto = len(ids_a) if div is None else div
        lp_a = (choice.get("logprobs") or [])[:upto]
        lp_b = (other.get("logprobs") or [])[:upto]
        compared += max(len(ids_a), len(ids_b))
        if len(lp_a) != len(lp_b):
            bitwise = False
        for x, y in zip(lp_a, lp_b, strict=False):
            if _bits(x) != _bits(y):
                bitwise = False
            if x is not None and y is not None:
                diffs.append(x - y)
    if len(by_index) != len(original):
        bitwise = False
    first = min(divergences) if divergences else None
    finite = [d for d in diffs if math.isfinite(d)]
    mse = sum(d * d for d in finite) / len(finite) if finite else None
    return {
        "match": first is None and bitwise,
        "tokens_compared": compared,
        "first_divergence": first,
        "token_agreement": _token_agreement(original, by_index),
        "logprob_mse": mse,
        "max_abs_logprob_diff": max((abs(d) for d in finite), default=None),
    }


def _token_agreement(original: list[dict], by_index: dict[int, dict]) -> float:
    """Share of positions (over the longer of each pair) where the token ids agree."""
    same = total = 0
    for choice in original:
        a = choice.get("token_ids") or []
        b = (by_index.get(choice["index"]) or {}).get("token_ids") or []
        total += max(len(a), len(b))
        same += sum(1 for x, y in zip(a, b, strict=False) if x == y)
    return 1.0 if total == 0 else same / total
