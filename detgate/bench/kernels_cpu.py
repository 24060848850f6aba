"""`detgate bench kernels --device cpu`: the CPU kernels against plain torch, in one run.

Shapes are the shipped models' (SmolLM2-135M: hidden 576, intermediate 1536, vocab 49,152;
tiny: hidden 256, intermediate 768, vocab 151,936), M (rows in the batch) = 1, 4, 16, 64, 256,
1024, fp32 and bf16, on one thread and on all of them. The baseline is what default mode runs:
`torch.mm` (MKL for fp32, oneDNN for bf16), torch's RMSNorm arithmetic, `torch.log_softmax`,
`F.silu(gate) * up`. `ratio` = torch's time / ours (1.0: invariance is free; below 1 it costs).
Timings are the minimum over interleaved repetitions, so that other load on a shared machine
hits both sides alike. Host timer: these are eager calls, host cost included. The attention
rows are `detgate.bench.attention`'s CPU rows (our kernel vs the padded SDPA of default mode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from detgate import kernels
from detgate.bench import attention
from detgate.bench.timing import min_ms_pair
from detgate.contract.provenance import cpu_model, git_commit, save_result, utc_now, versions

M_VALUES = (1, 4, 16, 64, 256, 1024)
EPS = 1e-6
# model -> name -> (K, N) of x [M, K] @ W.t()
SHAPES = {
    "smollm2": {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072),
                "down": (1536, 576), "lm_head": (576, 49152)},
    "tiny": {"qkv": (256, 384), "gate_up": (256, 1536), "down": (768, 256)},
}


def _row(op: str, shape: str, m: int, dtype: torch.dtype, ours_ms: float, torch_ms: float
         ) -> dict:
    return {"op": op, "shape": shape, "m": m, "dtype": str(dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "ours_ms": ours_ms, "torch_ms": torch_ms,
            "ratio": torch_ms / ours_ms}


def _reps(m: int, n: int) -> int:
    return 3 if m * n >= 64 * 49152 else 15


def _torch_rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def _torch_silu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rows_for(dtype: torch.dtype, m_values=M_VALUES) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for model, shapes in SHAPES.items():
        for name, (k, n) in shapes.items():
            w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
            for m in m_values:
                if name == "lm_head" and m > 256:
                    continue  # a head runs on the rows that sample, not on whole prefills
                a = torch.randn(m, k, generator=gen).to(dtype)
                ours, ref = min_ms_pair(lambda a=a, w=w: kernels.matmul(a, w.t()),
                                         lambda a=a, w=w: torch.mm(a, w.t()), _reps(m, n))
                rows.append(_row("matmul", f"{model} {name} K={k} N={n}", m, dtype, ours, ref))
    for h in (576, 64):
        w = torch.ones(h).to(dtype)
        for m in (1, 64, 1024):
            x = torch.randn(m, h, generator=gen).to(dtype)
            ours, ref = min_ms_pair(lambda x=x, w=w: kernels.rms_norm(x, w, EPS),
                                     lambda x=x, w=w: _torch_rms(x, w))
            rows.append(_row("rms_norm", f"H={h}", m, dtype, ours, ref))
    for m in (1, 64, 1024):
        x = torch.randn(m, 3072, generator=gen).to(dtype)
        ours, ref = min_ms_pair(lambda x=x: kernels.silu_and_mul(x), lambda x=x: _torch_silu(x))
        rows.append(_row("silu_and_mul", "I=1536", m, dtype, ours, ref))
    for m in (1, 16, 64):
        x = torch.randn(m, 49152, generator=gen).to(dtype)
        ours, ref = min_ms_pair(lambda x=x: kernels.log_softmax(x),
                                 lambda x=x: torch.log_softmax(x.float(), -1))
        rows.append(_row("log_softmax", "V=49152", m, dtype, ours, ref))
    return rows


def run(threads: tuple[int, ...]) -> dict[str, list[dict]]:
    """The kernel rows and the attention rows, on each thread count."""
    saved = torch.get_num_threads()
    result: dict[str, list[dict]] = {"rows": [], "attention": []}
    try:
        for n in threads:
            torch.set_num_threads(n)
            for dtype in (torch.float32, torch.bfloat16):
                result["rows"] += rows_for(dtype)
            result["attention"] += attention.run("cpu")
    finally:
        torch.set_num_threads(saved)
    return result


def main(args) -> int:
    from detgate.kernels.cpu_ext import load

    threads = (args.threads,) if args.threads else tuple(sorted({1, torch.get_num_threads()}))
    measured = run(threads)
    for r in measured["rows"]:
        print(f"{r['op']:12s} {r['shape']:30s} {r['dtype']:8s} t={r['threads']} M={r['m']:5d}  "
              f"ours {r['ours_ms']:9.3f} ms  torch {r['torch_ms']:9.3f} ms  "
              f"ratio {r['ratio']:5.2f}")
    for r in measured["attention"]:
        print(f"{r['op']:17s} B={r['batch']:<3d} L={r['context']:<4d} q={r['q_len']:<3d} "
              f"t={r['threads']}  ours {r['ours_ms']:9.3f} ms  sdpa {r['sdpa_ms']:9.3f} ms  "
              f"ratio {r['ratio']:5.2f}")
    result = {"benchmark": "kernels-cpu", "date": utc_now(), "commit": git_commit(),
              "device": cpu_model(), "cpu_kernels": load().isa(),
              "versions": versions("torch"), "timer": "host perf_counter, eager calls",
              "ratio": "torch time / ours (above 1: ours faster)", **measured}
    print(f"wrote {save_result(result, 'kernels-cpu', args.json)}")
    return 0
