"""HTTP to workers, behind a small API so the client library can change with measurements.

aiohttp: measured on this project's 2-core machines, a FastAPI passthrough over aiohttp's
connection pool carried about 6x the requests/s of one over httpx's pool at 16 connections
(970-1,130 vs 185-190 req/s), and the same passthrough is the baseline of `detgate bench
gateway`.

Connections: idle pooled connections are dropped after `keepalive_s`, which must stay below
the workers' own idle timeout (the built-in worker's `--keepalive-timeout-s`, vLLM's 5 s), so
that the gateway never writes into a connection the worker is closing. Should it happen
anyway (a worker configured shorter), a request whose connection drops before the worker
answered a byte is sent once more on a fresh connection: a worker that closes an idle
connection has not read the request on it, so this is neither a retry of work nor a failure
of the worker (counted in `reconnects`).

Failures are reported as exceptions that say how much they prove about the worker:
`Refused` (the worker's host refused the connection: nothing listens there), `Unreachable`
(the connection broke or the answer was cut: the worker may be dead or not, its health check
decides), its kind `NotConnected` (no connection was made within the connect timeout: the
request was never sent) and `TimedOut`. All of them
mean nothing reached the client. A connect timeout is not a refusal: under a burst (512
clients at once, a starved event loop on a loaded host) a healthy worker's connection can take
longer than the timeout, and ejecting it then would fail every request it holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

import aiohttp


class Unreachable(Exception):
    """No usable answer: the connection broke, or the answer was cut."""


class Refused(Unreachable):
    """The connection was refused (or failed at once: no route, no such host)."""


class NotConnected(Unreachable):
    """No connection was made within the connect timeout: the request was never sent, so
    sending it again (to the same worker too) repeats no work."""


class TimedOut(Exception):
    pass


@dataclass
class Answer:
    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)  # case-insensitive when filled


class EventStream:
    """An open SSE answer: `status`, then `events()` yields each `data:` payload. `prime`
    waits for the first one: until then nothing has reached the client, so a retry is safe.
    After the first event, a gap longer than the session's read timeout (the progress
    timeout) raises TimedOut: aiohttp re-arms one timer per read, no task per event."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.status = response.status
        self._first: bytes | None = None
        self._primed = False

    async def body(self) -> bytes:
        try:
            return await self.response.read()
        except (aiohttp.ClientError, OSError) as exc:
            raise Unreachable(f"worker answer broke: {exc}") from exc
        finally:
            self.close()

    async def _next(self) -> bytes | None:
        """The next `data:` payload; None at the end of the stream."""
        content = self.response.content
        while True:
            try:
                line = await content.readline()
            except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
                raise TimedOut(f"worker stream stalled: {exc}") from exc
            except (aiohttp.ClientError, OSError) as exc:
                raise Unreachable(f"worker stream broke: {exc}") from exc
            if not line:
                return None
            if line.startswith(b"data:"):
                return line[5:].strip()

    async def prime(self, timeout_s: float) -> None:
        try:
            self._first = await asyncio.wait_for(self._next(), timeout_s)
        except TimeoutError as exc:
            raise TimedOut(f"no first event within {timeout_s:g}s") from exc
        self._primed = True

    async def events(self) -> AsyncIterator[bytes]:
        if self._primed:
            self._primed = False
            if self._first is None:
                return
            yield self._first
        while (data := await self._next()) is not None:
            yield data

    def close(self) -> None:
        """Keep the connection for reuse only if the answer was read to its end."""
        if self.response.content.at_eof():
            self.response.release()
        else:
            self.response.close()


class _Dropped(Exception):
    """The connection broke before the worker answered anything."""


def _failure(url: str, exc: BaseException) -> Exception:
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return NotConnected(f"{url}: connect timeout ({exc})")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return Refused(f"{url}: {exc}")
    if isinstance(exc, TimeoutError):
        return TimedOut(f"no answer from {url}: {exc}")
    return Unreachable(f"{url}: {exc}")


class Upstream:
    """`on_reconnect(url)` is told of every request sent again on a fresh connection."""

    def __init__(self, *, connect_timeout_s: float, keepalive_s: float,
                 progress_timeout_s: float,
                 on_reconnect: Callable[[str], None] = lambda url: None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.on_reconnect = on_reconnect
        self.session = self._session(aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive_s))
        # Only for the one resend after a dropped connection: never a pooled connection.
        self.fresh = self._session(aiohttp.TCPConnector(limit=0, force_close=True))
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=progress_timeout_s)

    @staticmethod
    def _session(connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=connector,
                                     headers={"Content-Type": "application/json"},
                                     skip_auto_headers=("User-Agent",))

    def _timeout(self, total_s: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total_s, sock_connect=self.connect_timeout_s)

    async def _twice(self, url: str, send: Callable[[aiohttp.ClientSession], object]):
        """`send(session)` on a pooled connection, and once more on a fresh one if that
        connection dropped before any answer; failures as the exceptions above."""
        try:
            try:
                return await send(self.session)
            except _Dropped:
                self.on_reconnect(url)
            try:
                return await send(self.fresh)
            except _Dropped as exc:
                raise Unreachable(f"{url}: {exc.__cause__}") from exc.__cause__
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _failure(url, exc) from exc

    @staticmethod
    async def _started(request) -> aiohttp.ClientResponse:
        """The response once its status line is in; _Dropped if the connection broke first."""
        try:
            return await request
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError):
            raise
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise _Dropped() from exc

    async def post(self, url: str, body: bytes, timeout_s: float,
                   headers: dict[str, str] | None = None) -> Answer:
        timeout = self._timeout(timeout_s)

        async def send(session: aiohttp.ClientSession) -> Answer:
            r = await self._started(session.post(url, data=body, timeout=timeout,
                                                 headers=headers))
            async with r:
                return Answer(r.status, await r.read())

        return await self._twice(url, send)

    async def get(self, url: str, timeout_s: float) -> Answer:
        """A probe (health, models, version): the whole `timeout_s` may go to connecting.
        A probe that fails ejects its worker, so a connect that is merely late (a starved
        host's accept queue under a burst) must not fail it at the connect timeout."""
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=timeout_s)

        async def send(session: aiohttp.ClientSession) -> Answer:
            r = await self._started(session.get(url, timeout=timeout))
            async with r:
                return Answer(r.status, await r.read(), r.headers)

        return await self._twice(url, send)

    async def open_stream(self, url: str, body: bytes, *, first_byte_timeout_s: float,
                          headers: dict[str, str] | None = None) -> EventStream:
        """POST and wait for the status line; the body is read through `events()`."""

        async def send(session: aiohttp.ClientSession) -> EventStream:
            return EventStream(await self._started(session.post(
                url, data=body, timeout=self._stream_timeout, headers=headers)))

        try:
            return await asyncio.wait_for(self._twice(url, send), first_byte_timeout_s)
        except TimeoutError as exc:
            raise TimedOut(f"no answer from {url} within {first_byte_timeout_s:g}s") from exc

    async def close(self) -> None:
        await self.session.close()
        await self.fresh.close()
