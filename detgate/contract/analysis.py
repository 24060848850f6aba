"""The determinism analysis, defined once (pure: no I/O), for the audit, the engine
experiment, the RL loop and the benchmarks alike.

- `analyse`: N answers to one request. Every answer is compared with a reference: among the
  answers whose completion is the most common one, the first of the most common exact variant
  (completion and logprob bits). Completions are compared by token ids when every answer has
  them, else by token strings, else by characters of the text (the `unit`). First divergence,
  bitwise equality and the logprob differences (before the first divergence only, where both
  sides scored the same token) are the contract's (compare.py), as in `/replay`.
- `compare_to_teacher` and `TeacherTotals`: sampled logprobs against the teacher-forced ones
  of the same tokens (a trainer's, or `/v1/score`'s), position by position, bit for bit, with
  the sampler-trainer KL estimate: the mean over sampled tokens of logp_sampler - logp_trainer
  (a Monte Carlo estimate of KL(sampler || trainer); exactly 0 when every pair has the same
  bits).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from detgate.contract.compare import bits, compare_sequences, logprob_bits

# How many tokens (or characters) of context and continuation a divergence shows.
CONTEXT_TOKENS = 6
CONTINUATION_TOKENS = 8
CONTEXT_CHARS = 40
CONTINUATION_CHARS = 40


@dataclass(frozen=True)
class Answer:
    """One completion of the analysed request. `token_ids` (vLLM's `return_token_ids`) and
    `tokens` / `logprobs` (the standard logprobs field) are None where the endpoint did not
    give them; their positions refer to the same generated tokens."""

    index: int
    text: str = ""
    token_ids: tuple[int, ...] | None = None
    tokens: tuple[str, ...] | None = None
    logprobs: tuple[float | None, ...] | None = None


@dataclass(frozen=True)
class Comparison:
    """One answer against the reference answer."""

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
    # Without logprobs no answer, not even the reference, can be called bitwise identical.
    reference_has_logprobs: bool = False

    @property
    def first_divergence(self) -> list[int]:
        """Positions of the answers whose completion differs from the reference, in answer
        order."""
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
        """Answers bitwise identical to the reference, the reference included."""
        if not self.reference_has_logprobs:
            return 0
        return 1 + sum(c.exact for c in self.comparisons)


def comparison_unit(answers: Sequence[Answer]) -> str:
    if all(s.token_ids is not None for s in answers):
        return "token_id"
    if all(s.tokens is not None for s in answers):
        return "token"
    return "char"


def sequence_of(answer: Answer, unit: str) -> tuple:
    if unit == "token_id":
        return tuple(answer.token_ids)
    if unit == "token":
        return tuple(answer.tokens)
    return tuple(answer.text)


def compare(answer: Answer, reference: Answer, unit: str) -> Comparison:
    pair = compare_sequences(sequence_of(answer, unit), answer.logprobs,
                             sequence_of(reference, unit), reference.logprobs)
    # Character positions do not index logprobs.
    deltas = () if unit == "char" else tuple(abs(d) for d in pair.diffs)
    mse = sum(d * d for d in deltas) / len(deltas) if deltas else None
    return Comparison(answer.index, pair.first_divergence, deltas, mse,
                      max(deltas) if deltas else None, pair.match)


def analyse(answers: Sequence[Answer]) -> Analysis:
    if not answers:
        return Analysis(0, "token_id", 0, 0, 0, None, (), ())
    unit = comparison_unit(answers)
    counts = Counter(sequence_of(s, unit) for s in answers)
    # Counter keeps first-seen order among equal counts, so ties go to the earliest completion.
    reference_seq, most_common = counts.most_common(1)[0]
    exact = Counter((seq, logprob_bits(s.logprobs)) for s in answers
                    if (seq := sequence_of(s, unit)) == reference_seq)
    reference_bits = exact.most_common(1)[0][0][1]
    reference = next(s for s in answers if sequence_of(s, unit) == reference_seq
                     and logprob_bits(s.logprobs) == reference_bits)
    comparisons = tuple(compare(s, reference, unit) for s in answers if s is not reference)
    return Analysis(
        n=len(answers), unit=unit, unique_completions=len(counts), most_common_count=most_common,
        distinct_outputs=len({(sequence_of(s, unit), logprob_bits(s.logprobs))
                             for s in answers}),
        reference_index=reference.index, comparisons=comparisons,
        variants=_variants(answers, reference, unit, comparisons),
        reference_has_logprobs=reference.logprobs is not None,
    )


def _variants(answers: Sequence[Answer], reference: Answer, unit: str,
              comparisons: Sequence[Comparison]) -> tuple[Variant, ...]:
    by_index = {s.index: s for s in answers}
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


def _render(answer: Answer, unit: str, start: int, end: int) -> str:
    """Text of positions [start, end): token strings where known, else the ids themselves."""
    if unit == "char":
        return answer.text[start:end]
    if answer.tokens is not None and len(answer.tokens) == len(sequence_of(answer, unit)):
        return "".join(answer.tokens[start:end])
    return " ".join(f"<{t}>" for t in sequence_of(answer, unit)[start:end])


@dataclass(frozen=True)
class TeacherComparison:
    """One sequence's sampled logprobs against the teacher-forced ones of the same tokens."""

    tokens: int  # positions with a sampled logprob
    identical: int  # of those, the ones whose two logprobs have the same bits
    max_abs_diff: float
    sum_kl: float  # sum over the tokens of the KL estimate k3 (below)

    @property
    def exact(self) -> bool:
        return self.identical == self.tokens


def compare_to_teacher(sampled: Sequence[float | None], teacher: Sequence[float]
                       ) -> TeacherComparison:
    if len(sampled) != len(teacher):
        raise ValueError(f"{len(sampled)} sampled logprobs but {len(teacher)} teacher-forced ones")
    pairs = [(s, t) for s, t in zip(sampled, teacher, strict=True) if s is not None]
    diffs = [s - t for s, t in pairs]
    return TeacherComparison(
        tokens=len(pairs), identical=sum(bits(s) == bits(t) for s, t in pairs),
        max_abs_diff=max((abs(d) for d in diffs), default=0.0),
        sum_kl=sum(_k3(d) for d in diffs))


def _k3(d: float) -> float:
    """One sampled token's estimate of KL(sampler || trainer), d = logp_sampler - logp_trainer:
    with r = p_trainer / p_sampler = exp(-d), k3 = (r - 1) - log r (Schulman's estimator). Its
    mean over tokens drawn from the sampler is unbiased, like the mean of d itself, but each
    term is >= 0 and 0 only where d is 0, so a run whose logprobs differ never reports a KL of
    0 or below by chance. expm1 keeps its d**2 / 2 exact for the tiny d of rounding noise."""
    return math.expm1(-d) + d


@dataclass(frozen=True)
class TeacherTotals:
    """Many sequences' comparisons pooled over their tokens."""

    sequences: int
    tokens: int
    identical: int
    max_abs_diff: float | None
    kl: float | None  # the KL(sampler || trainer) estimate; None without tokens

    @classmethod
    def of(cls, comparisons: Sequence[TeacherComparison]) -> TeacherTotals:
        tokens = sum(c.tokens for c in comparisons)
        return cls(sequences=len(comparisons), tokens=tokens,
                   identical=sum(c.identical for c in comparisons),
                   max_abs_diff=max((c.max_abs_diff for c in comparisons), default=None),
                   kl=sum(c.sum_kl for c in comparisons) / tokens if tokens else None)

    @property
    def all_identical(self) -> bool:
        return self.identical == self.tokens
