"""POST /abort_request `{"rid": id}` (SGLang's name and shape): stop a non-streamed request
and have it answer now with what it generated so far.

A non-streamed request names itself with its `X-Request-Id` header (the gateway sends its
record id). When its client is gone, the gateway asks for this instead of closing the
connection, so that the tokens already generated reach the record (finish_reason "abort"
for the choices that were still running). A stream needs none of this: its client sees
every token as it comes, and closing its connection aborts it. 404 when no running
request has that id.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel

from detgate.worker.errors import NotFoundError
from detgate.worker.server.http import json_response

router = APIRouter()

REQUEST_ID_HEADER = "x-request-id"


class Aborts:
    """The running non-streamed requests that can be stopped, by id."""

    def __init__(self) -> None:
        self._stops: dict[str, asyncio.Event] = {}

    def register(self, request_id: str) -> asyncio.Event:
        stop = self._stops[request_id] = asyncio.Event()
        return stop

    def discard(self, request_id: str) -> None:
        self._stops.pop(request_id, None)

    def abort(self, request_id: str) -> bool:
        stop = self._stops.get(request_id)
        if stop is not None:
            stop.set()
        return stop is not None


class AbortRequest(BaseModel):
    rid: str


@router.post("/abort_request")
async def abort_request(body: AbortRequest, request: Request) -> Response:
    if not request.app.state.ctx.aborts.abort(body.rid):
        raise NotFoundError(f"no running request {body.rid!r}", param="rid")
    return json_response({"aborted": True})
