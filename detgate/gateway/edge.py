"""The HTTP edge: uvicorn's httptools protocol with the limits a public port needs.

- A connection must complete its request line and headers within `header_timeout_s` of
  opening (or of the first byte of a later request): silent sockets and headers sent a byte
  at a time are closed (408) instead of holding a file descriptor for ever.
- Request line plus headers are at most `max_header_bytes` (431), counted as they arrive.
- At most `max_connections` connections; one more is answered 503 and closed, so silent
  sockets can never use up the descriptors every new client needs.
- Idle keep-alive connections close after `keepalive_timeout_s` (uvicorn's own timer).
- Every answer the server itself makes (malformed HTTP, the above, an application that fails
  before answering) is in the OpenAI error shape, never plain text. A websocket upgrade is
  served as the plain request it is (uvicorn runs with `ws="none"`): a 404 in that shape.

The body timeout is the application's (gateway/services.py `read_body`).
"""

from __future__ import annotations

import asyncio
import logging
import resource

import uvicorn.protocols.http.httptools_impl as httptools_impl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from detgate.gateway.config import Settings
from detgate.gateway.errors import error_body

log = logging.getLogger("detgate.gateway")

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
            500: b"Internal Server Error", 503: b"Service Unavailable"}


def _raw_error(status: int, message: str, type_: str, code: str) -> bytes:
    body = error_body(message, type_, None, code)
    return b"".join([
        b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status]),
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n\r\n", body])


class JsonErrorCycle(RequestResponseCycle):
    """uvicorn's request cycle, whose last-resort 500 is in the error shape."""

    async def send_500_response(self) -> None:
        body = error_body("internal error", "server_error")
        await self.send({"type": "http.response.start", "status": 500, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


class EdgeProtocol(HttpToolsProtocol):
    header_timeout_s = 10.0
    max_header_bytes = 32 << 10
    max_connections = 1000

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0
        self._awaiting_head = True
        self._refused = False
        self._head_timer: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            self._refuse(503, "too many connections; retry shortly", "service_unavailable",
                         "too_many_connections")
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timeout)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._awaiting_head:
            return
        if self._head_bytes:
            self._refuse(408, f"the request headers did not arrive within "
                         f"{self.header_timeout_s:g}s", "invalid_request_error",
                         "request_timeout")
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str, type_: str, code: str) -> None:
        self._refused = True
        self._disarm_head_timer()
        if not self.transport.is_closing():
            self.transport.write(_raw_error(status, message, type_, code))
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._awaiting_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._awaiting_head and self._head_bytes > self.max_header_bytes \
                and not self._refused:
            self._refuse(431, f"the request line and headers exceed {self.max_header_bytes} "
                         "bytes", "invalid_request_error", "headers_too_large")

    def _unsupported_upgrade_warning(self) -> None:
        """An upgrade request (the gateway serves no websockets) is answered as plain HTTP;
        not a warning per request, which any client could flood the log with."""

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, "malformed HTTP request", "invalid_request_error", "malformed_http")

    def on_message_begin(self) -> None:
        self._awaiting_head = True
        self._arm_head_timer()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        self._awaiting_head = False
        self._head_bytes = 0
        self._disarm_head_timer()
        if size > self.max_header_bytes:
            self._refuse(431, f"the request line and headers exceed {self.max_header_bytes} "
                         "bytes", "invalid_request_error", "headers_too_large")
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()


def protocol(settings: Settings) -> type[EdgeProtocol]:
    """The protocol class for uvicorn's `http=`, with this process' limits."""
    # Every cycle uvicorn's httptools protocol makes answers its last-resort 500 as JSON.
    httptools_impl.RequestResponseCycle = JsonErrorCycle  # type: ignore[misc]
    cap = settings.max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, cap + 256)) if hard != resource.RLIM_INFINITY else cap + 256
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    if cap + 64 > soft:  # leave descriptors for Redis, workers and the spool
        cap = max(soft - 64, 1)
        log.warning("DETGATE_MAX_CONNECTIONS lowered to %d by the open-files limit (%d)",
                    cap, soft)
    return type("GatewayProtocol", (EdgeProtocol,), {
        "header_timeout_s": settings.header_timeout_s,
        "max_header_bytes": settings.max_header_bytes,
        "max_connections": cap,
    })
