"""`detgate up`: the embedded stack (Redis, N built-in CPU workers, the gateway) on one machine."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("up", help="run the whole stack on this machine")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mode", choices=["batch_invariant", "default"], default="batch_invariant")
    p.add_argument("--port", type=int, default=8000)
    p.set_defaults(func=lambda args: main(args))


def main(args) -> int:
    raise SystemExit("detgate up: not written yet")
