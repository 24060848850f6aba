"""The worker's Prometheus metrics, all defined here, in a registry owned by the app.

The batch-size histograms are the evidence that concurrent requests share engine steps
(continuous batching): a batch-invariant worker's numbers must not depend on them.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from detgate.worker.engine.engine import Engine, StepStats

_SEQ_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Window over which the tokens/s gauge is averaged.
_RATE_WINDOW_S = 10.0


class WorkerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # Registered first: readers that look for "the batch size histogram" take the first one.
        self.batch_seqs = Histogram("detgate_worker_batch_size_seqs",
                                    "Sequences scheduled in one engine step", buckets=_SEQ_BUCKETS,
                                    registry=r)
        self.batch_tokens = Histogram("detgate_worker_batch_size_tokens",
                                      "Tokens run in one engine step", buckets=_TOKEN_BUCKETS,
                                      registry=r)
        self.step_seconds = Histogram("detgate_worker_step_duration_seconds",
                                      "Wall time of one engine step", registry=r)
        self.waiting = Gauge("detgate_worker_requests_waiting", "Requests waiting for admission",
                             registry=r)
        self.running = Gauge("detgate_worker_requests_running", "Requests admitted and running",
                             registry=r)
        self.free_blocks = Gauge("detgate_worker_kv_cache_free_blocks",
                                 "KV cache blocks not held by any sequence", registry=r)
        self.total_blocks = Gauge("detgate_worker_kv_cache_blocks", "KV cache blocks in total",
                                  registry=r)
        self.generated = Counter("detgate_worker_generated_tokens", "Tokens generated", registry=r)
        self.preemptions = Counter("detgate_worker_preemptions",
                                   "Sequences preempted (recomputed later) for lack of KV blocks",
                                   registry=r)
        self.tokens_per_second = Gauge(
            "detgate_worker_generation_tokens_per_second",
            f"Generated tokens per second over the last {_RATE_WINDOW_S:g} s", registry=r)
        self.requests = Counter("detgate_worker_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        self._lock = threading.Lock()  # the engine thread appends, the server thread reads

    def bind(self, engine: Engine) -> None:
        """Read queue depths and free blocks live, so they stay right while the engine idles."""
        self.waiting.set_function(lambda: len(engine.scheduler.waiting))
        self.running.set_function(lambda: len(engine.scheduler.running))
        self.free_blocks.set_function(lambda: engine.block_manager.num_free_blocks)
        self.total_blocks.set(engine.block_manager.num_blocks)

    def observe_step(self, stats: StepStats) -> None:
        """Called by the engine loop after every step."""
        self.batch_seqs.observe(stats.num_seqs)
        self.batch_tokens.observe(stats.num_tokens)
        self.step_seconds.observe(stats.seconds)
        self.generated.inc(stats.num_generated)
        self.preemptions.inc(stats.num_preempted)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, stats.num_generated))
            while self._recent[0][0] < now - _RATE_WINDOW_S:
                self._recent.popleft()

    def observe_finished(self, finish_reason: str) -> None:
        self.requests.labels(finish_reason=finish_reason).inc()

    def render(self) -> bytes:
        now = time.monotonic()
        with self._lock:
            recent = sum(n for t, n in self._recent if t >= now - _RATE_WINDOW_S)
        self.tokens_per_second.set(recent / _RATE_WINDOW_S)
        return generate_latest(self.registry)
