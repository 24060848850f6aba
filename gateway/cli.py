"""`detgate gateway` (argument parsing only)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("gateway", help="run the gateway (configuration from DETGATE_* variables)")
    p.set_defaults(func=lambda args: __import__("gateway.serve", fromlist=["main"]).main(args))
