"""HTTP to workers, behind a small API so the client library can change with measurements.

aiohttp: measured on this project's 2-core machines, a FastAPI passthrough over aiohttp's
connection pool carried about 6x the requests/s of one over httpx's pool at 16 connections
(970-1,130 vs 185-190 req/s), and the same passthrough is the baseline of `detgate bench
gateway`. Failures are reported as two exceptions:
`Unreachable` (nothing was answered: connection refused or reset, safe to retry elsewhere)
and `TimedOut`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp


class Unreachable(Exception):
    pass


class TimedOut(Exception):
    pass


@dataclass
class Answer:
    status: int
    body: bytes


class EventStream:
    """An open SSE answer: `status`, then `events()` yields each `data:` payload. `prime`
    waits for the first one: until then nothing has reached the client, so a retry is safe."""

    def __init__(self, response: aiohttp.ClientResponse, read_timeout_s: float) -> None:
        self.response = response
        self.status = response.status
        self.read_timeout_s = read_timeout_s
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
            except (aiohttp.ClientError, OSError) as exc:
                raise Unreachable(f"worker stream broke: {exc}") from exc
            if not line:
                return None
            if line.startswith(b"data:"):
                return line[5:].strip()

    async def _next_within(self, timeout_s: float, what: str) -> bytes | None:
        try:
            return await asyncio.wait_for(self._next(), timeout_s)
        except TimeoutError as exc:
            raise TimedOut(what) from exc

    async def prime(self, timeout_s: float) -> None:
        self._first = await self._next_within(timeout_s, f"no first event within {timeout_s:g}s")
        self._primed = True

    async def events(self) -> AsyncIterator[bytes]:
        if self._primed:
            self._primed = False
            if self._first is None:
                return
            yield self._first
        while (data := await self._next_within(self.read_timeout_s, "worker stream stalled")) \
                is not None:
            yield data

    def close(self) -> None:
        """Keep the connection for reuse only if the answer was read to its end."""
        if self.response.content.at_eof():
            self.response.release()
        else:
            self.response.close()


class Upstream:
    def __init__(self, *, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
            headers={"Content-Type": "application/json"},
            skip_auto_headers=("User-Agent",),
        )

    def _timeout(self, total_s: float) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total_s, sock_connect=self.connect_timeout_s)

    async def post(self, url: str, body: bytes, timeout_s: float) -> Answer:
        try:
            async with self.session.post(url, data=body, timeout=self._timeout(timeout_s)) as r:
                return Answer(r.status, await r.read())
        except TimeoutError as exc:
            raise TimedOut(f"no answer from {url} within {timeout_s:g}s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise Unreachable(f"{url}: {exc}") from exc

    async def get(self, url: str, timeout_s: float) -> Answer:
        try:
            async with self.session.get(url, timeout=self._timeout(timeout_s)) as r:
                return Answer(r.status, await r.read())
        except TimeoutError as exc:
            raise TimedOut(f"no answer from {url} within {timeout_s:g}s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise Unreachable(f"{url}: {exc}") from exc

    async def open_stream(self, url: str, body: bytes, *, first_byte_timeout_s: float,
                          read_timeout_s: float) -> EventStream:
        """POST and wait for the status line; the body is read through `events()`."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        try:
            response = await asyncio.wait_for(
                self.session.post(url, data=body, timeout=timeout), first_byte_timeout_s)
        except TimeoutError as exc:
            raise TimedOut(f"no answer from {url} within {first_byte_timeout_s:g}s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise Unreachable(f"{url}: {exc}") from exc
        return EventStream(response, read_timeout_s)

    async def close(self) -> None:
        await self.session.close()
