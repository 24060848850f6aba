"""The CPU kernels against plain torch, side by side in one run: `run() -> list[dict]`.

Small-model shapes (hidden 256-1024, the projections of a Qwen3-style block) at decode-like
(M = 1-32) and prefill-like (M = 256-2048) row counts. `ratio` = torch's time / our time, as in
kernels/bench.py (1.0 = invariance is free, below 1 it costs). Timings are the minimum over
interleaved repetitions, so that other load on a shared machine hits both sides alike; on one
thread (`threads`) unless told, since OpenMP waits on a loaded machine swamp small ops.
bf16 matmul is plain torch.mm on the CPU (see kernels/cpu.py), so only fp32 is timed unless
asked.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

import kernels

HIDDENS = (256, 1024)
M_VALUES = (1, 2, 4, 8, 16, 32, 256, 1024, 2048)
EPS = 1e-6


def min_ms_pair(ours: Callable[[], object], ref: Callable[[], object], reps: int = 25
                ) -> tuple[float, float]:
    """Minimum milliseconds of each, over interleaved repetitions (after one warm-up call):
    interleaving exposes both to the same machine load."""
    ours(), ref()
    t_ours, t_ref = [], []
    for _ in range(reps):
        for fn, times in ((ours, t_ours), (ref, t_ref)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(t_ours) * 1e3, min(t_ref) * 1e3


def _row(op: str, shape: str, m: int, dtype: torch.dtype, ours_ms: float, torch_ms: float
         ) -> dict:
    return {"op": op, "shape": shape, "m": m, "dtype": str(dtype).removeprefix("torch."),
            "ours_ms": ours_ms, "torch_ms": torch_ms, "ratio": torch_ms / ours_ms,
            "threads": torch.get_num_threads()}


def run(dtypes: tuple[torch.dtype, ...] = (torch.float32,), threads: int | None = 1
        ) -> list[dict]:
    saved = torch.get_num_threads()
    torch.set_num_threads(threads or saved)
    try:
        return _rows(dtypes)
    finally:
        torch.set_num_threads(saved)


def _rows(dtypes: tuple[torch.dtype, ...]) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype in dtypes:
        for hidden in HIDDENS:
            for name, (n, k) in {"up": (3 * hidden, hidden), "down": (hidden, 3 * hidden)}.items():
                w = torch.randn(n, k, generator=gen).to(dtype)
                for m in M_VALUES:
                    a = torch.randn(m, k, generator=gen).to(dtype)
                    ours, ref = min_ms_pair(lambda a=a, w=w: kernels.matmul(a, w.t()),
                                             lambda a=a, w=w: torch.mm(a, w.t()))
                    rows.append(_row("matmul", f"{name} K={k} N={n}", m, dtype, ours, ref))
            w = torch.randn(hidden, generator=gen).to(dtype)
            for m in (1, 32, 2048):
                x = torch.randn(m, hidden, generator=gen).to(dtype)

                def torch_rms(x=x, w=w):
                    xf = x.float()
                    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
                                ).to(x.dtype)

                ours, ref = min_ms_pair(lambda x=x, w=w: kernels.rms_norm(x, w, EPS), torch_rms)
                rows.append(_row("rms_norm", f"H={hidden}", m, dtype, ours, ref))
        for m in (1, 32):
            logits = torch.randn(m, 151936, generator=gen).to(dtype)
            ours, ref = min_ms_pair(lambda x=logits: kernels.log_softmax(x),
                                     lambda x=logits: torch.log_softmax(x.float(), -1))
            rows.append(_row("log_softmax", "V=151936", m, dtype, ours, ref))
    return rows
