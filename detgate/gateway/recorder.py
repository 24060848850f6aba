"""Records in Redis: one serialise/deserialise pair, a TTL on every key, atomic multi-key writes.

Records come and go here in their stored JSON shape (dicts): the routes build them as
`detgate.contract.record.Record` and `Services.save` serialises them, and what is read back
may also be a bounded summary (gateway/summary.py), which no `Record` describes.

Floats are written by orjson, which prints the shortest text that parses back to the same
double, and read back by orjson: a logprob's bits survive the round trip unchanged.

Availability: a failed Redis call marks Redis down (gateway/store.py); while it is down (or
while spooled records wait to be drained) records go to the on-disk spool (gateway/spool.py),
so an outage costs no answers. Only when the spool is full or unwritable too are new
inference requests refused (503 + Retry-After) before any work. A background ping marks Redis
up again and drains the spool into it in order. With replicas to wait for
(DETGATE_REDIS_WAIT_REPLICAS), a record that too few replicas acknowledged in time is kept in
the spool as well, until a later write of it is replicated: what a client was told is
durable survives the loss of the master that took it.

Durable writes of one Redis (alone or behind Sentinel) share a round trip with the others
of their event-loop turn, each caller still waiting for its own script's reply
(gateway/batching.py); a cluster's go one by one.

Storage accounting (the tenants' storage budgets and the refusal ring): gateway/accounting.py,
whose scripts make each write, with its accounting, one atomic round trip. Every key of a
tenant shares one hash slot (gateway/keys.py), so each script and each pipelined read below
runs on one node of a cluster.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
from redis.exceptions import RedisError

from detgate.gateway.accounting import REPLAY_LUA, STORED_LUA, WRITE_LUA, Stored
from detgate.gateway.batching import WriteBatch
from detgate.gateway.errors import RecorderUnavailable
from detgate.gateway.interrupts import stopping
from detgate.gateway.keys import Keys
from detgate.gateway.spool import Spool, SpoolFull
from detgate.gateway.store import CLUSTER, NotReplicated, Store

log = logging.getLogger("detgate.gateway")


def dumps(obj: dict) -> bytes:
    return orjson.dumps(obj)


def loads(data: bytes) -> dict:
    return orjson.loads(data)


@dataclass
class Page:
    """One page of a listing; `last_id` is the cursor for the next (`after`)."""

    data: list[dict]
    last_id: str | None
    has_more: bool


# KEYS: index; ARGV: ttl_s, 1 if a cursor follows (0: from the newest), the cursor's record
# id, how many ids. Index entries older than the TTL point at expired records: they are
# dropped here, on the rare listing path, rather than on every write. Returns {-1} when the
# cursor is not in the index, else {entries, position of the first id, ids}.
LIST_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - tonumber(ARGV[1])))
local total = redis.call('ZCARD', KEYS[1])
local pos = 0
if ARGV[2] == '1' then
  local rank = redis.call('ZREVRANK', KEYS[1], ARGV[3])
  if not rank then return {-1} end
  pos = rank + 1
end
return {total, pos, redis.call('ZREVRANGE', KEYS[1], pos, pos + tonumber(ARGV[4]) - 1)}
"""


