"""`detgate bench kernels` (argument parsing only)."""

from __future__ import annotations


def register_bench(bench_sub) -> None:
    p = bench_sub.add_parser("kernels", help="batch-invariant kernels vs torch (cuBLAS, SDPA)")
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.set_defaults(func=lambda args: __import__("kernels.bench", fromlist=["main"]).main(args))
