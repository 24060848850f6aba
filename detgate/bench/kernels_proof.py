"""One GPU session for the Triton kernels: tests, tile exploration, bitwise proofs, benchmark.

Run from the repository root on a CUDA machine:
    python -m detgate.bench.kernels_proof OUT_DIR [--tune] [--skip-tests]
    python -m detgate.bench.kernels_proof OUT_DIR --tune-only --tune-m 384,512,640 \
        [--tune-shapes o_proj,down_proj]
Writes OUT_DIR/gpu_kernels.json (everything), OUT_DIR/kernels-bench.json (the `detgate bench
kernels` result), OUT_DIR/pytest.log.

Phases:
1. ceilings: device copy bandwidth, cuBLAS bf16 rate at 8192^3;
2. cross-config bits: every tile config (and the pointer path) gives the same bits on every
   projection shape at several M, so the shape-dependent choice cannot change a result;
3. with --tune: time every candidate config on every (shape, M) and use the fastest per M
   bucket as kernels.matmul_triton.TUNED_16BIT for the rest of the run (printed, to be
   committed); a config replaces the one in force only when it is STICKY faster, and Ms in a
   row with the same choice make one bucket. --tune-m / --tune-shapes pick the (shape, M)
   grid (the mixed steps' token buckets, say), --tune-spread N times N sizes spread over each
   bucket instead of its bound alone, --tune-configs times only the named candidates beside
   each bucket's config in force, --tune-only stops after it;
4. the benchmark (`detgate.bench.kernels_gpu.run_all`);
5. invariance sweeps with the dispatch in force: M = 1..8192 on every projection (lm_head:
   1..1024, then every 7th M), fp16/fp32 spot sweeps, rms_norm / log_softmax rows, and the
   cuBLAS negative control;
6. the GPU test files (pytest, native Triton).
Phases that would start past --deadline seconds are skipped (and say so).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from detgate.bench import kernels_gpu as bench
from detgate.bench.timing import copy_tb_s, graph_ms
from detgate.kernels import log_softmax_triton as ls
from detgate.kernels import matmul_triton as mm
from detgate.kernels import rmsnorm_triton as rn
from detgate.kernels.bits import same_bits

RESULT: dict = {}
# Configs whose bits differed from the reference config: never chosen by the tuning.
BIT_DIFFERENT: set[str] = set()
T0 = time.time()


def log(*args) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *args, flush=True)


def phase(name: str, fn, out: Path, deadline: float) -> None:
    if time.time() - T0 > deadline:
        RESULT[name] = {"skipped": f"past the {deadline:.0f}s deadline"}
        log(f"{name} skipped (deadline)")
        return
    start = time.time()
    try:
        RESULT[name] = fn()
    except Exception:  # a failed phase is recorded and the next one still runs
        RESULT[name] = {"error": traceback.format_exc()}
        log(f"{name} FAILED\n{traceback.format_exc()}")
    RESULT.setdefault("phase_seconds", {})[name] = round(time.time() - start, 1)
    (out / "gpu_kernels.json").write_text(json.dumps(RESULT, indent=1, default=str))
    log(f"{name} done in {time.time() - start:.1f}s")


def ceilings() -> dict:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = graph_ms(lambda i: torch.mm(a, b), 1, 8192 * 8192 * 2)
    return {"copy_tb_s": copy_tb_s(), "cublas_bf16_tflops_8192": 2 * 8192**3 / mm_ms / 1e9}


def run_tests(out: Path) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
           "tests/kernels/test_gpu_ops.py", "tests/kernels/test_triton_ops.py",
           "tests/kernels/test_mode.py"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    (out / "pytest.log").write_text(proc.stdout + proc.stderr)
    tail = proc.stdout.strip().splitlines()[-1:] if proc.stdout else []
    log("pytest:", *tail)
    return {"returncode": proc.returncode, "summary": tail}


def shape_inputs(n: int, k: int, m_max: int, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    a = torch.randn(m_max, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(dtype)
    return a, w


def cross_config_bits() -> dict:
    report = {}
    for name, (n, k) in bench.MATMUL_SHAPES.items():
        a, w = shape_inputs(n, k, 1000)
        differing = []
        for m in (1, 5, 64, 65, 130, 300, 1000):
            outs = {c: mm.matmul(a[:m], w.t(), config=cfg) for c, cfg in mm.CONFIGS_16BIT.items()}
            shifted = torch.empty(m * k + 1, device="cuda", dtype=a.dtype)[1:].view(m, k)
            shifted.copy_(a[:m])
            outs["pointer"] = mm.matmul(shifted, w.t())
            ref = outs["m128n256"]
            differing += [f"M={m} {c}" for c, o in outs.items() if not same_bits(o, ref)]
        report[name] = differing
        BIT_DIFFERENT.update(d.split()[1] for d in differing)
        log("cross-config", name, differing or "all equal")
    return report


# A candidate must beat the config in force by this factor to replace it: timing noise must not
# churn the table.
STICKY = 0.98


def bucket_samples(m_values: tuple[int, ...], spread: int, floor: int = 0
                   ) -> list[tuple[int, list[int]]]:
    """(bucket upper bound, the Ms timed for it): the bound alone, or with spread > 1 that many
    sizes spaced evenly over the bucket (previous bound, bound], the bound last; the first
    bucket starts after `floor` (matmul_triton.bucket_floor: where the shipped table's bucket
    below it ends). A tile choice's worth can change inside a bucket (a tail's with the exact
    tile count), so a choice timed at the bound alone may not hold for the sizes below it."""
    buckets, prev = [], floor
    for m in m_values:
        sizes = {prev + max(1, round((m - prev) * (i + 1) / spread)) for i in range(spread)}
        buckets.append((m, sorted(sizes)))
        prev = m
    return buckets


def _candidate_ms(n: int, k: int, m: int, weights: list,
                  only: set[str] | None = None) -> dict[str, float]:
    """ms per call of torch and of every candidate config (those in `only`, if given) at one
    (shape, M)."""
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    inputs = [(a, w.t()) for w in weights]
    row = {"torch": graph_ms(lambda i, inp=inputs: torch.mm(*inp[i]), len(inputs), m * n * 2)}
    for cname, cfg in mm.CONFIGS_16BIT.items():
        if only is not None and cname not in only:
            continue
        if cname in BIT_DIFFERENT or (cfg.block_m == 64 and m > 256 and
                                      (cfg.block_n <= 64 or cfg.block_k > 64)):
            continue  # decode tiles only pay off while the weights dominate
        row[cname] = graph_ms(lambda i, inp=inputs, cfg=cfg: mm.matmul(*inp[i], config=cfg),
                              len(inputs), m * n * 2)
    return row


def explore(shapes: list[str] | None = None, m_values: tuple[int, ...] = bench.M_VALUES,
            spread: int = 1, configs: list[str] | None = None) -> dict:
    """Time every candidate config on every (shape, M bucket); returns the per-shape tuned
    table. With spread > 1 a bucket's figure per config is its mean over `spread` sizes in the
    bucket (`bucket_samples`). With `configs`, only those and each bucket's config in force
    are timed (new candidates against the shipped table, at a fraction of a full tune)."""
    unknown = set(configs or ()) - set(mm.CONFIGS_16BIT)
    if unknown:
        raise ValueError(f"no such tile configs: {sorted(unknown)}")
    info = mm.device_info(torch.cuda.current_device())
    timings, table = {}, {}
    for name, (n, k) in bench.MATMUL_SHAPES.items():
        if shapes and name not in shapes:
            continue
        weights = bench.matmul_weights(n, k)
        entries = []
        shipped = mm.TUNED_16BIT.get((n, k), ())
        for m, sizes in bucket_samples(m_values, spread, mm.bucket_floor(shipped, m_values[0])):
            default = bench.matmul_config_name(mm.pick_config(m, n, k, torch.bfloat16, info))
            only = {*configs, default} if configs else None
            rows = [_candidate_ms(n, k, size, weights, only) for size in sizes]
            row = {c: sum(r[c] for r in rows) / len(rows)
                   for c in rows[0] if all(c in r for r in rows)}
            best = min((v, c) for c, v in row.items() if c != "torch")
            if default in row and row[default] <= best[0] / STICKY:
                best = (row[default], default)
            timings[f"{name} M={m}"] = row if len(sizes) == 1 else \
                {**row, "sizes": sizes, "per_size": rows}
            if entries and entries[-1][1] == best[1]:
                entries.pop()  # one bucket up to this M
            entries.append((m, best[1]))
            log(f"explore {name:<13} M={m:<5} torch {row['torch']:.4f} ms  best {best[1]} "
                f"{best[0]:.4f} ms ({row['torch'] / best[0]:.2f}x)  default {default} "
                f"({row['torch'] / row.get(default, float('nan')):.2f}x)"
                + (f"  over M = {sizes}" if len(sizes) > 1 else ""))
        del weights
        torch.cuda.empty_cache()
        # The buckets tuned, the shipped ones below and above them
        table[(n, k)] = mm.merge_tuned(shipped, tuple(entries))
    mm.TUNED_16BIT.update(table)
    mm.clear_caches()  # the fast path keeps each weight's tile choice
    return {"timings": timings, "table": {f"{n},{k}": v for (n, k), v in table.items()}}


def mismatches(fn, a, b, ms) -> list[int]:
    full = fn(a, b)
    flags = torch.zeros(len(ms), dtype=torch.bool, device="cuda")
    for i, m in enumerate(ms):
        flags[i] = (fn(a[:m], b) != full[:m]).any()
    return [m for m, bad in zip(ms, flags.tolist(), strict=True) if bad]


def sweeps() -> dict:
    report = {}
    for name, (n, k) in bench.MATMUL_SHAPES.items():
        ms = list(range(1, 8193)) if name != "lm_head" else \
            list(range(1, 1025)) + list(range(1031, 8192, 7)) + [8192]
        a, w = shape_inputs(n, k, 8192)
        start = time.time()
        bad = mismatches(mm.matmul, a, w.t(), ms)
        report[f"matmul {name}"] = {"m_tested": len(ms), "m_max": ms[-1], "mismatched_m": bad}
        log(f"sweep {name}: {len(ms)} M values, {len(bad)} mismatched, {time.time() - start:.1f}s")
        if name in ("o_proj", "down_proj"):
            ctrl = mismatches(torch.mm, a[:1024], w.t(), list(range(1, 1025)))
            report[f"cublas {name} (negative control)"] = {"m_tested": 1024,
                                                            "mismatched_m": ctrl}
            log(f"cublas {name}: {len(ctrl)} of M=1..1024 differ, e.g. {ctrl[:12]}")
        del a, w
        torch.cuda.empty_cache()
    for dtype, ms in ((torch.float16, list(range(1, 300)) + [1000, 4096]),
                      (torch.float32, list(range(1, 150)) + [257, 1000])):
        a, w = shape_inputs(4096, 4096, ms[-1], dtype)
        bad = mismatches(mm.matmul, a, w.t(), ms)
        report[f"matmul o_proj {dtype}"] = {"m_tested": len(ms), "mismatched_m": bad}
        log(f"sweep o_proj {dtype}: {len(bad)} mismatched of {len(ms)}")
    x = torch.randn(8192, bench.HIDDEN, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    wn = torch.randn(bench.HIDDEN, device="cuda", dtype=torch.bfloat16)
    ms = list(range(1, 8193))
    report["rms_norm"] = {"mismatched_m": mismatches(lambda p, q: rn.rms_norm(p, q, 1e-6),
                                                     x, wn, ms), "m_tested": len(ms)}
    report["add_rms_norm"] = {"mismatched_m": mismatches(
        lambda p, q: rn.add_rms_norm(p, q[:p.shape[0]], wn, 1e-6)[0], x, r, ms),
        "m_tested": len(ms)}
    logits = torch.randn(512, bench.VOCAB, device="cuda") * 4
    ms = list(range(1, 513))
    report["log_softmax"] = {"mismatched_m": mismatches(lambda p, _: ls.log_softmax(p),
                                                        logits, None, ms), "m_tested": len(ms)}
    log("sweep norms:", {k: len(v["mismatched_m"]) for k, v in report.items()
                         if not k.startswith(("matmul", "cublas"))})
    return report


def benchmark(out: Path) -> dict:
    result = bench.run_all()
    rows = result.pop("_rows")
    bench.print_rows(rows)
    result["tuned_table"] = {f"{n},{k}": v for (n, k), v in mm.TUNED_16BIT.items()}
    (out / "kernels-bench.json").write_text(json.dumps(result, indent=1))
    return result["summary"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--tune-m", default=None, help="comma-separated Ms for --tune")
    parser.add_argument("--tune-shapes", default=None,
                        help="comma-separated shapes for --tune (" + ", ".join(bench.MATMUL_SHAPES)
                        + ")")
    parser.add_argument("--tune-spread", type=int, default=1,
                        help="sizes timed per M bucket for --tune (evenly spaced, the bound last)")
    parser.add_argument("--tune-configs", default=None,
                        help="comma-separated CONFIGS_16BIT names: time only these and the "
                        "config in force per bucket")
    parser.add_argument("--skip-bits", action="store_true",
                        help="no cross-config bits phase (when the GPU tests just ran it)")
    parser.add_argument("--tune-only", action="store_true",
                        help="--tune, then stop (no benchmark, sweeps or tests)")
    parser.add_argument("--deadline", type=float, default=360.0,
                        help="seconds after which the remaining phases are skipped")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    RESULT["environment"] = bench.environment()
    log(RESULT["environment"])
    phase("ceilings", ceilings, out, args.deadline)
    log(RESULT["ceilings"])
    if not args.skip_bits:
        phase("cross_config_bits", cross_config_bits, out, args.deadline)
    if args.tune or args.tune_only:
        shapes = args.tune_shapes.split(",") if args.tune_shapes else None
        ms = tuple(int(m) for m in args.tune_m.split(",")) if args.tune_m else bench.M_VALUES
        configs = args.tune_configs.split(",") if args.tune_configs else None
        phase("explore", lambda: explore(shapes, ms, args.tune_spread, configs), out,
              args.deadline)
        log("TUNED_16BIT =", RESULT["explore"].get("table"))
        if args.tune_only:
            return
    phase("benchmark", lambda: benchmark(out), out, args.deadline)
    phase("sweeps", sweeps, out, args.deadline)
    if not args.skip_tests:
        phase("tests", lambda: run_tests(out), out, args.deadline)
    log("done")


if __name__ == "__main__":
    main()
