"""Sending a request to a worker: a lease on a slot of it, timeouts that follow the request,
at most one retry.

A retry happens only when nothing reached the client yet and the first worker gave no
usable answer (unreachable, timed out, 5xx); it goes to another worker, except after a
connect timeout (NotConnected): the request never reached the worker, so the retry may go to
the same one. That is what keeps a gateway with one worker answering through a burst that
makes its own connects late (200 requests at once on a loaded 2-core host: 1 of 200 was a
502 before). Only a refused
connection ejects the worker at once; every other failure makes the router check its health
now (Router.suspect), which ejects it if it is dead or stuck, and never if it is merely
slow. A worker's 4xx is the client's problem: no retry.

Timeouts follow the request, not a flat figure: a stream must bring its first event within
`first_byte_timeout_s` and then one event at least every `progress_timeout_s` (the upstream
session's read timeout), however long it runs; a whole answer may take
`first_byte_timeout_s + token_timeout_s x` the tokens it asks for (max_tokens x n). Time
spent waiting for a slot in the gateway's queue counts against neither, only against the
request's total time.

A worker ejected while requests wait on it (its health check failed: dead, hung,
SIGSTOPped) interrupts them at once (gateway/interrupts.py): they are retried like any other
failure instead of waiting out their timeout. A stream counts as answered only from its
first event, so until then it is retried too.

The lease (`async with forwarder.lease(model, deadline=...) as lease`; a stream's is opened
first and entered by the task that relays it, see Lease) is the one owner of a request's hold
on a worker: it takes a slot (waiting in the queue if need be), counts the request in the
worker's `inflight` while the worker works on it, lets an ejection interrupt the task waiting
on it, and releases on every way out of the `async with` (an answer, an error, the client
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

from detgate.gateway.errors import (
    Conflict,
    GatewayError,
    NotFound,
    NoWorker,
    UpstreamFailed,
    UpstreamTimeout,
)
from detgate.gateway.interrupts import EJECTED, Interrupts
from detgate.gateway.metrics import Metrics
from detgate.gateway.responses import worker_error
from detgate.gateway.router import Router, Worker
from detgate.gateway.upstream import (
    Answer,
    EventStream,
    NotConnected,
    Refused,
    TimedOut,
    Unreachable,
    Upstream,
)

MAX_ATTEMPTS = 2
REQUEST_ID_HEADER = "X-Request-Id"  # the record id: what a built-in worker aborts by

T = TypeVar("T")


@dataclass
class Forwarder:
    """What leases work with: the workers, the HTTP client, metrics, interrupts, timeouts."""

    router: Router
    upstream: Upstream
    metrics: Metrics
    interrupts: Interrupts
    _: KW_ONLY
    first_byte_timeout_s: float
    token_timeout_s: float

    def choose(self, model: str, *, fingerprint: str) -> Worker:
        """A worker for leases pinned to it (a replay and its load), see Router.choose."""
        return self.router.choose(model, fingerprint=fingerprint)

    def lease(self, model: str, *, deadline: float, weight: int = 1, tokens: int = 1,
              request_id: str | None = None, pinned: Worker | None = None,
              fingerprint: str | None = None, builtin: bool = False) -> Lease:
        """A lease for one request on `model`, to be used as `async with`. `weight`: the
        sequences it runs (n); `tokens`: those it asks for in all (max_tokens x n), which
        set a whole answer's timeout; `request_id` goes to the worker as X-Request-Id.
        `pinned`: that worker only, no retry; `fingerprint` and `builtin` narrow the choice
        (a retry included), see Router.candidates."""
        budget = self.first_byte_timeout_s + self.token_timeout_s * tokens
        return Lease(self, model, deadline, weight=weight, budget_s=budget,
                     headers={REQUEST_ID_HEADER: request_id} if request_id else None,
                     pinned=pinned, fingerprint=fingerprint, builtin=builtin)


class Lease:
    """One request's hold on a worker, from the choice to the release.

    `send` gets a whole answer: the worker's slot is held only while it answers.
    `open_stream` opens a stream (a failed one leaves nothing held) while the client can
    still be given an error status; the stream then holds its slot until the
    `async with lease` of the task that relays it with `events()` ends. `worker` is the
    worker that answered; `current` the one an attempt waits on now (None between
    attempts); `forwarded` whether any attempt reached a worker; `upstream_s` the time
    spent waiting on workers."""

    def __init__(self, forwarder: Forwarder, model: str, deadline: float, *, weight: int,
                 budget_s: float, headers: dict[str, str] | None, pinned: Worker | None,
                 fingerprint: str | None, builtin: bool) -> None:
        self._fw = forwarder
        self._model = model
        self._deadline = deadline
        self._weight = weight
        self._budget_s = budget_s
        self._headers = headers
        self._pinned = pinned
        self._fingerprint = fingerprint
        self._builtin = builtin
        self._last: GatewayError | None = None  # the last failed attempt's error
        self._unsent = False  # the last failed attempt never reached its worker
        self._stream: EventStream | None = None
        self._opened_at = 0.0
        self._reader: asyncio.Task | None = None
        self.worker: Worker | None = None
        self.current: Worker | None = None
        self.forwarded = False
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
        self._fw.router.release(self.worker, self._weight)
        self.upstream_s = time.perf_counter() - self._opened_at
        self._fw.metrics.observe_upstream(self.worker.name, self.upstream_s)

    def out_of_time(self) -> bool:
        """The request's total time is over."""
        return time.monotonic() > self._deadline

    def learn(self, fingerprint: str | None) -> str | None:
        """Note the fingerprint the worker's answer carried (a worker's own fingerprint wins
        over a derived one); returns the one to report: that, or the worker's known one."""
        self._fw.router.learn(self.worker, fingerprint)
        return fingerprint or self.worker.fingerprint

    # -- a whole answer -----------------------------------------------------------------------

    async def send(self, path: str, body: bytes) -> Answer:
        """The worker's 2xx answer; its 4xx raises UpstreamRejected; no usable answer from
        any attempt raises UpstreamFailed or UpstreamTimeout."""
        tried: Worker | None = None
        for _ in range(self._max_attempts()):
            worker = tried = await self._take(None if self._unsent else tried)
            try:
                answer = await self._attempt(worker, self._post(worker, path, body))
            finally:
                self._fw.router.release(worker, self._weight)
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

    async def _post(self, worker: Worker, path: str, body: bytes) -> Answer:
        budget = self._budget(self._budget_s)
        t0 = time.perf_counter()
        try:
            with self._waiting_on(worker):
                return await self._fw.upstream.post(worker.url + path, body, budget,
                                                    self._headers)
        finally:
            dt = time.perf_counter() - t0
            self.upstream_s += dt
            self._fw.metrics.observe_upstream(worker.name, dt)

    # -- a stream -----------------------------------------------------------------------------

    async def open_stream(self, path: str, body: bytes) -> None:
        """Open a stream whose first event has arrived (nothing has reached the client yet);
        it holds its slot until the lease ends. Failures as for `send`."""
        tried: Worker | None = None
        for _ in range(self._max_attempts()):
            worker = tried = await self._take(None if self._unsent else tried)
            t0 = time.perf_counter()
            held = False
            try:
                opened = await self._attempt(worker, self._open(worker, path, body, t0))
                if opened is None:
                    continue
                stream, raw = opened
                if raw is None:
                    self.worker, self._stream, self._opened_at = worker, stream, t0
                    held = True
                    return
            finally:
                if not held:
                    self._fw.router.release(worker, self._weight)
            if stream.status >= 500:
                self._failed(worker, Unreachable(f"answered {stream.status}"))
                continue
            raise worker_error(stream.status, raw)
        raise self._last

    async def _open(self, worker: Worker, path: str, body: bytes,
                    t0: float) -> tuple[EventStream, bytes | None]:
        """A 200 stream primed (raw None); or a refusal's body, its connection closed. On any
        exception nothing is left open."""
        budget = self._budget(self._fw.first_byte_timeout_s)
        stream: EventStream | None = None
        try:
            with self._waiting_on(worker):
                stream = await self._fw.upstream.open_stream(
                    worker.url + path, body, first_byte_timeout_s=budget,
                    headers=self._headers)
                if stream.status == 200:
                    await stream.prime(max(budget - (time.perf_counter() - t0), 0.001))
                    return stream, None
                return stream, await stream.body()
        except BaseException:
            if stream is not None:
                stream.close()
            raise

    async def events(self) -> AsyncIterator[dict]:
        """The open stream's chunks, up to `[DONE]` (which sets `complete`) or its end. A
        stream that breaks, stalls or sends an event that is not JSON has its worker's
        health checked now, and the error is raised."""
        assert self._stream is not None
        try:
            async for data in self._stream.events():
                if data == b"[DONE]":
                    self.complete = True
                    return
                yield orjson.loads(data)
        except (Unreachable, TimedOut, orjson.JSONDecodeError):
            self._fw.router.suspect(self.worker)
            raise

    # -- attempts -----------------------------------------------------------------------------

    def _max_attempts(self) -> int:
        return 1 if self._pinned else MAX_ATTEMPTS

    async def _take(self, tried: Worker | None) -> Worker:
        """A slot on the pinned worker, or on a first choice and then on one other. With
        no other left, the last attempt's error is raised."""
        try:
            return await self._fw.router.take(
                self._model, self._weight, deadline=self._deadline, pinned=self._pinned,
                exclude=tried, fingerprint=self._fingerprint, builtin=self._builtin)
        except (NoWorker, Conflict, NotFound):
            if self._last is not None:
                raise self._last from None
            raise

    async def _attempt(self, worker: Worker, attempt: Awaitable[T]) -> T | None:
        """What the attempt returned, or None when it failed in a way another attempt may
        mend: the worker unreachable or timed out, or ejected meanwhile."""
        self.current = worker
        self.forwarded = True
        self._unsent = False
        try:
            return await attempt
        except (Unreachable, TimedOut) as exc:
            self._unsent = isinstance(exc, NotConnected)
            self._failed(worker, exc)
        except asyncio.CancelledError:
            if not self._fw.interrupts.take(EJECTED):
                raise
            self._last = UpstreamFailed("the worker stopped answering")
        finally:
            self.current = None
        return None

    def _budget(self, limit: float) -> float:
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            raise UpstreamTimeout("the request ran out of its total time")
        return min(limit, remaining)

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
        """A refused connection ejects the worker; anything else has its health checked (the
        log says why). The tenant is told no address and no detail."""
        if isinstance(exc, Refused):
            self._fw.router.eject(worker, str(exc))
        else:
            self._fw.router.suspect(worker)
        if isinstance(exc, TimedOut):
            self._last = UpstreamTimeout("the worker did not answer in time")
        else:
            self._last = UpstreamFailed("the worker failed to answer")
