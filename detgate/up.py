"""`detgate up`: the embedded stack (Redis, N built-in CPU workers, the gateway) on one machine.

It starts the parts in dependency order (detgate/stack.py), prints where they are, and stops all
of them when one dies or on Ctrl-C.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from detgate.contract.constants import DEFAULT_MODE, DEFAULT_MODEL, GATEWAY_PORT, MODES
from detgate.contract.paths import state_dir
from detgate.stack import Stack, served_port, start_stack, stop_on_sigterm


def register(sub) -> None:
    p = sub.add_parser("up", help="run the whole stack on this machine")
    p.add_argument("--workers", type=int, default=2, help="built-in CPU workers to start")
    p.add_argument("--mode", choices=MODES, default=DEFAULT_MODE)
    p.add_argument("--port", type=int, default=GATEWAY_PORT, help="the gateway's port")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model of the workers: {DEFAULT_MODEL} (default), tiny (random "
                        "weights), a Hugging Face folder or a .gguf file")
    p.set_defaults(func=main)


def main(args) -> int:
    root = state_dir()
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if served_port("127.0.0.1", args.port):
        # Checked first: otherwise an old stack (or an orphan of a killed `detgate up`) would
        # answer our readiness check while our own gateway fails to bind.
        print(f"detgate up: port {args.port} is already in use (another detgate up, or a "
              "process left from one?); stop it or choose another with --port",
              file=sys.stderr)
        return 1
    stack = Stack(logs)
    stop_on_sigterm()
    try:
        up = start_stack(stack, root, workers=args.workers, mode=args.mode, model=args.model,
                         port=args.port)
        print(banner(up.gateway, up.workers, up.redis_url, logs, args.mode,
                     Path(args.model).name), flush=True)
        while (dead := stack.first_dead()) is None:
            time.sleep(0.5)
        print(f"detgate up: {dead} exited; stopping (logs in {logs})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ndetgate up: stopping", file=sys.stderr)
        return 0
    except RuntimeError as exc:
        print(f"detgate up: {exc}", file=sys.stderr)
        return 1
    finally:
        stack.stop()


def banner(gateway: str, workers: list[str], redis_url: str, logs: Path, mode: str,
           model: str) -> str:
    lines = [
        "detgate is up",
        f"  gateway   {gateway}/v1   (metrics {gateway}/metrics)",
        f"  web page  {gateway}/ui/   (records, replays, comparisons)",
        *(f"  worker    {url}   model={model} mode={mode}" for url in workers),
        f"  redis     {redis_url}",
        f"  logs      {logs}",
        "",
        "try:",
        f"  curl -s {gateway}/v1/chat/completions -H 'Content-Type: application/json' \\",
        f"    -d '{{\"model\": \"{model}\", \"max_tokens\": 32, \"temperature\": 0,",
        "         \"messages\": [{\"role\": \"user\", \"content\": \"What is the capital "
        "of France?\"}]}'",
        f"  curl -s -X POST {gateway}/replay/<id> -H 'Content-Type: application/json' "
        "-d '{\"load\": 16}'",
        "",
        "Ctrl-C stops everything.",
    ]
    return "\n".join(lines)
