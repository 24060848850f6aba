"""`detgate bench engine`, `detgate bench model` and `detgate bench gateway` (argument
parsing only)."""

from __future__ import annotations

from worker.cli import add_engine_args


def register_bench(bench_sub) -> None:
    _register_engine(bench_sub)
    _register_model(bench_sub)
    _register_gateway(bench_sub)


def _register_engine(bench_sub) -> None:
    p = bench_sub.add_parser("engine", help="engine throughput, default vs batch_invariant")
    add_engine_args(p)
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.add_argument("--requests", type=int, default=64, help="requests in the workload")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=4, help="runs of each mode, interleaved")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.set_defaults(func=lambda args: __import__("detgate.bench.engine",
                                                fromlist=["main"]).main(args))


def _register_model(bench_sub) -> None:
    p = bench_sub.add_parser("model", help="a real model in worker processes: start time, memory, "
                                           "TTFT and tokens/s, default vs batch_invariant")
    __import__("detgate.bench.model", fromlist=["register_args"]).register_args(p)
    p.set_defaults(func=lambda args: __import__("detgate.bench.model",
                                                fromlist=["main"]).main(args))


def _register_gateway(bench_sub) -> None:
    p = bench_sub.add_parser("gateway", help="gateway overhead vs a bare passthrough and direct")
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.set_defaults(func=lambda args: __import__("detgate.bench.gateway",
                                                fromlist=["main"]).main(args))
