"""The report's PNG plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from detgate.contract.analysis import Analysis

FIRST_DIVERGENCE_PNG = "first_divergence.png"
LOGPROB_DELTA_PNG = "logprob_delta.png"
MAX_CURVES = 20


def write_plots(analysis: Analysis, out_dir: Path) -> list[str]:
    """Writes both plots (an explanatory note where there is nothing to draw); returns names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    positions = analysis.first_divergence
    if positions:
        counts = Counter(positions)
        ax.bar(list(counts), list(counts.values()), width=0.8)
        ax.set_xlim(min(positions) - 1, max(positions) + 1)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        _note(ax, f"no divergence: all {analysis.n} completions identical")
    ax.set_xlabel("first divergence position (generated token)")
    ax.set_ylabel("samples")
    ax.set_title(f"First divergence vs the most common completion "
                 f"({len(positions)} of {analysis.n} samples)")
    fig.tight_layout()
    fig.savefig(out_dir / FIRST_DIVERGENCE_PNG, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    differing = [c for c in analysis.comparisons
                 if c.first_divergence is not None or any(d > 0 for d in c.abs_deltas)]
    for c in differing[:MAX_CURVES]:
        # Zeros cannot sit on a log axis: they are gaps in the curve, which is what they are.
        ax.plot(range(len(c.abs_deltas)), [d if d > 0 else math.nan for d in c.abs_deltas],
                marker=".", linewidth=0.8, label=f"sample {c.index}")
        if c.first_divergence is not None:
            ax.axvline(c.first_divergence, color="grey", linewidth=0.5, linestyle=":")
    if any(d > 0 for c in differing for d in c.abs_deltas):
        ax.set_yscale("log")
        if len(differing) <= 10:
            ax.legend(fontsize="small")
    else:
        _note(ax, "every logprob before divergence bitwise equal to the most common completion's")
    ax.set_xlabel("generated token position (dotted: first divergence)")
    ax.set_ylabel("|delta logprob| vs reference")
    ax.set_title(f"Per-position |delta logprob|, {len(differing)} differing samples")
    fig.tight_layout()
    fig.savefig(out_dir / LOGPROB_DELTA_PNG, dpi=100)
    plt.close(fig)
    return [FIRST_DIVERGENCE_PNG, LOGPROB_DELTA_PNG]


def _note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, wrap=True)
