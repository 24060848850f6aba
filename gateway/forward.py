"""Sending a request to a worker: a lease on it, per-attempt and total timeouts, at most one
retry.

A retry happens only when nothing reached the client yet and the first worker gave no
usable answer (unreachable, timed out, 5xx); it goes to another worker, and the failing one
is ejected until its health check passes. A worker's 4xx is the client's problem: no retry.

A worker ejected while requests wait on it (its health check timed out: hung, SIGSTOPped)
interrupts them at once (gateway/interrupts.py): they are retried like any other failure
instead of waiting out their timeout. A stream counts as answered only from its first event
(`first_byte_timeout_s`), so until then it is retried too.

The lease (`async with forwarder.lease(model, deadline=...) as lease`; a stream's is opened
first and entered by the task that relays it, see Lease) is the one owner of a request's hold
on a worker: it chooses the worker, counts the request in the worker's `inflight` while the
worker works on it, lets an ejection interrupt the task waiting on it, ejects a worker that
fails, and releases on every way out of the `async with` (an answer, an error, the client
leaving, a shutdown abort). Routes read `lease.worker` and report the fingerprint an answer
carried with `lease.learn`; they never touch the router themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import KW_ONLY, dataclass
from typing import Any, TypeVar

import orjson

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

T = TypeVar("T")


@dataclass
class Forwarder:
    """What leases work with: the workers, the HTTP client, metrics, interrupts, timeouts."""

    router: Router
    upstream: Upstream
    metrics: Metrics
    interrupts: Interrupts
    _: KW_ONLY
    attempt_timeout_s: float
    first_byte_timeout_s: float

    def choose(self, model: str, *, fingerprint: str) -> Worker:
        """A worker for leases pinned to it (a replay and its load), see Router.choose."""
        return self.router.choose(model, fingerprint=fingerprint)

    def lease(self, model: str, *, deadline: float, pinned: Worker | None = None,
              fingerprint: str | None = None, builtin: bool = False) -> Lease:
        """A lease for one request on `model`, to be used as `async with`. `pinned`: that
        worker only, no retry; `fingerprint` and `builtin` narrow the choice (a retry
        included), see Router.choose."""
        return Lease(self, model, deadline, pinned=pinned, fingerprint=fingerprint,
                     builtin=builtin)


class Lease:
    """One request's hold on a worker, from the choice to the release.

    `send` gets a whole answer: the worker is held only while it answers. `open_stream`
    opens a stream (a failed one leaves nothing held) while the client can still be given an
    error status; the stream then holds its worker until the `async with lease` of the task
    that relays it with `events()` ends. `worker` is the worker that answered; `upstream_s`
    the time spent waiting on workers."""

    def __init__(self, forwarder: Forwarder, model: str, deadline: float, *,
                 pinned: Worker | None, fingerprint: str | None, builtin: bool) -> None:
        self._fw = forwarder
        self._model = model
        self._deadline = deadline
        self._pinned = pinned
        self._fingerprint = fingerprint
        self._builtin = builtin
        self._last: GatewayError | None = None  # the last failed attempt's error
        self._stream: EventStream | None = None
        self._opened_at = 0.0
        self._reader: asyncio.Task | None = None
        self.worker: Worker | None = None
        self.upstream_s = 0.0
        self.complete = False  # the stream ended in `[DONE]`

    async def __aenter__(self) -> Lease:
        if self._stream is not None:
            # A stream opened before: the task that reads it from here waits on its worker.
            self._reader = asyncio.current_task()
            self.worker.attempts.add(self._reader)
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        """Let go of an open stream's worker, however the `async with` ends."""
        if self._stream is None:
            return
        stream, self._stream = self._stream, None
        self.worker.attempts.discard(self._reader)
        stream.close()
        self._fw.router.release(self.worker)
        self.upstream_s = time.perf_counter() - self._opened_at
        self._fw.metrics.observe_upstream(self.worker.name, self.upstream_s)

    def learn(self, fingerprint: str | None) -> str | None:
        """Note the fingerprint the worker's answer carried (a worker's own fingerprint wins
        over a derived one); returns the one to report: that, or the worker's known one."""
        self._fw.router.learn(self.worker, fingerprint)
        return fingerprint or self.worker.fingerprint

    # -- a whole answer -----------------------------------------------------------------------

    async def send(self, path: str, body: bytes) -> Answer:
        """The worker's 2xx answer; its 4xx raises UpstreamRejected; no usable answer from
        any attempt raises UpstreamFailed or UpstreamTimeout."""
        for worker in self._attempts():
            budget = self._budget(self._fw.attempt_timeout_s)
            answer = await self._attempt(worker, self._post(worker, path, body, budget))
            if answer is None:
                continue
            if answer.status >= 500:
                self._failed(worker, Unreachable(f"answered {answer.status}"))
                continue
            if answer.status >= 400:
                raise worker_error(answer.status, answer.body)
            self.worker = worker
            return answer
        raise self._last

    async def _post(self, worker: Worker, path: str, body: bytes, budget: float) -> Answer:
        t0 = time.perf_counter()
        try:
            with self._holding(worker):
                return await self._fw.upstream.post(worker.url + path, body, budget)
        finally:
            dt = time.perf_counter() - t0
            self.upstream_s += dt
            self._fw.metrics.observe_upstream(worker.name, dt)

    # -- a stream -----------------------------------------------------------------------------

    async def open_stream(self, path: str, body: bytes) -> None:
        """Open a stream whose first event has arrived (nothing has reached the client yet);
        it holds its worker until the lease ends. Failures as for `send`."""
        for worker in self._attempts():
            budget = self._budget(self._fw.first_byte_timeout_s)
            t0 = time.perf_counter()
            opened = await self._attempt(worker, self._open(worker, path, body, budget, t0))
            if opened is None:
                continue
            stream, raw = opened
            if raw is None:
                self.worker, self._stream, self._opened_at = worker, stream, t0
                return
            if stream.status >= 500:
                self._failed(worker, Unreachable(f"answered {stream.status}"))
                continue
            raise worker_error(stream.status, raw)
        raise self._last

    async def _open(self, worker: Worker, path: str, body: bytes, budget: float,
                    t0: float) -> tuple[EventStream, bytes | None]:
        """A 200 stream primed, its worker still held (raw None); or a refusal's body, its
        worker released. On any exception nothing is held."""
        self._fw.router.acquire(worker)
        stream: EventStream | None = None
        try:
            with self._waiting_on(worker):
                stream = await self._fw.upstream.open_stream(
                    worker.url + path, body, first_byte_timeout_s=budget,
                    read_timeout_s=self._fw.attempt_timeout_s)
                if stream.status == 200:
                    await stream.prime(max(budget - (time.perf_counter() - t0), 0.001))
                    return stream, None
                raw = await stream.body()
        except BaseException:
            if stream is not None:
                stream.close()
            self._fw.router.release(worker)
            raise
        self._fw.router.release(worker)
        return stream, raw

    async def events(self) -> AsyncIterator[dict]:
        """The open stream's chunks, up to `[DONE]` (which sets `complete`) or its end. A
        stream that breaks, stalls or sends an event that is not JSON ejects its worker, and
        the error is raised."""
        assert self._stream is not None
        try:
            async for data in self._stream.events():
                if data == b"[DONE]":
                    self.complete = True
                    return
                yield orjson.loads(data)
        except (Unreachable, TimedOut, orjson.JSONDecodeError) as exc:
            self._fw.router.eject(self.worker, str(exc))
            raise

    # -- attempts -----------------------------------------------------------------------------

    def _attempts(self) -> Iterator[Worker]:
        """The worker of each attempt: the pinned one once, or a first choice and then one
        other. With no other left, the last attempt's error is raised."""
        tried: Worker | None = None
        for _ in range(1 if self._pinned else MAX_ATTEMPTS):
            tried = self._pick(tried)
            yield tried

    async def _attempt(self, worker: Worker, attempt: Awaitable[T]) -> T | None:
        """What the attempt returned, or None when it failed in a way another attempt may
        mend: the worker unreachable or timed out (it is ejected), or ejected meanwhile."""
        try:
            return await attempt
        except (Unreachable, TimedOut) as exc:
            self._failed(worker, exc)
        except asyncio.CancelledError:
            if not self._fw.interrupts.take(EJECTED):
                raise
            self._last = UpstreamFailed("the worker stopped answering")
        return None

    def _pick(self, tried: Worker | None) -> Worker:
        if self._pinned is not None:
            return self._pinned
        try:
            return self._fw.router.choose(self._model, exclude=tried,
                                          fingerprint=self._fingerprint, builtin=self._builtin)
        except (NoWorker, Conflict, NotFound):
            if self._last is not None:
                raise self._last from None
            raise

    def _budget(self, limit: float) -> float:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise UpstreamTimeout("the request ran out of its total time")
        return min(limit, remaining)

    @contextlib.contextmanager
    def _holding(self, worker: Worker) -> Iterator[None]:
        """The worker counts this request in flight, and its ejection interrupts the wait."""
        self._fw.router.acquire(worker)
        try:
            with self._waiting_on(worker):
                yield
        finally:
            self._fw.router.release(worker)

    @contextlib.contextmanager
    def _waiting_on(self, worker: Worker) -> Iterator[None]:
        """An ejection of the worker interrupts this task (EJECTED) while inside."""
        task = asyncio.current_task()
        worker.attempts.add(task)
        try:
            yield
        finally:
            worker.attempts.discard(task)

    def _failed(self, worker: Worker, exc: Exception) -> None:
        """Eject the worker (the log says why); the tenant is told no address and no detail."""
        self._fw.router.eject(worker, str(exc))
        if isinstance(exc, TimedOut):
            self._last = UpstreamTimeout("the worker did not answer in time")
        else:
            self._last = UpstreamFailed("the worker failed to answer")
