"""The determinism measures over N samples of one prompt (pure: no I/O).

Every sample is compared with a reference: the first sample whose completion is the most
common one. Completions are compared by token ids when every sample has them, else by token
strings, else by characters of the text (the `unit`). First divergence, bitwise equality and
the logprob differences (before the first divergence only, where both sides scored the same
token) are the contract's (detgate/contract/compare.py), as in `/replay`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from detgate.audit.sample import Sample
from detgate.contract.compare import compare_sequences, logprob_bits

# How many tokens (or characters) of context and continuation a divergence shows.
CONTEXT_TOKENS = 6
CONTINUATION_TOKENS = 8
CONTEXT_CHARS = 40
CONTINUATION_CHARS = 40


@dataclass(frozen=True)
class Comparison:
    """One sample against the reference sample."""

    index: int
    first_divergence: int | None
    # |logprob - reference logprob| at each position before the first divergence (finite ones).
    abs_deltas: tuple[float, ...]
    logprob_mse: float | None
    max_abs_logprob_diff: float | None
    # Same completion and every logprob bitwise equal (the contract's `match`).
    exact: bool


@dataclass(frozen=True)
class Variant:
    """A continuation that left the reference at `position`, shown side by side with it."""

    position: int
    count: int
    context: str
    reference: str
    variant: str


@dataclass(frozen=True)
class Analysis:
    n: int
    unit: str
    unique_completions: int
    most_common_count: int
    # Distinct (completion, logprobs) pairs: > unique_completions when only the bits differ.
    distinct_outputs: int
    reference_index: int | None
    comparisons: tuple[Comparison, ...]
    variants: tuple[Variant, ...]
    # Without logprobs no sample, not even the reference, can be called bitwise identical.
    reference_has_logprobs: bool = False

    @property
    def first_divergence(self) -> list[int]:
        """Positions of the samples whose completion differs from the reference, in sample order."""
        return [c.first_divergence for c in self.comparisons if c.first_divergence is not None]

    @property
    def logprob_mse_mean(self) -> float | None:
        values = [c.logprob_mse for c in self.comparisons if c.logprob_mse is not None]
        return sum(values) / len(values) if values else None

    @property
    def max_abs_logprob_diff(self) -> float | None:
        values = [c.max_abs_logprob_diff for c in self.comparisons
                  if c.max_abs_logprob_diff is not None]
        return max(values) if values else None

    @property
    def exact_matches(self) -> int:
        """Samples bitwise identical to the reference, the reference included."""
        if not self.reference_has_logprobs:
            return 0
        return 1 + sum(c.exact for c in self.comparisons)


def comparison_unit(samples: Sequence[Sample]) -> str:
    if all(s.token_ids is not None for s in samples):
        return "token_id"
    if all(s.tokens is not None for s in samples):
        return "token"
    return "char"


def sequence_of(sample: Sample, unit: str) -> tuple:
    if unit == "token_id":
        return tuple(sample.token_ids)
    if unit == "token":
        return tuple(sample.tokens)
    return tuple(sample.text)


def compare(sample: Sample, reference: Sample, unit: str) -> Comparison:
    pair = compare_sequences(sequence_of(sample, unit), sample.logprobs,
                             sequence_of(reference, unit), reference.logprobs)
    # Character positions do not index logprobs.
    deltas = () if unit == "char" else tuple(abs(d) for d in pair.diffs)
    mse = sum(d * d for d in deltas) / len(deltas) if deltas else None
    return Comparison(sample.index, pair.first_divergence, deltas, mse,
                      max(deltas) if deltas else None, pair.match)


def analyse(samples: Sequence[Sample]) -> Analysis:
    if not samples:
        return Analysis(0, "token_id", 0, 0, 0, None, (), ())
    unit = comparison_unit(samples)
    counts = Counter(sequence_of(s, unit) for s in samples)
    # Counter keeps first-seen order among equal counts, so ties go to the earliest completion.
    reference_seq, most_common = counts.most_common(1)[0]
    reference = next(s for s in samples if sequence_of(s, unit) == reference_seq)
    comparisons = tuple(compare(s, reference, unit) for s in samples if s is not reference)
    return Analysis(
        n=len(samples), unit=unit, unique_completions=len(counts), most_common_count=most_common,
        distinct_outputs=len({(sequence_of(s, unit), logprob_bits(s.logprobs))
                             for s in samples}),
        reference_index=reference.index, comparisons=comparisons,
        variants=_variants(samples, reference, unit, comparisons),
        reference_has_logprobs=reference.logprobs is not None,
    )


def _variants(samples: Sequence[Sample], reference: Sample, unit: str,
              comparisons: Sequence[Comparison]) -> tuple[Variant, ...]:
    by_index = {s.index: s for s in samples}
    counts: Counter[tuple[int, str]] = Counter()
    for c in comparisons:
        if c.first_divergence is not None:
            counts[(c.first_divergence, _render(by_index[c.index], unit, c.first_divergence,
                                                c.first_divergence + _span(unit, False)))] += 1
    variants = [
        Variant(position=pos, count=count,
                context=_render(reference, unit, max(0, pos - _span(unit, True)), pos),
                reference=_render(reference, unit, pos, pos + _span(unit, False)),
                variant=text)
        for (pos, text), count in counts.items()
    ]
    return tuple(sorted(variants, key=lambda v: (-v.count, v.position)))


def _span(unit: str, context: bool) -> int:
    if unit == "char":
        return CONTEXT_CHARS if context else CONTINUATION_CHARS
    return CONTEXT_TOKENS if context else CONTINUATION_TOKENS


def _render(sample: Sample, unit: str, start: int, end: int) -> str:
    """Text of positions [start, end): token strings where known, else the ids themselves."""
    if unit == "char":
        return sample.text[start:end]
    if sample.tokens is not None and len(sample.tokens) == len(sequence_of(sample, unit)):
        return "".join(sample.tokens[start:end])
    return " ".join(f"<{t}>" for t in sequence_of(sample, unit)[start:end])
