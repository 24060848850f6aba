"""`detgate audit`: send, analyse, report. Ctrl-C stops sending and reports what it has."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from pathlib import Path

from rich.console import Console

from detgate.audit.batch_sizes import batch_sizes
from detgate.audit.client import Deadline, EndpointClient, RequestSpec, api_root
from detgate.audit.plots import write_plots
from detgate.audit.progress import AuditProgress
from detgate.audit.report import render_terminal, write_json, write_markdown
from detgate.audit.result import AuditResult, AuditSettings
from detgate.audit.runner import LoadPlan, collect, wait_or_stop
from detgate.audit.score import ScoreReport, score_samples
from detgate.contract.analysis import analyse

ENDPOINTS = {"completions": "completions", "chat": "chat/completions"}


def settings_from(args: argparse.Namespace) -> AuditSettings:
    # Sampling without a seed could not be reproduced, so sampled audits always send one.
    seed = args.seed if args.seed is not None or args.temperature == 0 else 0
    return AuditSettings(
        base_url=args.base_url, model=args.model, endpoint=ENDPOINTS[args.endpoint],
        prompt=args.prompt, n=args.n, concurrency=args.concurrency, mix=args.mix,
        max_tokens=args.max_tokens, temperature=args.temperature, seed=seed,
    )


def main(args: argparse.Namespace) -> int:
    if args.n < 1 or args.concurrency < 1 or args.mix < 0 or args.max_tokens < 1:
        raise SystemExit("detgate audit: -n, --concurrency and --max-tokens must be >= 1, "
                         "--mix >= 0")
    settings = settings_from(args)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    result = asyncio.run(audit(settings, api_key=api_key, retries=args.retries,
                               timeout_s=args.timeout, score=args.score))
    console = Console()
    render_terminal(result, console)
    if args.json:
        write_json(result, args.json)
    if args.report:
        out = Path(args.report)
        out.mkdir(parents=True, exist_ok=True)
        try:
            plots = write_plots(result.analysis, out)
        except ImportError:
            # matplotlib is the `audit` extra: without it the report is still written, unplotted.
            plots = []
            console.print("no plots: matplotlib is not installed (pip install 'detgate[audit]')")
        write_markdown(result, out / "report.md", plots)
        console.print(f"report written to {out / 'report.md'}")
    if result.collected.outcome == "interrupted" or result.score_outcome == "interrupted":
        return 130
    return 0 if result.analysis.n else 1


async def audit(settings: AuditSettings, api_key: str | None, retries: int, timeout_s: float,
                score: bool) -> AuditResult:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGINT, stop.set)
    deadline = Deadline(timeout_s)
    client = EndpointClient(settings.base_url, api_key, settings.model, settings.endpoint,
                            retries=retries, deadline=deadline,
                            pool_size=settings.concurrency + settings.mix + 1)
    metrics_url = api_root(settings.base_url) + "/metrics"
    stderr = Console(stderr=True)
    try:
        before = await client.get_text(metrics_url)
        plan = LoadPlan(settings.n, settings.concurrency, settings.mix, settings.seed or 0)
        spec = RequestSpec(settings.prompt, settings.max_tokens, settings.temperature,
                           settings.seed)
        with AuditProgress(settings.n, client.stats, stderr) as progress:
            collected = await collect(client, spec, plan, stop, progress)
            report = score_outcome = None
            if score and collected.outcome == "complete":
                report = ScoreReport()
                progress.phase("teacher-forced scoring", len(collected.samples))
                score_outcome = await wait_or_stop(
                    score_samples(client, collected.samples, settings.concurrency, report,
                                  progress.advance),
                    stop, deadline.remaining())
        after = await client.get_text(metrics_url) if before is not None else None
    finally:
        await client.aclose()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGINT)
    return AuditResult(settings, analyse(collected.samples), collected, client.stats, report,
                       batch_sizes(before, after), score_outcome)
