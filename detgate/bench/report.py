"""The engine experiment's environment record and its README table (detgate/bench/engine_gpu.py)."""

from __future__ import annotations

import statistics

import torch

from detgate.contract.constants import MODES
from detgate.contract.provenance import git_commit, utc_now, versions

# Cost reference on CUDA: default mode with our paged attention kernel instead of gathered K/V
# + torch SDPA, so the ratio can also be read with the same attention on both sides (what the
# invariant matmuls and norms alone cost).
REFERENCE = "default_paged_attention"


def environment(device: str) -> dict:
    env = {**versions("torch", "triton"), "date": utc_now(), "git_commit": git_commit()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, cuda=torch.version.cuda, sms=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1))
    else:
        env.update(device=f"cpu ({torch.backends.cpu.get_cpu_capability()})",
                   threads=torch.get_num_threads())
    return env


def summary_table(result: dict) -> str:
    """The markdown table of the README."""
    det, cost, score = (result.get(k, {}) for k in ("determinism", "cost", "score"))
    lines = ["| | default | batch_invariant |", "|---|---|---|"]

    def row(label, fn):
        cells = []
        for mode in MODES:
            try:
                cells.append(fn(mode))
            except (KeyError, TypeError, IndexError, ZeroDivisionError):
                cells.append("-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("unique completions (token ids)",
        lambda m: f"{det[m]['unique_completions']} of {det[m]['n']}")
    row("unique completions (ids + logprob bits)",
        lambda m: str(det[m]["unique_completions_with_logprob_bits"]))
    row("most common (exact)", lambda m: str(det[m]["most_common_exact_count"]))
    row("first divergence (min / median)", lambda m: (
        f"{det[m]['first_divergence'][0]} / {statistics.median(det[m]['first_divergence'])}"
        if det[m]["first_divergence"] else "none"))
    row("max abs logprob diff before divergence", lambda m: f"{det[m]['max_abs_logprob_diff']:.3g}")
    row("batch sizes seen by the needles", lambda m: "{min}-{max}".format(
        **det[m]["batch_sizes_seen"]))
    passes = cost.get("passes", [])
    row(f"cost: {cost.get('requests', '-')} requests, wall s (pass 1)",
        lambda m: f"{passes[0][m]['seconds']:.2f}")
    row("cost: output tokens/s (pass 1)", lambda m: f"{passes[0][m]['tokens_per_s']:.0f}")
    row("cost: decode-only steps (share of engine time)", lambda m: "{} of {} ({:.0%})".format(
        passes[0][m]["decode_only_steps"], passes[0][m]["steps"],
        passes[0][m]["decode_only_seconds"] / passes[0][m]["seconds"]))
    row("cost: host ms per step not waiting for the GPU (pass 1)",
        lambda m: f"{passes[0][m]['not_waiting_ms_per_step']:.2f}")
    overlapped = result.get("cost_async", {}).get("passes", [])
    row("cost with asynchronous scheduling: wall s (pass 1)",
        lambda m: f"{overlapped[0][m]['seconds']:.2f}")
    eager = result.get("cost_eager", {}).get("passes", [])
    row("cost without CUDA graphs: wall s", lambda m: f"{eager[0][m]['seconds']:.2f}")
    row("score == sampled logprobs (bitwise positions)",
        lambda m: f"{score[m]['bitwise_equal']} / {score[m]['positions']}")
    if passes:
        ratios = ", ".join(f"{p['ratio']:.3f}" for p in passes)
        lines.append(f"\nbatch_invariant / default wall time: {ratios} (mean "
                     f"{cost['ratio_mean']:.3f})")
    if passes and REFERENCE in passes[0]:
        ref = passes[0][REFERENCE]
        lines.append(f"{REFERENCE} (same attention kernel as batch_invariant): "
                     f"{ref['seconds']:.2f} s, {ref['tokens_per_s']:.0f} tokens/s; "
                     f"batch_invariant / it: {passes[0]['ratio_vs_reference']:.3f}")
    step = result.get("decode_step", {})
    if step.get("ratio"):
        lines.append("GPU time of one decode step (context 256), batch_invariant / default: "
                     + ", ".join(f"B={b}: {r:.3f}" for b, r in step["ratio"].items()))
    if step.get("ratio_vs_reference"):
        lines.append(f"... / {REFERENCE}: " + ", ".join(
            f"B={b}: {r:.3f}" for b, r in step["ratio_vs_reference"].items()))
    if overlapped:
        lines.append("with asynchronous scheduling: "
                     f"{result['cost_async']['ratio_mean']:.3f}")
    if eager:
        lines.append(f"without CUDA graphs: {result['cost_eager']['ratio_mean']:.3f}")
    return "\n".join(lines)
