"""`detgate bench engine|model|cpu-serving|kernels|gateway|limits|drift|train|weights|numerics`
(argument parsing only: each benchmark module is imported when its command runs)."""

from __future__ import annotations

from importlib import import_module

from detgate.contract.constants import DEFAULT_MODEL, DTYPES
from detgate.worker.cli import add_engine_args


def register_bench(bench_sub) -> None:
    _register_engine(bench_sub)
    _register_model(bench_sub)
    _register_cpu_serving(bench_sub)
    _register_kernels(bench_sub)
    _register_gateway(bench_sub)
    _register_limits(bench_sub)
    _register_drift(bench_sub)
    _register_train(bench_sub)
    _register_weights(bench_sub)
    _register_numerics(bench_sub)


def _register_engine(bench_sub) -> None:
    p = bench_sub.add_parser("engine", help="engine throughput, default vs batch_invariant")
    add_engine_args(p)
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.add_argument("--requests", type=int, default=64, help="requests in the workload")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=4, help="runs of each mode, interleaved")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--host", action="store_true",
                   help="the engine's host work per step, model arithmetic left out "
                        "(detgate/bench/engine_host.py)")
    p.add_argument("--structured", action="store_true",
                   help="grammar-constrained decoding vs unconstrained, one engine "
                        "(detgate/bench/engine_structured.py)")
    p.set_defaults(func=lambda args: _runs(
        "engine_host" if args.host else "engine_structured" if args.structured
        else "engine")(args))


def _register_model(bench_sub) -> None:
    p = bench_sub.add_parser("model", help="a real model in worker processes: start time, memory, "
                                           "TTFT and tokens/s, default vs batch_invariant")
    import_module("detgate.bench.model").register_args(p)
    p.set_defaults(func=_runs("model"))


def _register_cpu_serving(bench_sub) -> None:
    p = bench_sub.add_parser("cpu-serving", help="our CPU worker (quantised and fp32 weights, "
                                                 "both modes) vs llama.cpp's llama-server on "
                                                 "one GGUF, the same client")
    import_module("detgate.bench.cpu_serving").register_args(p)
    p.set_defaults(func=_runs("cpu_serving"))


def _register_kernels(bench_sub) -> None:
    p = bench_sub.add_parser("kernels", help="batch-invariant kernels vs torch (cuBLAS, SDPA)")
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="which kernels (default: cuda if there is one, else cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU: torch threads (default: 1 and all of them)")
    p.add_argument("--eager", action="store_true",
                   help="CUDA: time eager launches (host cost included) and in-graph side by "
                        "side, and the set_batch_invariant_mode() overhead on a transformers "
                        "model (detgate/bench/kernels_eager.py)")
    p.add_argument("--skip-model", action="store_true", help="with --eager: no model")
    p.add_argument("--model-only", action="store_true", help="with --eager: only the model")
    p.add_argument("--profile", action="store_true",
                   help="with --eager: where a batch-1 forward's host time goes, with and "
                        "without the mode (torch.profiler and cProfile tables)")
    p.set_defaults(func=_run_kernels)


def _run_kernels(args) -> int:
    import torch

    if args.eager:
        module = "kernels_eager"
    elif args.device == "cpu" or not torch.cuda.is_available():
        module = "kernels_cpu"
    else:
        module = "kernels_gpu"
    return _runs(module)(args)


def _register_gateway(bench_sub) -> None:
    p = bench_sub.add_parser("gateway", help="gateway overhead vs a bare passthrough and direct")
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.add_argument("--repeats", type=int, default=5,
                   help="interleaved rounds of the three targets (medians reported)")
    p.add_argument("--profile", action="store_true",
                   help="profile the gateway (cProfile) under one round of the load and write "
                        "bench/results/gateway-profile-<date>.md")
    p.set_defaults(func=_runs("gateway"))


def _register_limits(bench_sub) -> None:
    p = bench_sub.add_parser("limits", help="tenant rate limits in Redis vs per process vs none: "
                                            "the gateway's and Redis' CPU per request")
    import_module("detgate.bench.limits").register_args(p)
    p.set_defaults(func=_runs("limits"))


def _register_drift(bench_sub) -> None:
    p = bench_sub.add_parser("drift", help="detgate drift on N records of tiny workers, beside "
                                           "the time serving them took")
    import_module("detgate.bench.drift").register_args(p)
    p.set_defaults(func=_runs("drift"))


def _register_train(bench_sub) -> None:
    # Registered here, not in detgate/bench/train.py: that module needs torch, and the CLI
    # must parse without it (the gateway's image has none).
    p = bench_sub.add_parser("train", help="the trainer's forward + backward vs transformers")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="checkpoint (as `detgate worker --model`); ignored with --preset")
    p.add_argument("--preset", default=None,
                   help="a make-model preset with random weights drawn on the device "
                        "(qwen3-8b-shape for the GPU run)")
    p.add_argument("--layers", type=int, default=None, help="with --preset: this many layers")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--batch", type=int, default=4, help="sequences per batch (B)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (T)")
    p.add_argument("--repeats", type=int, default=5, help="timed iterations per side")
    p.add_argument("--threads", type=int, default=1, help="CPU: torch threads")
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.set_defaults(func=_runs("train"))


def _register_weights(bench_sub) -> None:
    p = bench_sub.add_parser("weights", help="live weight updates of a worker, from disk and "
                                             "from tensors, vs restarting it")
    import_module("detgate.bench.weights").register_args(p)
    p.set_defaults(func=_runs("weights"))


def _register_numerics(bench_sub) -> None:
    p = bench_sub.add_parser("numerics", help="answers' bits and fingerprints across thread "
                                              "counts, CPU kernel builds and torch's CPU kernels")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--modes", default="batch_invariant,default")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--max-tokens", type=int, default=12, help="tokens per request")
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.set_defaults(func=_runs("numerics"))


def _runs(module: str):
    """The `func` of a command: detgate.bench.<module>.main, imported when the command runs."""
    return lambda args: import_module(f"detgate.bench.{module}").main(args)
