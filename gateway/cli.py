"""`detgate gateway`, `detgate bench gateway` (argument parsing only)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("gateway", help="run the gateway (configuration from DETGATE_* variables)")
    p.set_defaults(func=lambda args: __import__("gateway.serve", fromlist=["main"]).main(args))


def register_bench(bench_sub) -> None:
    p = bench_sub.add_parser("gateway", help="gateway overhead vs a bare passthrough and direct")
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.set_defaults(func=lambda args: __import__("gateway.bench", fromlist=["main"]).main(args))
