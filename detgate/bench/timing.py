"""The timers the kernel benchmarks share.

- `graph_ms`: CUDA-graph replays of back-to-back calls (launch gaps out of the numbers, as a
  serving engine runs them);
- `events_ms`: CUDA events around back-to-back eager calls (host cost included);
- `copy_tb_s`: the device's copy bandwidth (read + write), the ceiling of memory-bound kernels;
- `min_ms_pair`: a host timer for the CPU, two functions interleaved so that other load on a
  shared machine hits both alike.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch


def graph_ms(call: Callable[[int], object], copies: int, out_bytes: int,
             target_ms: float = 3.0, replays: int = 7) -> float:
    """Milliseconds per call: median over replays of a CUDA graph of back-to-back calls,
    call(i) using input copy i % copies."""
    for i in range(copies):  # compile, autotune-free warm-up, cuBLAS handles
        call(i)
    estimate = max(events_ms(lambda i: call(i % copies), copies, 1), 1e-3)
    # Outputs made inside the capture live in the graph's pool: bound their total size.
    reps = max(1, min(200, math.ceil(target_ms / estimate), int(4e9 // max(out_bytes, 1))))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call(0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(reps):
            call(r % copies)
    return events_ms(lambda _: graph.replay(), 1, replays, warmup=1) / reps


def events_ms(call: Callable[[int], object], calls: int, repeats: int, warmup: int = 0) -> float:
    """Milliseconds per call: `calls` back-to-back calls call(0..calls-1) between two CUDA
    events, median of `repeats`, after `warmup` calls."""
    for i in range(warmup):
        call(i)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        for i in range(calls):
            call(i)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def copy_tb_s(nbytes: int = 2**31) -> float:
    """Device copy bandwidth in TB/s, bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = graph_ms(lambda _: dst.copy_(src), 1, 0)
    return 2 * nbytes / (ms * 1e-3) / 1e12


def min_ms_pair(ours: Callable[[], object], ref: Callable[[], object], reps: int = 15
                ) -> tuple[float, float]:
    """Minimum milliseconds of each, over interleaved repetitions (after one warm-up call)."""
    ours(), ref()
    t_ours, t_ref = [], []
    for _ in range(reps):
        for fn, times in ((ours, t_ours), (ref, t_ref)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(t_ours) * 1e3, min(t_ref) * 1e3
