"""cuBLASLt's algorithms without split-K against our Triton matmul: bits and time (CUDA).

    python -m detgate.bench.cublaslt --out OUT.json [--m 257,512,...] [--lm-head]
        [--shapes 12288x4096,1024x4096]

For each Qwen3-8B projection and row count M: the Triton kernel as `matmul_triton` picks it
(the cuBLASLt path of kernels/cublaslt.py off), torch's `F.linear` (cuBLAS with its own
heuristic, split-K allowed), and every algorithm cuBLASLt's heuristic offers with no workspace,
one K split and no reduction, each with whether its output has the Triton kernel's bits in every
element. Times are eager CUDA-event times of back-to-back calls (median of three runs), host cost
included. "pinned": the algorithm the heuristic picks at --pin-at rows, run at every M (where
cuBLASLt accepts it), to see whether one algorithm could serve every row count.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from detgate.bench.report import environment
from detgate.bench.timing import events_ms
from detgate.kernels import cublaslt, matmul_triton
from detgate.kernels.bits import same_bits

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (24576, 4096),
          "down_proj": (4096, 12288)}
LM_HEAD = {"lm_head": (151936, 4096)}
M_VALUES = (64, 128, 192, 256, 257, 384, 512, 768, 1024, 1280, 1536, 2048, 4096, 8192)


def mean_us(fn) -> float:
    """Microseconds per eager call (`timing.events_ms`: 20 back-to-back calls, median of 3)."""
    return round(1000 * events_ms(lambda _: fn(), 20, 3, warmup=1), 2)


def shape_rows(n: int, k: int, m_values, pin_at: int, deadline: float) -> dict:
    lib = cublaslt.library()
    w = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    x = torch.randn(max(m_values), k, device="cuda").to(torch.bfloat16)
    stream = torch.cuda.current_stream().cuda_stream
    pin = cublaslt.Gemm(lib, w.data_ptr(), k, n, k, pin_at, torch.bfloat16).algo
    rows = []
    for m in m_values:
        if time.monotonic() > deadline:
            break
        a = x[:m]
        ours = matmul_triton.matmul(a, w.t())
        row = {"m": m, "triton_us": mean_us(lambda a=a: matmul_triton.matmul(a, w.t())),
               "torch_us": mean_us(lambda a=a: F.linear(a, w)),
               "torch_same_bits": same_bits(F.linear(a, w), ours), "algorithms": []}
        probe = cublaslt.Gemm(lib, w.data_ptr(), k, n, k, m, torch.bfloat16)
        for algo in lib.candidates(probe.a_layout, probe.b_layout, probe.d_layout):
            probe.algo = algo
            row["algorithms"].append({
                **lib.describe(algo), "same_bits": same_bits(probe(a, stream), ours),
                "us": mean_us(lambda a=a, g=probe: g(a, stream))})
        if pin is not None:
            probe.algo = pin
            try:
                row["pinned"] = {"same_bits": same_bits(probe(a, stream), ours),
                                 "us": mean_us(lambda a=a, g=probe: g(a, stream))}
            except cublaslt.Unavailable as exc:  # not valid at this M
                row["pinned"] = {"error": str(exc)}
        rows.append(row)
        best = min(row["algorithms"], key=lambda r: r["us"], default=None)
        print(f"{n}x{k} M={m}: triton {row['triton_us']} torch {row['torch_us']} "
              f"cuBLASLt best {best and best['us']} (tile {best and best['tile']}); "
              f"all same bits: {all(r['same_bits'] for r in row['algorithms'])}", flush=True)
    return {"n": n, "k": k, "pinned": lib.describe(pin) if pin is not None else None,
            "rows": rows}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--m", default=",".join(map(str, M_VALUES)))
    p.add_argument("--pin-at", type=int, default=1024)
    p.add_argument("--lm-head", action="store_true")
    p.add_argument("--shapes", default=None,
                   help="NxK,... weight shapes in place of Qwen3-8B's four projections")
    p.add_argument("--seconds", type=float, default=300.0, help="later rows skip")
    args = p.parse_args(argv)
    cublaslt.ENABLED = False  # the Triton kernel itself is the reference
    matmul_triton.clear_caches()
    m_values = [int(v) for v in args.m.split(",")]
    deadline = time.monotonic() + args.seconds
    torch.manual_seed(0)
    shapes = SHAPES if args.shapes is None else {
        s: tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")}
    shapes = {**shapes, **(LM_HEAD if args.lm_head else {})}
    result = {"environment": environment("cuda"), "args": vars(args),
              "shapes": {name: shape_rows(n, k, m_values, args.pin_at, deadline)
                         for name, (n, k) in shapes.items()}}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
