"""`detgate bench kernels` on CUDA: the batch-invariant kernels against torch (cuBLAS, SDPA),
side by side in one run.

Shapes are Qwen3-8B's (hidden 4096, intermediate 12288, 32 q / 8 kv heads of 128, vocab
151936), M (tokens in the batch) from 1 to 8192. Every timing is the median of CUDA-graph
replays of many back-to-back calls (`timing.graph_ms`: launch gaps out of the numbers, as a
serving engine runs them), rotating over enough weight copies that the weights never sit in L2
between calls. `ratio` = torch time / our time: above 1 we are faster. The attention rows come
from `detgate.bench.attention`; without CUDA (or with `--device cpu`) the CPU benchmark,
`detgate.bench.kernels_cpu`, runs instead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from detgate.bench import attention
from detgate.bench.timing import graph_ms
from detgate.contract.provenance import git_commit, utc_now, versions
from detgate.kernels import log_softmax_triton, matmul_triton, rmsnorm_triton

HIDDEN = 4096
VOCAB = 151936
EPS = 1e-6
M_VALUES = (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# name -> (N, K) of x [M, K] @ W.t(), W [N, K] as nn.Linear stores it.
MATMUL_SHAPES = {
    "qkv_proj": (4096 + 1024 + 1024, HIDDEN),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_up_proj": (2 * 12288, HIDDEN),
    "down_proj": (HIDDEN, 12288),
    "lm_head": (VOCAB, HIDDEN),
}
# Goals (issue): matmul >= 0.9x cuBLAS at M >= 256, >= 0.8x at M <= 64; norms >= 0.9x torch.
MATMUL_GOALS = ((64, 0.8), (255, None), (8192, 0.9))


@dataclass
class Row:
    op: str
    shape: str
    m: int
    ours_ms: float
    torch_ms: float
    ratio: float
    # TFLOP/s for matmuls, GB/s of compulsory traffic for the memory-bound ops (ours)
    ours_rate: float
    rate_unit: str
    config: str = ""


def copies_for(nbytes: int) -> int:
    """Enough input copies that a round of them overflows L2 three times."""
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(8, math.ceil(3 * l2 / max(nbytes, 1))))


def matmul_weights(n: int, k: int, dtype=torch.bfloat16) -> list[torch.Tensor]:
    count = copies_for(n * k * 2)
    return [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for _ in range(count)]


def side_by_side(ours: Callable, ref: Callable, inputs: list[tuple], out_bytes: int
                 ) -> tuple[float, float]:
    """(our ms, torch ms) per call on the same rotating inputs, measured back to back."""
    ours_ms = graph_ms(lambda i: ours(*inputs[i]), len(inputs), out_bytes)
    ref_ms = graph_ms(lambda i: ref(*inputs[i]), len(inputs), out_bytes)
    return ours_ms, ref_ms


def bench_matmul(name: str, n: int, k: int, m_values=M_VALUES) -> list[Row]:
    weights = matmul_weights(n, k)
    info = matmul_triton.device_info(torch.cuda.current_device())
    rows = []
    for m in m_values:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        inputs = [(a, w.t()) for w in weights]
        ours, ref = side_by_side(matmul_triton.matmul, torch.mm, inputs, m * n * 2)
        cfg = matmul_triton.pick_config(m, n, k, torch.bfloat16, info)
        rows.append(Row("matmul", name, m, ours, ref, ref / ours, 2.0 * m * n * k / ours / 1e9,
                        "TFLOP/s", matmul_config_name(cfg)))
    return rows


def matmul_config_name(cfg: matmul_triton.TileConfig) -> str:
    """The name of a matmul tile config in CONFIGS_16BIT (else its repr)."""
    names = {v: key for key, v in matmul_triton.CONFIGS_16BIT.items()}
    return names.get(cfg, str(cfg))


def randn_copies(m: int, width: int, dtype, nbytes: int) -> list[torch.Tensor]:
    """Enough random [m, width] inputs to rotate through (`copies_for` their bytes)."""
    return [torch.randn(m, width, device="cuda", dtype=dtype) for _ in range(copies_for(nbytes))]


def torch_rms_norm(x, w, eps):
    """The torch baseline of rms_norm."""
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def torch_add_rms_norm(x, r, w, eps):
    """The torch baseline of add_rms_norm: (rms_norm(x + r), x + r)."""
    s = x + r
    return torch_rms_norm(s, w, eps), s


def bench_rms_norm(m_values=M_VALUES) -> list[Row]:
    w = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    shape = f"[M,{HIDDEN}] bf16"
    rows = []
    for m in m_values:
        nbytes = m * HIDDEN * 2
        xs = randn_copies(m, HIDDEN, torch.bfloat16, 2 * nbytes)
        rs = randn_copies(m, HIDDEN, torch.bfloat16, 2 * nbytes)
        ours, ref = side_by_side(rmsnorm_triton.rms_norm, torch_rms_norm,
                                 [(x, w, EPS) for x in xs], nbytes)
        rows.append(Row("rms_norm", shape, m, ours, ref, ref / ours, 2 * nbytes / ours / 1e6,
                        "GB/s"))
        ours, ref = side_by_side(rmsnorm_triton.add_rms_norm, torch_add_rms_norm,
                                 [(x, r, w, EPS) for x, r in zip(xs, rs, strict=False)],
                                 2 * nbytes)
        rows.append(Row("add_rms_norm", shape, m, ours, ref, ref / ours,
                        4 * nbytes / ours / 1e6, "GB/s"))
    return rows


def bench_log_softmax(m_values=M_VALUES) -> list[Row]:
    rows = []
    for m in m_values:
        nbytes = m * VOCAB * 4
        inputs = [(x, -1) for x in randn_copies(m, VOCAB, torch.float32, 2 * nbytes)]
        ours, ref = side_by_side(log_softmax_triton.log_softmax, torch.log_softmax, inputs,
                                 nbytes)
        rows.append(Row("log_softmax", f"[M,{VOCAB}] fp32", m, ours, ref, ref / ours,
                        2 * nbytes / ours / 1e6, "GB/s"))
        del inputs
    return rows


def matmul_goal(m: int) -> float | None:
    for upper, goal in MATMUL_GOALS:
        if m <= upper:
            return goal
    return None


def summarize(rows: list[Row]) -> dict:
    misses = []
    for r in rows:
        goal = matmul_goal(r.m) if r.op == "matmul" else 0.9
        if goal is not None and r.ratio < goal:
            misses.append(f"{r.op} {r.shape} M={r.m}: {r.ratio:.2f}x < {goal}x")
    return {"goal_misses": misses, "rows": len(rows)}


def environment() -> dict:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "device": props.name, "sms": props.multi_processor_count,
        "l2_bytes": props.L2_cache_size,
        "versions": {**versions("torch", "triton"), "cuda": torch.version.cuda},
        "git_commit": git_commit(), "date": utc_now(),
    }


def print_rows(rows: list[Row]) -> None:
    print(f"{'op':<13}{'shape':<22}{'M':>6}{'ours ms':>10}{'torch ms':>10}{'ratio':>7}"
          f"{'rate':>9} {'unit':<8}{'config'}")
    for r in rows:
        print(f"{r.op:<13}{r.shape:<22}{r.m:>6}{r.ours_ms:>10.4f}{r.torch_ms:>10.4f}"
              f"{r.ratio:>7.2f}{r.ours_rate:>9.1f} {r.rate_unit:<8}{r.config}")


def run_all() -> dict:
    rows: list[Row] = []
    for name, (n, k) in MATMUL_SHAPES.items():
        rows += bench_matmul(name, n, k)
        torch.cuda.empty_cache()
    rows += bench_rms_norm()
    rows += bench_log_softmax()
    torch.cuda.empty_cache()
    return {**environment(), "rows": [asdict(r) for r in rows],
            "attention": attention.run("cuda"), "summary": summarize(rows), "_rows": rows}


def write_json(result: dict, path: str | None) -> None:
    """Write the result to --json's path, if one was given."""
    if path:
        Path(path).write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")


def main(args) -> int:
    result = run_all()
    rows = result.pop("_rows")
    print_rows(rows)
    for row in result["attention"]:
        print(row)
    print("goal misses:", *result["summary"]["goal_misses"] or ["none"], sep="\n  ")
    write_json(result, args.json)
    return 0
