"""`detgate gateway` (argument parsing only)."""

from __future__ import annotations

from importlib import import_module


def register(sub) -> None:
    p = sub.add_parser("gateway", help="run the gateway (configuration from DETGATE_* variables)")
    p.set_defaults(func=lambda args: import_module("detgate.gateway.serve").main(args))