class Recorder:
    max_scan = 2000  # records one filtered listing page may examine

    def __init__(self, store: Store, *, prefix: str, ttl_s: int, retry_after_s: int,
                 spool: Spool | None = None) -> None:
        self.store = store
        self.keys = Keys(prefix)
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s
        self.spool = spool or Spool(Path(), 0)  # without one: a Redis outage answers 503
        self._write_script = store.script(WRITE_LUA)
        self._replay_script = store.script(REPLAY_LUA)
        self._stored_script = store.script(STORED_LUA)
        self._list_script = store.script(LIST_LUA)
        self._short = False  # the last durable write was acknowledged by too few replicas
        # Durable writes share a round trip per event-loop turn (gateway/batching.py); a
        # cluster's go one by one, each to its node.
        self._batch = None if store.target.mode == CLUSTER else WriteBatch(store, store.timeout_s)

    @property
    def up(self) -> bool:
        return self.store.up

    def _unavailable(self, exc: Exception | None = None) -> RecorderUnavailable:
        if exc is not None:
            self.store.mark_down(exc)
        return RecorderUnavailable("the request store is unavailable; retry shortly",
                                   headers={"Retry-After": str(self.retry_after_s)})

    def can_record(self) -> bool:
        """A record made now would be durable: Redis takes it, or the spool has room."""
        return (self.up and not self.spool.entries) or self.spool.has_room()

    def ensure_up(self) -> None:
        if not self.can_record():
            raise self._unavailable()

    async def ping(self) -> bool:
        return await self.store.ping()

    async def watch(self, interval_s: float) -> None:
        """Background task: keep `up` true to Redis' state; drain the spool when it is up."""
        while not stopping():
            busy = not self.up or self.spool.entries
            busy = busy or self.spool.failing is not None
            await asyncio.sleep(min(interval_s, 0.25) if busy else interval_s)
            await self.spool.probe()
            if await self.ping() and self.spool.entries:
                try:
                    await self.spool.drain(self._write)
                except NotReplicated as exc:
                    self._note_short(exc)  # kept in the spool; tried again next time
                except (RedisError, OSError) as exc:
                    self._unavailable(exc)

    def _note_short(self, exc: NotReplicated | None) -> None:
        """Log when records start (`exc`) or stop being kept for too few replicas."""
        if exc is not None and not self._short:
            log.warning("records not replicated in time (%s): kept in the spool", exc)
        elif exc is None and self._short:
            log.warning("records replicated again")
        self._short = exc is not None

    async def save(self, tenant: str, record: dict, data: bytes | None = None, *,
                   tokens: int = 0, tokens_per_s: float | None = None) -> Stored | None:
        """Make a record (`data`: its JSON, when already serialised) durable: in Redis (and
        its replicas, when waited for), or (Redis down, too few replicas, or spooled records
        still waiting, which keeps their order) in the spool. With `tokens_per_s`, `tokens`
        are charged to the tenant's shared bucket in the same call. The tenant's stored
        bytes when written to Redis (`spooled` when also kept in the spool for too few
        replicas); None when only spooled (nothing charged); RecorderUnavailable when neither
        can take it."""
        written = None
        if self.up and not self.spool.entries:
            try:
                stored = await self._write(tenant, record, data, tokens=tokens,
                                           tokens_per_s=tokens_per_s)
            except NotReplicated as exc:
                self._note_short(exc)
                written = Stored.parse(exc.reply)
                written.spooled = True
            except (RedisError, OSError) as exc:
                self._unavailable(exc)
            else:
                if self._short:
                    self._note_short(None)
                return stored
        try:
            await self.spool.append(tenant, record)
        except SpoolFull as exc:
            raise self._unavailable() from exc
        return written

    async def save_refusal(self, tenant: str, record: dict, data: bytes, *, cap: int | None,
                           ring: int) -> Stored | None:
        """Store a refused request's summary if it fits: Redis up, the tenant's total
        staying within `cap` (its storage budget), among its newest `ring` refusals. The
        tenant's stored bytes either way; None when Redis could not be asked (a refusal is
        never spooled: the spool keeps answers)."""
        if not self.up or ring <= 0:
            return None
        try:
            return await self._write(tenant, record, data, cap=cap or 0, ring=ring,
                                     durable=False)
        except (RedisError, OSError) as exc:
            self._unavailable(exc)
            return None

    async def _write(self, tenant: str, record: dict, data: bytes | None = None, *,
                     cap: int = 0, ring: int = 0, tokens: int = 0,
                     tokens_per_s: float | None = None, durable: bool = True) -> Stored:
        """Write a record, index it and account its bytes, atomically (idempotent: a retry
        rewrites it and counts its bytes once); `cap`, `ring` and the token charge as in
        accounting.WRITE_LUA. `durable`: waited for on the replicas (NotReplicated)."""
        data = dumps(record) if data is None else data
        keys = [self.keys.record(tenant, record["id"]), self.keys.index(tenant),
                self.keys.stored(tenant), self.keys.expiries(tenant), self.keys.refusals(tenant),
                self.keys.rates(tenant)]
        args = [data, self.ttl_s, record["id"], record["created"],
                f"{record['id']}:{len(data)}", cap, ring, self.keys.record(tenant, ""),
                tokens if tokens_per_s else 0, tokens_per_s or 0]
        if not durable:
            run = self.store.run
        elif self._batch is not None:
            run = self._batch.run
        else:
            run = self.store.run_durably
        return Stored.parse(await run(self._write_script, keys, args))

    async def stored(self, tenant: str) -> Stored:
        """The tenant's record bytes now (expired records subtracted)."""
        try:
            reply = await self.store.run(
                self._stored_script, [self.keys.stored(tenant), self.keys.expiries(tenant)], [])
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from exc
        return Stored.parse(reply)

    async def get(self, tenant: str, record_id: str) -> tuple[dict, int] | None:
        """The record with its replays, and its remaining lifetime in ms; None if absent."""
        spooled = self.spool.by_id.get((tenant, record_id))
        if spooled is not None:
            return {**spooled, "replays": []}, self.ttl_s * 1000
        key = self.keys.record(tenant, record_id)
        try:
            raw, pttl, replays = await self.store.batch([
                ("GET", key), ("PTTL", key),
                ("LRANGE", self.keys.replays(tenant, record_id), 0, -1)])
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from exc
        if raw is None:
            return None
        record = loads(raw)
        record["replays"] = [loads(r) for r in replays]
        return record, pttl

    async def list(self, tenant: str, limit: int, *, after: str | None = None,
                   keep: Callable[[dict], bool] | None = None) -> Page | None:
        """Up to `limit` records newest first, from just past record `after` (None: the
        newest), keeping only those `keep` accepts; None if `after` is not in the index.

        A filtered page examines at most `max_scan` records; its `last_id` is the last one
        examined, so the next page goes on from there even when this one came back short."""
        idx = self.keys.index(tenant)
        try:
            want = limit if keep is None else max(limit, 64)
            head = await self.store.run(self._list_script, [idx], [
                self.ttl_s, int(after is not None), after or "", want])
            if head[0] == -1:
                return None
            total, pos, ids = head
            page = Page([], after, False)
            seen: set[bytes] = set()
            scanned = 0
            while len(page.data) < limit and scanned < self.max_scan and pos < total:
                if ids is None:
                    want = limit - len(page.data) if keep is None else max(limit, 64)
                    ids = await self.store.call("ZREVRANGE", idx, pos, pos + want - 1)
                if not ids:
                    break
                loaded = await self._load(tenant, ids)
                for rid, record in zip(ids, loaded, strict=True):
                    pos += 1
                    if rid in seen:  # a record written meanwhile shifted the ranks by one
                        continue
                    seen.add(rid)
                    scanned += 1
                    page.last_id = rid.decode()
                    if record is not None and (keep is None or keep(record)):
                        page.data.append(record)
                    if len(page.data) == limit or scanned == self.max_scan:
                        break
                ids = None
            page.has_more = pos < total
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from exc
        return page

    async def _load(self, tenant: str, ids: list[bytes]) -> list[dict | None]:
        """Records with their replays, in the order of `ids`; None for an expired one."""
        commands: list[tuple] = []
        for rid in ids:
            commands.append(("GET", self.keys.record(tenant, rid.decode())))
            commands.append(("LRANGE", self.keys.replays(tenant, rid.decode()), 0, -1))
        results = await self.store.batch(commands)
        records: list[dict | None] = []
        for raw, replays in zip(results[::2], results[1::2], strict=True):
            record = None
            if raw is not None:
                record = loads(raw)
                record["replays"] = [loads(r) for r in replays]
            records.append(record)
        return records

    async def add_replay(self, tenant: str, record_id: str, comparison: dict,
                         record_pttl_ms: int) -> Stored:
        """Append a comparison, counted in the tenant's stored bytes; the list expires with
        its record. The tenant's total after it."""
        data = dumps(comparison)
        ttl_ms = record_pttl_ms if record_pttl_ms > 0 else self.ttl_s * 1000
        keys = [self.keys.replays(tenant, record_id), self.keys.stored(tenant),
                self.keys.expiries(tenant)]
        try:
            reply = await self.store.run(self._replay_script, keys, [
                data, ttl_ms, f"{comparison['replay_id']}:{len(data)}"])
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from exc
        return Stored.parse(reply)

    async def close(self) -> None:
        if self._batch is not None:
            await self._batch.close()
        await self.store.aclose()
        self.spool.close()


def now() -> float:
    return round(time.time(), 3)
