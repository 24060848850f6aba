"""`detgate bench engine|model|kernels|gateway` (argument parsing only: each benchmark module
is imported when its command runs)."""

from __future__ import annotations

from importlib import import_module

from worker.cli import add_engine_args


def register_bench(bench_sub) -> None:
    _register_engine(bench_sub)
    _register_model(bench_sub)
    _register_kernels(bench_sub)
    _register_gateway(bench_sub)


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
    p.set_defaults(func=lambda args: _runs("engine_host" if args.host else "engine")(args))


def _register_model(bench_sub) -> None:
    p = bench_sub.add_parser("model", help="a real model in worker processes: start time, memory, "
                                           "TTFT and tokens/s, default vs batch_invariant")
    import_module("detgate.bench.model").register_args(p)
    p.set_defaults(func=_runs("model"))


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
    p.set_defaults(func=_runs("gateway"))


def _runs(module: str):
    """The `func` of a command: detgate.bench.<module>.main, imported when the command runs."""
    return lambda args: import_module(f"detgate.bench.{module}").main(args)
