"""`detgate audit` (argument parsing only)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("audit", help="measure the determinism of an OpenAI-compatible endpoint")
    p.add_argument("--base-url", required=True, help="as the OpenAI SDK's base_url, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("-n", type=int, default=100, dest="n")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--json", default=None)
    p.set_defaults(func=lambda args: __import__("detgate.audit.run", fromlist=["main"]).main(args))
