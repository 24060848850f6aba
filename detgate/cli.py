"""The `detgate` command: one sub-command per component, each defined by its owner.

Every owner module exposes `register(subparsers)`; `detgate bench X` is registered by
detgate/bench/cli.py. Each sub-command sets `func`. Owner modules import nothing heavy at
import time, so `detgate gateway` never loads torch.
"""

from __future__ import annotations

import argparse
import sys

from detgate import __version__


def build_parser() -> argparse.ArgumentParser:
    from detgate import up
    from detgate.audit import cli as audit_cli
    from detgate.bench import cli as bench_cli
    from detgate.gateway import cli as gateway_cli
    from detgate.rl import cli as rl_cli
    from detgate.worker import cli as worker_cli

    parser = argparse.ArgumentParser(
        prog="detgate", description="detgate: verifiably deterministic LLM inference"
    )
    parser.add_argument("--version", action="version", version=f"detgate {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up.register(sub)
    gateway_cli.register(sub)
    worker_cli.register(sub)
    audit_cli.register(sub)
    rl_cli.register(sub)
    audit_cli.register_drift(sub)

    bench = sub.add_parser("bench", help="benchmarks, measured side by side in one run")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="TARGET")
    bench_cli.register_bench(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
