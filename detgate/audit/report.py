"""The audit's outputs: the contract's JSON, the terminal report, and report.md.

The terminal and Markdown reports show the same rows, built once here.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from detgate.audit.result import AuditResult

TOP_POSITIONS = 12
TOP_VARIANTS = 10
MAX_ERRORS_SHOWN = 5


def fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    return "0" if value == 0 else f"{value:.3g}"


def contract_json(result: AuditResult) -> dict:
    """The contract's fields at the top level; everything else under `details`."""
    a, s, c = result.analysis, result.settings, result.collected
    return {
        "n": a.n,
        "unique_completions": a.unique_completions,
        "most_common_count": a.most_common_count,
        "first_divergence": a.first_divergence,
        "logprob_mse_mean": a.logprob_mse_mean,
        "max_abs_logprob_diff": a.max_abs_logprob_diff,
        "details": {
            "base_url": s.base_url, "model": s.model, "endpoint": s.endpoint, "prompt": s.prompt,
            "requested": s.n, "concurrency": s.concurrency, "mix": s.mix,
            "max_tokens": s.max_tokens, "temperature": s.temperature, "seed": s.seed,
            "outcome": c.outcome, "failed": c.failed, "errors": [e for _, e in c.errors[:20]],
            "mixed_in_requests": c.mix_done, "mixed_in_errors": c.mix_errors,
            "retries": result.stats.retries, "dropped_fields": result.stats.dropped_fields,
            "compared_by": a.unit, "reference_index": a.reference_index,
            "exact_matches": a.exact_matches, "distinct_outputs": a.distinct_outputs,
            "fingerprints": sorted({x.fingerprint for x in c.samples if x.fingerprint}),
            "samples": [
                {"index": x.index, "first_divergence": x.first_divergence,
                 "logprob_mse": x.logprob_mse, "max_abs_logprob_diff": x.max_abs_logprob_diff,
                 "exact": x.exact}
                for x in a.comparisons
            ],
            "variants": [vars(v) for v in a.variants],
            "score": _score_json(result),
            "batch_sizes": _batch_json(result),
        },
    }


def _score_json(result: AuditResult) -> dict | None:
    sc = result.score
    if sc is None:
        return None
    return {"outcome": result.score_outcome, "scored": len(sc.scored), "skipped": sc.skipped,
            "exact": sc.exact, "max_abs_logprob_diff": sc.totals.max_abs_diff,
            "kl_estimate": sc.totals.kl, "unsupported": sc.unsupported,
            "errors": sc.errors[:20]}


def _batch_json(result: AuditResult) -> dict | None:
    b = result.batch_sizes
    if b is None:
        return None
    return {"metric": b.metric, "steps": b.steps, "mean": b.mean,
            "buckets": [{"above": lo, "up_to": hi, "steps": n} for lo, hi, n in b.buckets]}


def write_json(result: AuditResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(contract_json(result), indent=2) + "\n")


def summary_rows(result: AuditResult) -> list[tuple[str, str]]:
    a, s, c = result.analysis, result.settings, result.collected
    positions = a.first_divergence
    rows = [
        ("endpoint", f"{s.base_url} ({s.endpoint}), model {s.model}"),
        ("load", f"{s.n} requests, {s.concurrency} at a time, {s.mix} mixed-in streams "
                 f"({c.mix_done} other requests)"),
        ("sampling", f"temperature {s.temperature:g}, max_tokens {s.max_tokens}"
                     + (f", seed {s.seed}" if s.seed is not None else "")),
        ("samples", f"{a.n} answered, {c.failed} failed" + _outcome_note(c.outcome)),
        ("unique completions", str(a.unique_completions)),
        ("most common count", f"{a.most_common_count} of {a.n}"),
        ("diverging samples", f"{len(positions)}" + (
            f" (first divergence min {min(positions)}, median {statistics.median(positions):g}, "
            f"max {max(positions)})" if positions else "")),
        ("exact matches", f"{a.exact_matches} of {a.n} (same {_unit_name(a.unit)}, "
                          "logprobs bitwise equal)"),
        ("numerically distinct answers", f"{a.distinct_outputs} (completion and logprobs)"),
        ("logprob MSE (mean)", fmt(a.logprob_mse_mean)),
        ("max |delta logprob|", fmt(a.max_abs_logprob_diff)),
    ]
    if result.score is not None and result.score.unsupported:
        rows.append(("teacher-forced samples", f"endpoint offers no /score route "
                                               f"({result.score.unsupported})"))
    elif result.score is not None:
        sc = result.score
        rows += [
            ("teacher-forced samples", f"{len(sc.scored)} scored, {sc.skipped} skipped, "
                                       f"{len(sc.errors)} failed; {sc.exact} bitwise equal"
                                       + _outcome_note(result.score_outcome or "complete")),
            ("max |sampler - trainer|", fmt(sc.totals.max_abs_diff)),
            ("sampler-trainer KL estimate", fmt(sc.totals.kl)),
        ]
    if result.batch_sizes is None:
        rows.append(("batch sizes seen", "not exposed (no batch-size histogram at /metrics)"))
    else:
        b = result.batch_sizes
        rows.append(("batch sizes seen", f"{b.steps:g} steps, mean {fmt(b.mean)}: " + ", ".join(
            f"{_bucket(lo, hi)}: {n:g}" for lo, hi, n in b.buckets)))
    if result.stats.retries or result.stats.dropped_fields:
        rows.append(("client", f"{result.stats.retries} retries; endpoint rejected: "
                               f"{', '.join(result.stats.dropped_fields) or 'nothing'}"))
    return rows


