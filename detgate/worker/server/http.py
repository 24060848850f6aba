"""What every endpoint answers with: JSON bodies that keep float32 logprobs exact, and work that
stops when the client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import orjson
from fastapi import Request
from fastapi.responses import Response


def json_response(body, status: int = 200) -> Response:
    """orjson writes a float as the shortest text that reads back as the same double, so the
    float32 logprobs round-trip exactly."""
    if hasattr(body, "model_dump"):
        body = body.model_dump(exclude_none=True)
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


async def unless_disconnected(request: Request, work: Awaitable,
                              stop: asyncio.Event | None = None):
    """Await `work`, cancelling it (which aborts its sequences) if the client disconnects
    (ClientDisconnected) or `stop` is set (Stopped): whatever it built so far stays with
    its caller."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watchers = {asyncio.ensure_future(disconnected())}
    if stop is not None:
        watchers.add(asyncio.ensure_future(stop.wait()))
    try:
        await asyncio.wait({task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for watcher in watchers:
            watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise Stopped() if stop is not None and stop.is_set() else ClientDisconnected()
    return task.result()


class Stopped(Exception):
    """The work was stopped on request (/abort_request); its client still waits."""


class ClientDisconnected(Exception):
    """Nobody is left to answer; the status is only for the access log."""
