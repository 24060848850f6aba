"""A client that leaves before its answer starts: noticed while its request waits (in the
queue, on a worker), so that the work stops instead of running for nobody.

Starlette tells a handler nothing when its client disconnects before the response starts
(a StreamingResponse listens only once it runs), so `ClientWatch` listens meanwhile. On the
disconnect of a non-streamed request that a built-in worker is generating, it asks that
worker to stop it and answer with what it has (`POST /abort_request`), so that the record
keeps the tokens so far, as a stream's does. Otherwise (waiting in the queue, a stream, a
vLLM worker, or no answer within `abort_grace_s`) it interrupts the handler (CLIENT_GONE),
which closes the connection to the worker, and a worker stops what its client left.

The watch covers only the waiting: once the answer is in, nothing interrupts the handler
while it records. It starts listening only after `WATCH_AFTER_S`: most answers come sooner,
and a timer costs the hot path less than a task per request (a client that leaves is then
noticed within that much of its leaving, or of its request's start).
"""

from __future__ import annotations

import asyncio

import orjson
from starlette.requests import Request

from detgate.gateway.forward import Lease
from detgate.gateway.interrupts import CLIENT_GONE
from detgate.gateway.services import Services
from detgate.gateway.upstream import TimedOut, Unreachable

ABORT_PATH = "/abort_request"
WATCH_AFTER_S = 0.5


class ClientWatch:
    """`with ClientWatch(...) as watch:` around the wait; `gone` says whether the client
    left. `abort`: ask a built-in worker for the partial answer first."""

    def __init__(self, svc: Services, request: Request, lease: Lease, record_id: str, *,
                 abort: bool) -> None:
        self._svc = svc
        self._receive = request.receive
        self._lease = lease
        self._record_id = record_id
        self._abort = abort
        self._handler: asyncio.Task | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None
        self.gone = False

    def __enter__(self) -> ClientWatch:
        self._handler = asyncio.current_task()
        self._timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, self._start)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._timer.cancel()
        if self._task is not None:
            self._task.cancel()

    def _start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        worker = self._lease.current
        grace = self._svc.settings.abort_grace_s
        if self._abort and worker is not None and worker.own_fingerprint and grace > 0:
            try:
                answer = await self._svc.upstream.post(
                    worker.url + ABORT_PATH, orjson.dumps({"rid": self._record_id}), grace)
                if answer.status == 200:
                    await asyncio.sleep(grace)  # the handler ends this watch when answered
            except (Unreachable, TimedOut):
                pass
        self._svc.interrupts.interrupt(self._handler, CLIENT_GONE)
