"""The gateway's ASGI front: the two hot POSTs served directly, everything else by the app.

`POST /v1/chat/completions` and `POST /v1/completions` are every tenant's traffic. The front
hands them to `routes.inference.handle` itself instead of through FastAPI's middleware stack,
router and exception middlewares, whose per-request cost was a large share of the gateway's
own (bench/results/gateway-profile-*.md). Every other request (records, replays, metrics,
health, the web page, the lifespan) goes to the FastAPI app unchanged.

What the stack did for these two routes, the front does the same way, so nothing a client or
an operator sees changes:
- open mode's guard (gateway/guard.py `refusal`) before anything is read;
- errors: a GatewayError is answered in the OpenAI error shape with its status and headers;
  anything unexpected is logged and answered as the stack's last resort did (500, the error
  shape, no stack trace);
- observation: `detgate_requests_total` and `detgate_request_duration_seconds` per endpoint
  and status, the overhead histogram from the handler's upstream time, and `x-request-id`
  on every answer (the record id when there is one), as ObserveRequests does for the rest.
The handler itself is the routes' own, so validation, limits, the lease and the rule "a 2xx
only once the record is durable" are the same code on both ways in.
"""

from __future__ import annotations

import logging
import re
import secrets
import time

from fastapi import FastAPI
from starlette.requests import Request

from detgate.gateway import guard, protocol
from detgate.gateway.errors import GatewayError, error_response
from detgate.gateway.metrics import Metrics
from detgate.gateway.routes import inference

log = logging.getLogger("detgate.gateway")

REQUEST_ID = b"x-request-id"
_RECORD_ID = b"x-detgate-record-id"
_CLIENT_ID = re.compile(rb"[A-Za-z0-9._:-]{1,128}")
HOT_PATHS = frozenset((protocol.CHAT, protocol.COMPLETIONS))


def request_id(scope, response_headers: list) -> bytes:
    """The answer's `x-request-id`: its record's id; without a record, the client's own id
    (when it is a short token) or a new one."""
    for name, value in response_headers:
        if name.lower() == _RECORD_ID:
            return value
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID and _CLIENT_ID.fullmatch(value):
            return value
    return ("req-" + secrets.token_hex(12)).encode()


async def observed(metrics: Metrics, scope, endpoint: str, send, serve) -> None:
    """`await serve(send_marked)` with what every answer gets, through the front or the app
    (ObserveRequests): its `x-request-id`, and its count and duration per endpoint and
    status, the overhead taken from the upstream time a handler leaves in the scope's state."""
    t0 = time.perf_counter()
    status = 500
    state = scope.setdefault("state", {})

    async def send_marked(message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = message.get("headers", [])
            message = {**message, "headers": [*headers, (REQUEST_ID,
                                                         request_id(scope, headers))]}
        await send(message)

    try:
        await serve(send_marked)
    finally:
        metrics.observe_request(endpoint, status, time.perf_counter() - t0,
                                state.get("upstream_s"))


class Front:
    """The ASGI application uvicorn serves; `state` is the app's (the drain, the services)."""

    def __init__(self, app: FastAPI, metrics: Metrics, *, open_mode: bool) -> None:
        self.app = app
        self.state = app.state
        self._metrics = metrics
        self._open_mode = open_mode

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" \
                and scope["path"] in HOT_PATHS:
            await self._serve(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _serve(self, scope, receive, send) -> None:
        scope["app"] = self.app  # what Starlette's Request.app reads, as under the app

        async def respond(send_marked) -> None:
            response = await self._answer(scope, receive)
            await response(scope, receive, send_marked)

        await observed(self._metrics, scope, scope["path"], send, respond)

    async def _answer(self, scope, receive):
        """The handler's response, or the error shape of what it raised."""
        try:
            if self._open_mode:
                refused = guard.refusal(scope)
                if refused is not None:
                    raise refused
            return await inference.handle(self.state.services, Request(scope, receive),
                                          scope["path"])
        except GatewayError as exc:
            return error_response(exc)
        except Exception:
            log.exception("unhandled error on %s", scope["path"])
            return error_response(GatewayError("internal error"))
