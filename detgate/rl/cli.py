"""`detgate rl`: the on-policy RL loop, on a stack of its own (as `detgate up` starts it) or on a
running one (`--gateway URL --worker URL ...`, the workers' admin token in
DETGATE_WORKER_ADMIN_TOKEN).

    detgate rl --steps 20 --mode batch_invariant --json out/rl.json   # KL = 0 at every step
    detgate rl --steps 20 --mode default --json out/rl-default.json   # the control: KL > 0
"""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from detgate.contract.constants import (
    ADMIN_TOKEN_ENV,
    DEFAULT_DTYPE,
    DEFAULT_MODE,
    DEFAULT_MODEL,
    DTYPES,
    MODES,
)


def register(sub) -> None:
    p = sub.add_parser("rl", help="on-policy RL whose sampler and trainer agree bit for bit")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--mode", choices=MODES, default=DEFAULT_MODE,
                   help="numerics of the workers, the sampler (the trainer is always "
                        "detgate.train's invariant Policy): default is the control")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--task", choices=("arithmetic", "words"), default="arithmetic",
                   help="arithmetic: few-shot single-digit sums; words: exactly N words")
    p.add_argument("--problems", type=int, default=8, help="problems (groups) per step")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per problem")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens per rollout")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="workers of the stack started here")
    p.add_argument("--gateway", default=None,
                   help="a running gateway's base URL instead of a stack of our own")
    p.add_argument("--worker", action="append", default=[],
                   help="with --gateway: a worker behind it (repeat for each); its admin token "
                        f"from {ADMIN_TOKEN_ENV}")
    p.add_argument("--api-key", default=os.environ.get("DETGATE_API_KEY"),
                   help="with --gateway: the tenant's key (default $DETGATE_API_KEY)")
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.add_argument("--plot", default=None,
                   help="write the reward and KL plot here (default: beside --json, .png)")
    p.set_defaults(func=main)


def main(args) -> int:
    if args.gateway and not args.worker:
        print("detgate rl: --gateway needs every worker behind it (--worker URL ...), to push "
              "the new weights to", file=sys.stderr)
        return 2
    if args.gateway and not os.environ.get(ADMIN_TOKEN_ENV):
        print(f"detgate rl: --gateway needs the workers' admin token in {ADMIN_TOKEN_ENV}",
              file=sys.stderr)
        return 2
    from detgate.rl import run  # torch and the trainer load only when the loop runs

    if args.gateway:
        return run.against(args, args.gateway, args.worker, os.environ[ADMIN_TOKEN_ENV])
    return run.on_own_stack(args, admin_token=secrets.token_urlsafe(24))


def plot_path(args) -> Path | None:
    if args.plot:
        return Path(args.plot)
    return Path(args.json).with_suffix(".png") if args.json else None
