"""`detgate worker`, `detgate make-model`, `detgate bench engine` (argument parsing only)."""

from __future__ import annotations

import argparse


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="'tiny' (the demo model) or a Hugging Face style folder")
    p.add_argument("--mode", choices=["batch_invariant", "default"], default="batch_invariant")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")


def register(sub) -> None:
    p = sub.add_parser("worker", help="run one built-in worker (OpenAI-compatible server)")
    _add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9001)
    p.set_defaults(func=lambda args: __import__("worker.server", fromlist=["main"]).main(args))

    p = sub.add_parser("make-model", help="write a small checkpoint (config, safetensors, tokenizer)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--out", default=None, help="output folder (default: a folder per preset)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=lambda args: __import__("worker.make_model", fromlist=["main"]).main(args))


def register_bench(bench_sub) -> None:
    p = bench_sub.add_parser("engine", help="engine throughput, default vs batch_invariant")
    _add_engine_args(p)
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.set_defaults(func=lambda args: __import__("worker.bench", fromlist=["main"]).main(args))
