"""The one meaning of "bitwise equal" and the comparison of two answers (pure, no I/O).

Logprobs are the floats the workers sent (Python floats, parsed from JSON exactly). Two are
equal when their IEEE 754 double bit patterns are: -0.0 differs from 0.0, and a NaN equals a
NaN of the same payload, so that "the same numbers" means the same bits everywhere: in
`/replay`'s `match`, in the audit's exact matches and in the engine experiment's counts.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from detgate.contract.record import RecordChoice

Logprobs = Sequence[float | None]


def bits(x: float | None) -> bytes | None:
    """The float's IEEE 754 double bytes; None (no logprob) stays None."""
    return None if x is None else struct.pack("<d", x)


def logprob_bits(xs: Logprobs | None) -> tuple[bytes | None, ...] | None:
    """A hashable key of a logprob list that tells apart exactly what `same_bits` does."""
    return None if xs is None else tuple(bits(x) for x in xs)


def same_bits(a: Logprobs, b: Logprobs) -> bool:
    """Same length, and every logprob bitwise equal."""
    return len(a) == len(b) and all(bits(x) == bits(y) for x, y in zip(a, b, strict=True))


def first_divergence(a: Sequence, b: Sequence) -> int | None:
    """0-based index of the first differing element; a length difference counts at the
    shorter length; None when the sequences are identical."""
    shorter = min(len(a), len(b))
    for i in range(shorter):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else shorter


@dataclass(frozen=True)
class SequenceComparison:
    """One generated sequence against another."""

    first_divergence: int | None
    # a - b at each position before the first divergence where both logprobs are finite
    # numbers: the positions where both sides scored the same token.
    diffs: tuple[float, ...]
    # Identical elements and every logprob bitwise equal (never without logprobs).
    match: bool


def compare_sequences(a: Sequence, logprobs_a: Logprobs | None, b: Sequence,
                      logprobs_b: Logprobs | None) -> SequenceComparison:
    first = first_divergence(a, b)
    end = len(a) if first is None else first
    head_a, head_b = (logprobs_a or ())[:end], (logprobs_b or ())[:end]
    diffs = tuple(d for x, y in zip(head_a, head_b, strict=False)
                  if x is not None and y is not None and math.isfinite(d := x - y))
    match = (first is None and logprobs_a is not None and logprobs_b is not None
             and same_bits(logprobs_a, logprobs_b))
    return SequenceComparison(first, diffs, match)


def _same_prompt(a: RecordChoice, b: RecordChoice) -> bool:
    """An echoed prompt's logprobs are part of a match: the same ids, every logprob's bits."""
    if a.prompt_logprobs is None:
        return True
    return (b.prompt_logprobs is not None and a.prompt_token_ids == b.prompt_token_ids
            and same_bits(a.prompt_logprobs, b.prompt_logprobs))


@dataclass(frozen=True)
class Comparison:
    """The measures of a replay against its record (the contract's comparison)."""

    match: bool
    tokens_compared: int
    first_divergence: int | None
    token_agreement: float
    logprob_mse: float | None
    max_abs_logprob_diff: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def compare_choices(original: Sequence[RecordChoice], replay: Sequence[RecordChoice]
                    ) -> Comparison:
    """`first_divergence` is the smallest over choices; MSE and max |diff| pool every position
    before each choice's own divergence. A missing choice diverges at 0 and agrees nowhere;
    an extra one breaks the match. `token_agreement`: the share of positions (over the longer
    of each pair) where the token ids agree."""
    by_index = {c.index: c for c in replay}
    divergences: list[int] = []
    diffs: list[float] = []
    match = len(by_index) == len(original)
    compared = positions = agreeing = 0
    for choice in original:
        ids_a = choice.token_ids or []
        other = by_index.get(choice.index)
        if other is None:
            divergences.append(0)
            match = False
            positions += len(ids_a)
            continue
        ids_b = other.token_ids or []
        pair = compare_sequences(ids_a, choice.logprobs, ids_b, other.logprobs)
        if pair.first_divergence is not None:
            divergences.append(pair.first_divergence)
        match = match and pair.match and _same_prompt(choice, other)
        diffs.extend(pair.diffs)
        compared += max(len(ids_a), len(ids_b))
        positions += max(len(ids_a), len(ids_b))
        agreeing += sum(1 for x, y in zip(ids_a, ids_b, strict=False) if x == y)
    return Comparison(
        match=match,
        tokens_compared=compared,
        first_divergence=min(divergences, default=None),
        token_agreement=1.0 if positions == 0 else agreeing / positions,
        logprob_mse=sum(d * d for d in diffs) / len(diffs) if diffs else None,
        max_abs_logprob_diff=max((abs(d) for d in diffs), default=None),
    )
