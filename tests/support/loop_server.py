"""A TCP server on an asyncio loop of its own thread, for the test proxies that sit between
the gateway and a worker or a Redis: `start()` returns once it listens on `port`, `stop()`
closes it, resets the connections it holds (`_writers`) and ends every task of its loop.
A subclass writes `_serve(reader, writer)`."""

from __future__ import annotations

import asyncio
import threading

from tests.support.procs import free_port


class LoopServer:
    def __init__(self) -> None:
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    def start(self):
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        async def close() -> None:
            self._server.close()
            for writer in self._writers:
                writer.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError
