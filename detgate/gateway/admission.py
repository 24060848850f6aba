"""Admission: requests wait here for a worker slot, in a bounded queue, first come first served.

Workers take at most their capacity (gateway/router.py), so that a worker never holds work
of ours it cannot run yet: inside a worker, waiting and hanging look the same to every
timeout. What finds no room waits here, at most `queue_factor` x the healthy workers' total
capacity requests at once and at most `timeout_s` each; past either it is refused at once
(503 `overloaded` with Retry-After) instead of piling up for minutes. A freed slot is handed
straight to the first waiter it suits (its model, fingerprint or pinned worker), so a
newcomer never overtakes a waiter, and a waiter whose weight does not fit yet keeps its
place (it is not starved by smaller requests behind it). A waiter that leaves (its client
gone, its time up) takes nothing with it. Many waiters can be cancelled in one loop turn (a
load tool cancelling everything it sent): each one's future is cancelled at once, but it
leaves the queue only when its task next runs, so a hand-off in between skips (and drops)
a waiter whose future is already done instead of handing it a slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from detgate.gateway.errors import GatewayError, Overloaded


@dataclass(eq=False)
class Fits:
    """A waiter: which workers suit it and how many sequences it needs; `handed` is the
    worker whose slot it was given (already held for it)."""

    accepts: Callable[[Any], bool]
    weight: int
    handed: Any = None
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop()
                                   .create_future())


class Admission:
    def __init__(self, *, queue_factor: float, timeout_s: float, retry_after_s: int) -> None:
        self.queue_factor = queue_factor
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.waiting: deque[Fits] = deque()

    @property
    def depth(self) -> int:
        return len(self.waiting)

    def limit(self, capacity: int) -> int:
        """How many may wait beside `capacity` sequences of healthy workers."""
        return math.ceil(self.queue_factor * capacity)

    def wanted(self, worker: Any) -> bool:
        """A waiter would take a slot of `worker`: newcomers queue behind it."""
        return any(not w.future.done() and w.accepts(worker) for w in self.waiting)

    def _refuse(self, why: str) -> Overloaded:
        return Overloaded(f"the gateway's workers are busy ({why}); retry shortly",
                          headers={"Retry-After": str(self.retry_after_s)})

    async def wait(self, waiter: Fits, limit: int, deadline: float) -> Any:
        """Wait for a slot, until `deadline` (monotonic) at the latest: the worker it is on.
        However this ends, the waiter is out of the queue; a slot handed to it in the same
        moment as it failed stays in `handed` for the caller to give back."""
        if len(self.waiting) >= limit:
            raise self._refuse(f"{len(self.waiting)} requests already wait")
        self.waiting.append(waiter)
        wait_s = min(self.timeout_s, deadline - time.monotonic())
        try:
            async with asyncio.timeout(max(wait_s, 0)):
                return await waiter.future
        except TimeoutError:
            raise self._refuse(f"no slot within {wait_s:.3g}s") from None
        finally:
            # Handed a slot, or failed, it is already out of the queue.
            with contextlib.suppress(ValueError):
                self.waiting.remove(waiter)

    def hand_off(self, worker: Any, acquire: Callable[[Any, int], None]) -> None:
        """Give `worker`'s free room to the waiters it suits, oldest first; stop at the first
        one that does not fit yet (it keeps its turn)."""
        for waiter in list(self.waiting):
            if waiter.future.done():  # cancelled (its client left), not yet out of the queue
                self.waiting.remove(waiter)
                continue
            if not waiter.accepts(worker):
                continue
            if worker.seqs + worker.need(waiter.weight) > worker.capacity:
                return
            acquire(worker, waiter.weight)
            self.waiting.remove(waiter)
            waiter.handed = worker
            waiter.future.set_result(worker)

    def fail_stranded(self, workers: Iterable[Any], error: GatewayError) -> None:
        """Waiters that no healthy worker suits any more fail now instead of at their
        timeout."""
        workers = list(workers)
        for waiter in list(self.waiting):
            if waiter.future.done():
                self.waiting.remove(waiter)
            elif not any(waiter.accepts(w) for w in workers):
                self.waiting.remove(waiter)
                waiter.future.set_exception(error)
