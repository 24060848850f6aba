"""Running `detgate rl`: the stack (our own, or a running one), the trainer, the loop, its
progress and its outputs."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from detgate.contract.constants import ADMIN_TOKEN_ENV
from detgate.contract.paths import state_dir
from detgate.contract.provenance import cpu_model, git_commit, utc_now, versions
from detgate.procs import free_port
from detgate.rl.cli import plot_path
from detgate.rl.loop import Loop, Settings, Workers
from detgate.rl.report import StepResult, write_json, write_plot
from detgate.rl.rollout import Sampling
from detgate.stack import Stack, start_stack, stop_on_sigterm
from detgate.train import Policy


def on_own_stack(args, admin_token: str) -> int:
    """Redis, `args.workers` workers accepting weight updates, and a gateway, as `detgate up`
    starts them; stopped when the loop ends."""
    root = state_dir()
    logs = root / "logs" / "rl"
    logs.mkdir(parents=True, exist_ok=True)
    stack = Stack(logs)
    stop_on_sigterm()
    console = Console(stderr=True)
    try:
        console.print(f"detgate rl: starting {args.workers} {args.mode} workers of {args.model} "
                      f"and a gateway (logs in {logs})")
        up = start_stack(stack, root, workers=args.workers, mode=args.mode, model=args.model,
                         port=free_port(), worker_env={ADMIN_TOKEN_ENV: admin_token},
                         worker_args=("--dtype", args.dtype, "--device", args.device))
        return against(args, up.gateway, up.workers, admin_token)
    except KeyboardInterrupt:
        console.print("detgate rl: stopped")
        return 130
    except RuntimeError as exc:
        console.print(f"detgate rl: {exc}")
        return 1
    finally:
        stack.stop()


def against(args, gateway: str, workers: list[str], admin_token: str) -> int:
    console = Console(stderr=True)
    # The trainer is always the invariant one: --mode says how the sampler computes.
    policy = Policy.from_pretrained(args.model, dtype=args.dtype, device=args.device)
    settings = Settings(task=args.task, steps=args.steps, problems_per_step=args.problems,
                        sampling=Sampling(args.group_size, args.max_tokens, args.temperature),
                        lr=args.lr, seed=args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=gateway, headers=headers, timeout=600.0) as client:
        loop = Loop(policy, client, Path(args.model).name, Workers(workers, admin_token),
                    settings)
        with _progress(console, args.steps) as (progress, task):
            def on_step(result: StepResult) -> None:
                progress.console.print(result.line())
                progress.advance(task)

            results = loop.run(on_step)
    _write(args, settings, results)
    identical = all(r.identical_tokens == r.tokens for r in results)
    console.print(f"detgate rl: {len(results)} steps, reward {results[0].reward:.3f} -> "
                  f"{results[-1].reward:.3f}; every sampled token bit-identical to the "
                  f"trainer: {'yes' if identical else 'no'}")
    return 0


@contextmanager
def _progress(console: Console, steps: int):
    progress = Progress(TextColumn("[bold]RL steps"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console)
    with progress:
        yield progress, progress.add_task("steps", total=steps)


def _write(args, settings: Settings, results: list[StepResult]) -> None:
    described = {"task": settings.task, "model": args.model, "mode": args.mode, "dtype": args.dtype,
                 "device": args.device, "problems_per_step": settings.problems_per_step,
                 "group_size": settings.sampling.group_size,
                 "max_tokens": settings.sampling.max_tokens,
                 "temperature": settings.sampling.temperature, "lr": settings.lr,
                 "seed": settings.seed, "created": utc_now()}
    environment = {"commit": git_commit(), "cpu": cpu_model(),
                   "versions": versions("torch", "detgate")}
    if args.json:
        write_json(Path(args.json), described, results, environment)
    if (plot := plot_path(args)) is not None:
        write_plot(plot, results, f"detgate rl, {args.mode}: reward and KL per step")
    if not args.json:
        print("no --json given: results printed only", file=sys.stderr)
