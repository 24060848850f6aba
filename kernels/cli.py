"""`detgate bench kernels` (argument parsing only)."""

from __future__ import annotations


def register_bench(bench_sub) -> None:
    p = bench_sub.add_parser("kernels", help="batch-invariant kernels vs torch (cuBLAS, SDPA)")
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.add_argument("--eager", action="store_true",
                   help="time eager launches (host cost included) and in-graph side by side, "
                        "and the set_batch_invariant_mode() overhead on a transformers model "
                        "(bench/kernels_eager.py)")
    p.add_argument("--skip-model", action="store_true", help="with --eager: no model")
    p.set_defaults(func=_run)


def _run(args) -> int:
    if not args.eager:
        return __import__("kernels.bench", fromlist=["main"]).main(args)
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "kernels_eager.py"
    spec = importlib.util.spec_from_file_location("kernels_eager", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(args)
