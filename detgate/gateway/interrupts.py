"""Ending requests from outside: a shutdown past its grace, a worker ejected while requests
wait on it, or a client gone while its request waits (gateway/disconnect.py).

Both cancel the task that serves the request, with a reason. The code waiting in that task
catches the CancelledError and `take`s its own reason: if it is there, the task is un-cancelled
and the request ends in the error shape with a record (or is retried on another worker);
without a reason the cancellation is a real one (the client left) and propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

log = logging.getLogger("detgate.gateway")

SHUTDOWN = "shutdown"
EJECTED = "ejected"
CLIENT_GONE = "client_gone"


def stopping() -> bool:
    """True once the current task has been cancelled, even where a library on the way caught
    the CancelledError and carried on (the task's cancellation count stays up): a background
    loop checks it each turn. Seen: the health loop of Redis kept running after the shutdown
    cancelled it, and the gateway never exited (1 SIGTERM in 8)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class Interrupts:
    def __init__(self) -> None:
        self._reasons: dict[asyncio.Task, str] = {}

    def interrupt(self, task: asyncio.Task, reason: str) -> None:
        if task is asyncio.current_task() or task.done() or task in self._reasons:
            return
        self._reasons[task] = reason
        task.add_done_callback(self._forget)
        task.cancel()

    def _forget(self, task: asyncio.Task) -> None:
        self._reasons.pop(task, None)

    def take(self, reason: str) -> bool:
        """Inside `except CancelledError`: True (and the task un-cancelled) when this task was
        interrupted for `reason`."""
        task = asyncio.current_task()
        if task is None or self._reasons.get(task) != reason:
            return False
        del self._reasons[task]
        task.uncancel()
        return True


class Drain:
    """Graceful shutdown: `begin` stops new requests; after the grace, what still runs is
    interrupted with SHUTDOWN."""

    def __init__(self, interrupts: Interrupts) -> None:
        self.interrupts = interrupts
        self.draining = False
        self.aborted = False
        self._tasks: set[asyncio.Task] = set()

    def begin(self, grace_s: float) -> None:
        if self.draining:
            return
        self.draining = True
        log.warning("shutting down: %d request(s) in flight get %gs to finish",
                    len(self._tasks), grace_s)
        asyncio.get_running_loop().call_later(grace_s, self._abort)

    def _abort(self) -> None:
        self.aborted = True
        if self._tasks:
            log.warning("shutdown grace over: aborting %d request(s)", len(self._tasks))
        for task in list(self._tasks):
            self.interrupts.interrupt(task, SHUTDOWN)

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Around the part of a request that waits on a worker."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            yield
        finally:
            self._tasks.discard(task)
