"""Sending a request to a worker: choice, per-attempt and total timeouts, at most one retry.

A retry happens only when nothing reached the client yet and the first worker gave no
usable answer (unreachable, timed out, 5xx); it goes to another worker, and the failing one
is ejected until its health check passes. A worker's 4xx is the client's problem: no retry.

A worker ejected while requests wait on it (its health check timed out: hung, SIGSTOPped)
interrupts them at once (gateway/interrupts.py): they are retried like any other failure
instead of waiting out their timeout. A stream counts as answered only from its first event
(`first_byte_timeout_s`), so until then it is retried too.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from gateway.errors import (
    Conflict,
    GatewayError,
    NotFound,
    NoWorker,
    UpstreamFailed,
    UpstreamTimeout,
)
from gateway.interrupts import EJECTED, Interrupts
from gateway.metrics import Metrics
from gateway.responses import worker_error
from gateway.router import Router, Worker
from gateway.upstream import Answer, EventStream, TimedOut, Unreachable, Upstream

MAX_ATTEMPTS = 2


@dataclass
class Sent:
    worker: Worker
    answer: Answer
    upstream_s: float


@dataclass
class Opened:
    worker: Worker  # acquired: the caller releases it when the stream ends
    stream: EventStream
    started: float


class Forwarder:
    def __init__(self, router: Router, upstream: Upstream, metrics: Metrics,
                 interrupts: Interrupts, *, attempt_timeout_s: float,
                 first_byte_timeout_s: float) -> None:
        self.router = router
        self.upstream = upstream
        self.metrics = metrics
        self.interrupts = interrupts
        self.attempt_timeout_s = attempt_timeout_s
        self.first_byte_timeout_s = first_byte_timeout_s

    def _pick(self, model: str, tried: Worker | None, last: GatewayError | None,
              pinned: Worker | None, fingerprint: str | None = None,
              builtin: bool = False) -> Worker:
        if pinned is not None:
            return pinned
        try:
            return self.router.choose(model, exclude=tried, fingerprint=fingerprint,
                                      builtin=builtin)
        except (NoWorker, Conflict, NotFound):
            if last is not None:
                raise last from None
            raise

    def _budget(self, deadline: float, limit: float) -> float:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise UpstreamTimeout("the request ran out of its total time")
        return min(limit, remaining)

    def _failed(self, worker: Worker, exc: Exception) -> GatewayError:
        """Eject the worker (the log says why); the tenant is told no address and no detail."""
        self.router.eject(worker, str(exc))
        if isinstance(exc, TimedOut):
            return UpstreamTimeout("the worker did not answer in time")
        return UpstreamFailed("the worker failed to answer")

    async def send(self, model: str, path: str, body: bytes, *, deadline: float,
                   pinned: Worker | None = None, fingerprint: str | None = None,
                   builtin: bool = False) -> Sent:
        """`fingerprint` and `builtin` narrow the choice (a retry included), see Router.choose."""
        tried: Worker | None = None
        last: GatewayError | None = None
        spent = 0.0
        for _ in range(1 if pinned else MAX_ATTEMPTS):
            worker = self._pick(model, tried, last, pinned, fingerprint, builtin)
            budget = self._budget(deadline, self.attempt_timeout_s)
            self.router.acquire(worker)
            task = asyncio.current_task()
            worker.attempts.add(task)
            t0 = time.perf_counter()
            try:
                answer = await self.upstream.post(worker.url + path, body, budget)
            except (Unreachable, TimedOut) as exc:
                last, tried = self._failed(worker, exc), worker
                continue
            except asyncio.CancelledError:
                if not self.interrupts.take(EJECTED):
                    raise
                last, tried = UpstreamFailed("the worker stopped answering"), worker
                continue
            finally:
                worker.attempts.discard(task)
                dt = time.perf_counter() - t0
                spent += dt
                self.router.release(worker)
                self.metrics.observe_upstream(worker.name, dt)
            if answer.status >= 500:
                last = self._failed(worker, Unreachable(f"answered {answer.status}"))
                tried = worker
                continue
            if answer.status >= 400:
                raise worker_error(answer.status, answer.body)
            return Sent(worker, answer, spent)
        assert last is not None
        raise last

    async def open_stream(self, model: str, path: str, body: bytes, *,
                          deadline: float) -> Opened:
        """A stream whose first event has arrived (nothing has reached the client yet)."""
        tried: Worker | None = None
        last: GatewayError | None = None
        for _ in range(MAX_ATTEMPTS):
            worker = self._pick(model, tried, last, None)
            budget = self._budget(deadline, self.first_byte_timeout_s)
            self.router.acquire(worker)
            task = asyncio.current_task()
            worker.attempts.add(task)
            t0 = time.perf_counter()
            stream: EventStream | None = None
            failure: GatewayError | None = None
            try:
                stream = await self.upstream.open_stream(
                    worker.url + path, body, first_byte_timeout_s=budget,
                    read_timeout_s=self.attempt_timeout_s)
                if stream.status == 200:
                    await stream.prime(max(budget - (time.perf_counter() - t0), 0.001))
                else:
                    raw = await stream.body()
            except (Unreachable, TimedOut) as exc:
                failure = self._failed(worker, exc)
            except asyncio.CancelledError:
                if not self.interrupts.take(EJECTED):
                    self._drop(worker, stream)
                    raise
                failure = UpstreamFailed("the worker stopped answering")
            except BaseException:
                self._drop(worker, stream)
                raise
            finally:
                worker.attempts.discard(task)
            if failure is not None:
                self._drop(worker, stream)
                last, tried = failure, worker
                continue
            assert stream is not None
            if stream.status == 200:
                return Opened(worker, stream, t0)
            self.router.release(worker)
            if stream.status >= 500:
                last, tried = self._failed(worker, Unreachable(f"answered {stream.status}")), worker
                continue
            raise worker_error(stream.status, raw)
        assert last is not None
        raise last

    def _drop(self, worker: Worker, stream: EventStream | None) -> None:
        if stream is not None:
            stream.close()
        self.router.release(worker)