def _unit_name(unit: str) -> str:
    return {"token_id": "token ids", "token": "tokens", "char": "text"}[unit]


def _outcome_note(outcome: str) -> str:
    return {"complete": "", "interrupted": " (interrupted: partial results)",
            "timeout": " (time bound reached: partial results)"}[outcome]


def _bucket(lo: float, hi: float) -> str:
    """A bucket (lo, hi] of integer batch sizes, as the sizes it holds: '3-4', '8', '>64'."""
    if hi == math.inf:
        return f">{lo:g}"
    first = 1 if lo == -math.inf else math.floor(lo) + 1
    return f"{hi:g}" if first >= hi else f"{first}-{hi:g}"


def position_rows(result: AuditResult) -> list[tuple[int, int]]:
    return sorted(Counter(result.analysis.first_divergence).items())[:TOP_POSITIONS]


def render_terminal(result: AuditResult, console: Console) -> None:
    table = Table(title="detgate audit", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for label, value in summary_rows(result):
        table.add_row(label, value)
    console.print(table)
    a = result.analysis
    if a.first_divergence:
        dist = Table(title="first divergence positions", title_justify="left")
        dist.add_column("position", justify="right")
        dist.add_column("samples", justify="right")
        for pos, count in position_rows(result):
            dist.add_row(str(pos), str(count))
        console.print(dist)
    if a.variants:
        side = Table(title="divergent continuations, side by side", title_justify="left")
        for col in ("at", "context", f"most common (x{a.most_common_count})", "instead", "x"):
            side.add_column(col, overflow="fold")
        for v in a.variants[:TOP_VARIANTS]:
            side.add_row(str(v.position), repr(v.context), repr(v.reference), repr(v.variant),
                         str(v.count))
        console.print(side)
    for _, message in result.collected.errors[:MAX_ERRORS_SHOWN]:
        console.print(f"[red]error:[/red] {message}", markup=True, highlight=False)


def write_markdown(result: AuditResult, path: Path, plots: list[str]) -> None:
    a = result.analysis
    lines = ["# detgate audit", "", f"Prompt: `{_md(result.settings.prompt)}`", "",
             "| measure | value |", "|---|---|"]
    lines += [f"| {_md(label)} | {_md(value)} |" for label, value in summary_rows(result)]
    if a.first_divergence:
        lines += ["", "## First divergence positions", "", "| position | samples |", "|---|---|"]
        lines += [f"| {pos} | {count} |" for pos, count in position_rows(result)]
    if a.variants:
        lines += ["", "## Divergent continuations, side by side", "",
                  f"| at | context | most common (x{a.most_common_count}) | instead | x |",
                  "|---|---|---|---|---|"]
        lines += [f"| {v.position} | `{_md(v.context)}` | `{_md(v.reference)}` | "
                  f"`{_md(v.variant)}` | {v.count} |" for v in a.variants[:TOP_VARIANTS]]
    if result.collected.errors:
        lines += ["", "## Errors", ""]
        lines += [f"- {_md(m)}" for _, m in result.collected.errors[:MAX_ERRORS_SHOWN]]
    lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plots]
    path.write_text("\n".join(lines) + "\n")


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "\\n").replace("`", "'")
