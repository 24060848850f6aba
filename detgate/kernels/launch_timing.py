"""A launch's device time and host cost, measured from inside the kernels: for choices
between launches that give the same bits (matmul_triton's host-bound calls, cuBLASLt's
algorithms), where only speed is at stake."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

# GPU cycles of sleep queued ahead of each timing (about a millisecond on a Hopper's clocks):
# the host enqueues every timed call while the device still sleeps, so the events around
# them see device time alone, not the host's gaps between launches.
SLEEP_CYCLES = 2_000_000


def launch_costs(call: Callable[[], object], calls: int = 10, rounds: int = 3
                 ) -> tuple[float, float]:
    """(host us, device us) per call of `call` on the current stream: the fastest of `rounds`
    timings of `calls` back-to-back calls each. Not inside a CUDA graph capture."""
    host, device = [], []
    for _ in range(rounds):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        host.append(1e6 * (time.perf_counter() - t0) / calls)
        end.record()
        end.synchronize()
        device.append(1e3 * start.elapsed_time(end) / calls)
    return min(host), min(device)
