"""`detgate bench kernels` (argument parsing only)."""

from __future__ import annotations


def register_bench(bench_sub) -> None:
    p = bench_sub.add_parser("kernels", help="batch-invariant kernels vs torch (cuBLAS, SDPA)")
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="which kernels (default: cuda if there is one, else cpu)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU: torch threads (default: 1 and all of them)")
    p.set_defaults(func=lambda args: __import__("kernels.bench", fromlist=["main"]).main(args))
