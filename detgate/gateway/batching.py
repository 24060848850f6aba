"""Record writes batched per event-loop turn: one Redis round trip for the records that
finish together, on a connection of their own.

Under load several requests finish their answers in the same turn of the event loop. Each
used to send its record's script on a pooled connection: a pool checkout (a lock, a health
poll, redis-py's bookkeeping), a write, a read and a wake-up per record, for the gateway and
for Redis. `WriteBatch.run` queues the script instead. One task sends what is queued as one
round trip (the scripts, then one WAIT when replicas are waited for) on a dedicated
connection, reads the replies in order, and goes on while writes queued meanwhile: the
writes of one turn always travel together, and under load the next batch forms while one is
on the wire (group commit). At one request at a time it is one round trip, as before.

Why every guarantee still holds:
- Durable before the 2xx: `run` returns only the reply to the caller's own script, read
  from Redis in the order sent, and (with WAIT) only once the replicas acknowledged every
  write before it on that connection, its own included; fewer acknowledgements raise
  NotReplicated for each write of the batch, as `Store.run_durably` does for one. A caller
  never answers on another write's reply.
- Failures: a script error is raised to its own caller only; a failed round trip (Redis
  down, the time limit passed, the connection lost) is raised to every caller of the batch,
  each of which then marks Redis down and keeps its record in the spool
  (gateway/recorder.py), as before. A connection that failed is closed, never read again
  (no reply can reach the wrong write); like the pool, a round trip whose connection was
  lost is sent once more on a new one. The scripts are idempotent (gateway/accounting.py),
  so a batch sent twice, or a record later drained from the spool, is counted once.
- Order: writes are sent in the order they were queued; a record's spool-or-Redis choice
  is made before it is queued, as before.
- NOSCRIPT (a failover, a flushed script cache): the scripts are loaded and the writes that
  met them are sent again, in one more round trip.
- A caller cancelled while it waits does not cancel the batch: its write still lands, as a
  single write already sent did; nobody is told of it, exactly as before.
- Sentinel: the connection is the pool's kind, so it finds the master as pooled ones do,
  and a demoted master's refusal fails the round trip, which is sent again on a new one.

A Redis Cluster is not batched (writes of different tenants go to different nodes, and a
WAIT counts one connection's writes): the recorder sends those one by one.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from detgate.gateway.store import ClientFailure, NotReplicated, Store


class _Write:
    __slots__ = ("script", "keys", "args", "done")

    def __init__(self, script, keys: Sequence, args: Sequence,
                 done: asyncio.Future) -> None:
        self.script = script
        self.keys = keys
        self.args = args
        self.done = done


class WriteBatch:
    """Durable script runs of one Redis (standalone or behind Sentinel), batched per turn.
    `timeout_s`: Redis' time to answer (the pool's read timeout); a round trip may take that
    plus the WAIT's own timeout."""

    def __init__(self, store: Store, timeout_s: float) -> None:
        self._store = store
        wait_s = store.wait_timeout_ms / 1000 if store.wait_replicas > 0 else 0.0
        self._timeout_s = timeout_s + wait_s
        self._conn: AbstractConnection | None = None
        self._queued: list[_Write] = []
        self._sender: asyncio.Task | None = None

    async def run(self, script, keys: Sequence, args: Sequence) -> object:
        """The script's reply once it is durable (NotReplicated, RedisError or OSError as
        `Store.run_durably` raises them)."""
        loop = asyncio.get_running_loop()
        write = _Write(script, keys, args, loop.create_future())
        self._queued.append(write)
        if self._sender is None:
            # Its first step runs after the callbacks already due in this turn, so the
            # writes those queue travel with this one.
            self._sender = loop.create_task(self._send_queued())
        return await write.done

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()
        if self._conn is not None:
            await self._conn.disconnect()

    async def _send_queued(self) -> None:
        try:
            while self._queued:
                batch, self._queued = self._queued, []
                await self._send(batch)
        finally:
            self._sender = None
            batch, self._queued = self._queued, []  # only if this task was cancelled
            _fail(batch, RedisConnectionError("the record write was interrupted"))

    async def _send(self, batch: list[_Write]) -> None:
        try:
            replies, acked = await self._round_trip(batch)
            missing = [w for w, r in zip(batch, replies, strict=True)
                       if isinstance(r, NoScriptError)]
            if missing:
                for lua in {w.script.script for w in missing}:
                    await self._store.client.script_load(lua)
                again, acked = await self._round_trip(missing)
                redo = dict(zip(map(id, missing), again, strict=True))
                replies = [redo.get(id(w), r) for w, r in zip(batch, replies, strict=True)]
        except BaseException as exc:
            _fail(batch, exc if isinstance(exc, Exception) else RedisConnectionError(
                "the record write was interrupted"))
            if not isinstance(exc, Exception):
                raise
            return
        self._settle(batch, replies, acked)

    def _settle(self, batch: list[_Write], replies: list, acked: int) -> None:
        wanted = self._store.wait_replicas
        for write, reply in zip(batch, replies, strict=True):
            if write.done.done():
                continue  # its caller was cancelled
            if isinstance(reply, Exception):
                write.done.set_exception(reply)
            elif wanted > 0 and acked < wanted:
                write.done.set_exception(NotReplicated(
                    f"{acked} of {wanted} replica(s) acknowledged within "
                    f"{self._store.wait_timeout_ms} ms", reply))
            else:
                write.done.set_result(reply)

    async def _round_trip(self, batch: list[_Write]) -> tuple[list, int]:
        """The scripts, then WAIT when replicas are waited for: the replies in order (a
        script's error in its place) and the replicas that acknowledged. Sent once more on
        a new connection if the connection was lost; a failure closes the connection."""
        store = self._store
        commands = [("EVALSHA", w.script.sha, len(w.keys), *w.keys, *w.args) for w in batch]
        if store.wait_replicas > 0:
            commands.append(("WAIT", store.wait_replicas, store.wait_timeout_ms))
        for attempt in (1, 2):
            conn = self._connection()
            try:
                async with asyncio.timeout(self._timeout_s):
                    replies = await _exchange(conn, commands)
                break
            except (RedisConnectionError, RuntimeError) as exc:
                # uvloop raises RuntimeError where asyncio raises OSError: a peer that has
                # gone (gateway/store.py ClientFailure). Either way the connection is lost.
                await conn.disconnect()
                if attempt == 2:
                    if isinstance(exc, RuntimeError):
                        raise ClientFailure(f"RuntimeError: {exc}") from exc
                    raise
            except TimeoutError:
                await conn.disconnect()
                raise RedisTimeoutError("Redis did not answer the record writes in "
                                        f"{self._timeout_s:g}s") from None
            except BaseException:
                await conn.disconnect()
                raise
        if store.wait_replicas <= 0:
            return replies, 0
        acked = replies.pop()
        if isinstance(acked, Exception):
            raise acked
        return replies, int(acked)

    def _connection(self) -> AbstractConnection:
        """The dedicated connection, made like the pool's own (address, TLS, credentials,
        database, Sentinel's master), whose round trips this class times as a whole."""
        if self._conn is None:
            pool = self._store.client.connection_pool
            self._conn = pool.connection_class(**{**pool.connection_kwargs,
                                                  "socket_timeout": None})
        return self._conn


async def _exchange(conn: AbstractConnection, commands: list[tuple]) -> list:
    """Send the commands in one write and read one reply each (errors in place)."""
    if not conn.is_connected:
        # The connection's own connect (Sentinel's asks for the master's address): sending
        # on an unconnected one would connect to its default address instead.
        await conn.connect()
    await conn.send_packed_command([b"".join(map(_pack, commands))], check_health=False)
    replies: list = []
    for _ in commands:
        try:
            replies.append(await conn.read_response(timeout=math.inf))
        except ResponseError as exc:  # a script's own error: the next reply follows
            replies.append(exc)
    return replies


def _pack(command: tuple) -> bytes:
    """One command in RESP, as redis-py's encoder writes it (str as UTF-8, numbers by repr)
    for the types record writes use, at a fraction of its per-argument cost."""
    parts = [b"*%d\r\n" % len(command)]
    for arg in command:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int | float) and not isinstance(arg, bool):
            data = repr(arg).encode()
        else:
            raise TypeError(f"a record write argument of type {type(arg).__name__}")
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _fail(batch: list[_Write], exc: Exception) -> None:
    for write in batch:
        if not write.done.done():
            write.done.set_exception(exc)
