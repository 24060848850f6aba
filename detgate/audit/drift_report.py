"""A drift report's outputs: the terminal table, the JSON, one PNG (matplotlib, Agg)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from detgate.audit.report import fmt

MAX_DIVERGED_SHOWN = 10


def _share(group: dict) -> str:
    share = group["identical_share"]
    if share is None:
        return "n/a"
    return f"{100 * share:.1f}% ({group['identical']}/{group['replayed']})"


def _positions(group: dict) -> str:
    p = group["first_divergence"]
    if not p:
        return "-"
    return f"{len(p)}: min {min(p)}, median {statistics.median(p):g}, max {max(p)}"


def group_rows(report: dict) -> list[tuple[str, str, dict]]:
    """(kind, name, summary) for the whole, each endpoint and each tenant."""
    return ([("all", "", report["summary"])]
            + [("endpoint", k, s) for k, s in report["by_endpoint"].items()]
            + [("tenant", k, s) for k, s in report["by_tenant"].items()])


def render_terminal(report: dict, console: Console) -> None:
    table = Table(title=f"detgate drift: records of {report['from_fingerprint']} replayed on "
                        f"{report['to_fingerprint']} ({report['selected']} of "
                        f"{report['matched']} found, {report['duration_s']:g} s)",
                  title_justify="left")
    for col in ("group", "records", "identical", "errors", "first divergences",
                "logprob MSE (mean)", "max |Δ logprob|"):
        table.add_column(col, justify="left" if col == "group" else "right")
    for kind, name, g in group_rows(report):
        table.add_row(f"{kind} {name}".strip(), str(g["records"]), _share(g), str(g["errors"]),
                      _positions(g), fmt(g["logprob_mse_mean"]), fmt(g["max_abs_logprob_diff"]))
    console.print(table)
    diverged = [r for r in report["records"] if r["error"] is None and not r["match"]]
    if diverged:
        rows = Table(title=f"diverged records (first {MAX_DIVERGED_SHOWN})", title_justify="left")
        for col in ("id", "tenant", "endpoint", "first divergence", "logprob MSE"):
            rows.add_column(col)
        for r in diverged[:MAX_DIVERGED_SHOWN]:
            rows.add_row(r["id"], r["tenant"], r["endpoint"],
                         "-" if r["first_divergence"] is None else str(r["first_divergence"]),
                         fmt(r["logprob_mse"]))
        console.print(rows)


def write_json(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def write_png(report: dict, path: str | Path) -> None:
    """Identical share per endpoint and tenant; first-divergence positions; log10 MSE."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (share, positions, mse) = plt.subplots(1, 3, figsize=(15, 4))
    groups = [(f"{kind} {name}".strip(), g) for kind, name, g in group_rows(report)
              if g["identical_share"] is not None]
    share.barh([n for n, _ in groups][::-1], [100 * g["identical_share"] for _, g in groups][::-1])
    share.set_xlim(0, 100)
    share.set_xlabel("replayed bitwise identical (%)")
    share.set_title(f"{report['from_fingerprint']} -> {report['to_fingerprint']}")
    rows = [r for r in report["records"] if r["error"] is None]
    firsts = [r["first_divergence"] for r in rows if r["first_divergence"] is not None]
    if firsts:
        positions.hist(firsts, bins=min(50, max(firsts) + 1))
    else:
        _note(positions, "no token sequence diverged")
    positions.set_xlabel("first divergence (generated token)")
    positions.set_ylabel("records")
    positions.set_title(f"first divergences ({len(firsts)} of {len(rows)} replayed)")
    logs = [math.log10(r["logprob_mse"]) for r in rows if r["logprob_mse"]]
    if logs:
        mse.hist(logs, bins=30)
    else:
        _note(mse, "every logprob before the divergences bitwise equal" if rows
              else "nothing replayed")
    mse.set_xlabel("log10 logprob MSE (records with MSE > 0)")
    mse.set_ylabel("records")
    mse.set_title(f"logprob MSE: {sum(1 for r in rows if not r['logprob_mse'])} records at 0")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, wrap=True)
