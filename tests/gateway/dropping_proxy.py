"""A TCP proxy that plays a worker closing an idle keep-alive connection at the very moment
the gateway reuses it (the race behind ejections of live workers).

A real worker produces that race only now and then (the close must cross the next request
on the wire), so this proxy makes it happen every time, in front of a real worker: the
first request on a connection is relayed both ways; a request arriving on a connection that
has already carried an answer is not relayed, and the connection is reset, as a worker's
kernel resets a connection its server has just closed.
"""

from __future__ import annotations

import asyncio
import socket
import struct

from tests.support.loop_server import LoopServer


class ReuseDroppingProxy(LoopServer):
    def __init__(self, target_url: str) -> None:
        super().__init__()
        host, port = target_url.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.url = f"http://127.0.0.1:{self.port}"
        self.dropped = 0  # requests reset on a reused connection

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        answered = False

        async def answers() -> None:
            nonlocal answered
            while data := await up_reader.read(65536):
                answered = True
                writer.write(data)
                await writer.drain()
            writer.close()

        relay = asyncio.create_task(answers())
        try:
            while data := await reader.read(65536):
                if answered:  # a next request on a kept-alive connection: reset it
                    self.dropped += 1
                    writer.get_extra_info("socket").setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    break
                up_writer.write(data)
                await up_writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            relay.cancel()
            up_writer.close()
            writer.close()
