"""A TCP proxy in front of a Redis master that can hold back its replication stream: it plays
replicas that have fallen behind (a slow network, busy replicas). Every client of the master
(the gateway, sentinels, replicas) connects through it; while it holds, what the master sends
on a replication link (a connection whose client sent REPLCONF, PSYNC or SYNC) is dropped,
everything else flows. The master then acknowledges writes that its replicas never receive;
when it is killed, a promoted replica lacks exactly those writes.

Without the proxy the window is too small to test: on one machine a master sends each write
to its replicas in the same event-loop turn as it answers the client.
"""

from __future__ import annotations

import asyncio

from tests.support.loop_server import LoopServer


class HoldingProxy(LoopServer):
    def __init__(self, target_port: int) -> None:
        super().__init__()
        self.target_port = target_port
        self.held_bytes = 0
        self._holding = False

    def hold(self) -> None:
        """From now on, nothing the master sends on a replication link reaches the replica."""
        self._holding = True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers += [writer, up_writer]

        replication = False

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       downstream: bool) -> None:
            nonlocal replication
            while data := await src.read(65536):
                # The command's name opens its RESP array: `*3\r\n$8\r\nREPLCONF...`.
                if not downstream and any(c in data[:24] for c in (b"REPLCONF", b"SYNC")):
                    replication = True
                if downstream and replication and self._holding:
                    self.held_bytes += len(data)  # dropped with the connection
                    continue
                dst.write(data)
                await dst.drain()

        pumps = [asyncio.create_task(pump(reader, up_writer, False)),
                 asyncio.create_task(pump(up_reader, writer, True))]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Either side gone (a killed master): the other is reset, not closed cleanly,
            # and whatever was held is gone with it.
            writer.transport.abort()
            up_writer.transport.abort()
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
