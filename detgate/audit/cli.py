"""`detgate audit` (argument parsing only)."""

from __future__ import annotations

from importlib import import_module


def register(sub) -> None:
    p = sub.add_parser("audit", help="measure the determinism of an OpenAI-compatible endpoint")
    p.add_argument("--base-url", required=True, help="as the OpenAI SDK's base_url, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default=None,
                   help="sent as a Bearer token; default: $OPENAI_API_KEY, as the OpenAI SDK does")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", required=True)
    p.add_argument("-n", type=int, default=100, dest="n", help="identical requests to send")
    p.add_argument("--concurrency", type=int, default=8, help="audited requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions (the prompt as given) or /v1/chat/completions "
                        "(the prompt as one user message)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None,
                   help="sent with every request; sampling (temperature > 0) uses 0 when not given")
    p.add_argument("--mix", type=int, default=0,
                   help="streams of other prompts of random lengths sent meanwhile, "
                        "so that batches change")
    p.add_argument("--timeout", type=float, default=600.0, help="overall time bound in seconds")
    p.add_argument("--retries", type=int, default=5,
                   help="retries of a request answered 429/502/503/504 or cut off")
    p.add_argument("--report", default=None, metavar="DIR",
                   help="write report.md and PNG plots here")
    p.add_argument("--score", action="store_true",
                   help="compare sampled logprobs with the endpoint's teacher-forced /v1/score")
    p.set_defaults(func=lambda args: __import__("detgate.audit.run", fromlist=["main"]).main(args))


def register_drift(sub) -> None:
    p = sub.add_parser("drift", help="replay records of one fingerprint on workers of another "
                                     "and report what still reproduces")
    p.add_argument("--base-url", required=True, help="the gateway, e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", action="append", default=None,
                   help="a tenant's key; repeat for several tenants (the fleet report merges "
                        "them); default: $OPENAI_API_KEY")
    p.add_argument("--from", dest="from_fingerprint", required=True, metavar="FINGERPRINT",
                   help="the system_fingerprint the records were made on")
    p.add_argument("--to", dest="to_fingerprint", required=True, metavar="FINGERPRINT",
                   help="the fingerprint of the workers to replay them on")
    p.add_argument("--sample", type=int, default=None,
                   help="records per tenant, drawn at random (default: all found)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default=None)
    p.add_argument("--seed", type=int, default=0, help="the sample's seed")
    p.add_argument("--concurrency", type=int, default=8, help="replays at once")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per tenant")
    p.add_argument("--json", default=None, help="write the fleet report JSON here")
    p.add_argument("--png", default=None, help="write the report's plots here")
    p.set_defaults(func=lambda args: import_module("detgate.audit.drift").main(args))
