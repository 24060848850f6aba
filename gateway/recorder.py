"""Records in Redis: one serialise/deserialise pair, a TTL on every key, atomic multi-key writes.

Records come and go here in their stored JSON shape (dicts): the routes build them as
`detgate.contract.record.Record` and `Services.save` serialises them, and what is read back
may also be a bounded summary (gateway/summary.py), which no `Record` describes.

Floats are written by orjson, which prints the shortest text that parses back to the same
double, and read back by orjson: a logprob's bits survive the round trip unchanged.

Availability: a failed Redis call marks the recorder down; while it is down (or while spooled
records wait to be drained) records go to the on-disk spool (gateway/spool.py), so an outage
costs no answers. Only when the spool is full or unwritable too are new inference requests
refused (503 + Retry-After) before any work. A background ping marks Redis up again and
drains the spool into it in order; redis-py's pool reconnects by itself.

Storage accounting (the tenants' storage budgets, gateway/limits.py): each record write adds
its bytes to the tenant's total and `<id>:<bytes>` to a sorted set scored by the record's
expiry; every write (and every read of the total) first subtracts the records whose expiry
has passed. One Lua script does the record, its index entry and the accounting, so a write
stays one round trip and the total stays exact across gateways, restarts and expiry.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.errors import RecorderUnavailable
from gateway.keys import Keys
from gateway.spool import Spool, SpoolFull

log = logging.getLogger("detgate.gateway")


def dumps(obj: dict) -> bytes:
    return orjson.dumps(obj)


def loads(data: bytes) -> dict:
    return orjson.loads(data)


# Subtract records expired by ARGV[1] (at most 1000 a call: the rest on the next one) from the
# total KEYS[1], then return the total and the earliest expiry still counted.
_EXPIRE_LUA = """
local function settle(total_key, exp_key, now)
  local gone = redis.call('ZRANGEBYSCORE', exp_key, '-inf', now, 'LIMIT', 0, 1000)
  if #gone > 0 then
    local freed = 0
    for _, member in ipairs(gone) do
      freed = freed + tonumber(string.match(member, ':(%d+)$'))
    end
    redis.call('ZREM', exp_key, unpack(gone))
    if redis.call('EXISTS', total_key) == 1 then
      redis.call('DECRBY', total_key, freed)
    end
  end
  local first = redis.call('ZRANGE', exp_key, 0, 0, 'WITHSCORES')
  return {tonumber(redis.call('GET', total_key) or '0'), first[2] or false}
end
"""

# KEYS: record, index, total, expiries; ARGV: now, record JSON, ttl_s, id, created, member.
# The member is `<id>:<bytes>`: the same record written again (a retry, a spool drain) is
# counted once; a record id is never rewritten with other bytes.
_WRITE_LUA = _EXPIRE_LUA + """
local ttl = tonumber(ARGV[3])
redis.call('SET', KEYS[1], ARGV[2], 'EX', ttl)
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[4])
redis.call('EXPIRE', KEYS[2], ttl)
local total = settle(KEYS[3], KEYS[4], ARGV[1])
if redis.call('ZADD', KEYS[4], tonumber(ARGV[1]) + ttl, ARGV[6]) == 1 then
  total[1] = redis.call('INCRBY', KEYS[3], string.len(ARGV[2]))
end
redis.call('EXPIRE', KEYS[3], ttl)
redis.call('EXPIRE', KEYS[4], ttl)
return total
"""

# KEYS: total, expiries; ARGV: now.
_STORED_LUA = _EXPIRE_LUA + "return settle(KEYS[1], KEYS[2], ARGV[1])"


@dataclass
class Stored:
    """A tenant's record bytes in Redis, and seconds until the oldest of them expires."""

    total: int
    frees_in_s: int

    @classmethod
    def parse(cls, reply: list, now: float) -> Stored:
        first = float(reply[1]) if reply[1] else now
        return cls(int(reply[0]), max(1, math.ceil(first - now)))


@dataclass
class Page:
    """One page of a listing; `last_id` is the cursor for the next (`after`)."""

    data: list[dict]
    last_id: str | None
    has_more: bool


class Recorder:
    max_scan = 2000  # records one filtered listing page may examine

    def __init__(self, url: str, *, prefix: str, ttl_s: int, timeout_s: float,
                 retry_after_s: int, spool: Spool | None = None,
                 max_connections: int = 64) -> None:
        # A blocking pool: under a burst, requests wait for a connection instead of failing
        # with "too many connections" (which would read as Redis being down).
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout_s, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s)
        self.redis = aioredis.Redis.from_pool(pool)
        self.keys = Keys(prefix)
        self.ttl_s = ttl_s
        self.retry_after_s = retry_after_s
        self.spool = spool or Spool(Path(), 0)  # without one: a Redis outage answers 503
        self.up = True
        self._write_script = self.redis.register_script(_WRITE_LUA)
        self._stored_script = self.redis.register_script(_STORED_LUA)

    def _unavailable(self, exc: Exception | None = None) -> RecorderUnavailable:
        if exc is not None:
            if self.up:
                log.warning("redis unavailable: %s", exc)
            self.up = False
        return RecorderUnavailable("the request store is unavailable; retry shortly",
                                   headers={"Retry-After": str(self.retry_after_s)})

    def can_record(self) -> bool:
        """A record made now would be durable: Redis takes it, or the spool has room."""
        return (self.up and not self.spool.entries) or self.spool.has_room()

    def ensure_up(self) -> None:
        if not self.can_record():
            raise self._unavailable()

    async def ping(self) -> bool:
        try:
            await self.redis.ping()
        except (RedisError, OSError, TimeoutError) as exc:
            self._unavailable(exc)
            return False
        if not self.up:
            log.warning("redis reachable again")
        self.up = True
        return True

    async def watch(self, interval_s: float) -> None:
        """Background task: keep `up` true to Redis' state; drain the spool when it is up."""
        while True:
            busy = not self.up or self.spool.entries
            await asyncio.sleep(min(interval_s, 0.25) if busy else interval_s)
            if await self.ping() and self.spool.entries:
                try:
                    await self.spool.drain(self._write)
                except (RedisError, OSError) as exc:
                    self._unavailable(exc)

    async def save(self, tenant: str, record: dict, data: bytes | None = None) -> Stored | None:
        """Make a record (`data`: its JSON, when already serialised) durable: in Redis, or
        (Redis down, or spooled records still waiting, which keeps their order) in the spool.
        The tenant's stored bytes when written to Redis; None when spooled;
        RecorderUnavailable when neither can take it."""
        if self.up and not self.spool.entries:
            try:
                return await self._write(tenant, record, data)
            except (RedisError, OSError) as exc:
                self._unavailable(exc)
        try:
            await self.spool.append(tenant, record)
        except SpoolFull as exc:
            raise self._unavailable() from exc
        return None

    async def _write(self, tenant: str, record: dict, data: bytes | None = None) -> Stored:
        """Write a record, index it and account its bytes, atomically (idempotent: a retry
        rewrites it and counts its bytes once)."""
        data = dumps(record) if data is None else data
        at = time.time()
        keys = [self.keys.record(tenant, record["id"]), self.keys.index(tenant),
                self.keys.stored(tenant), self.keys.expiries(tenant)]
        reply = await self._write_script(keys=keys, args=[
            at, data, self.ttl_s, record["id"], record["created"],
            f"{record['id']}:{len(data)}"])
        return Stored.parse(reply, at)

    async def stored(self, tenant: str) -> Stored:
        """The tenant's record bytes now (expired records subtracted)."""
        at = time.time()
        try:
            reply = await self._stored_script(
                keys=[self.keys.stored(tenant), self.keys.expiries(tenant)], args=[at])
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from exc
        return Stored.parse(reply, at)

    async def get(self, tenant: str, record_id: str) -> tuple[dict, int] | None:
        """The record with its replays, and its remaining lifetime in ms; None if absent."""
        spooled = self.spool.by_id.get((tenant, record_id))
        if spooled is not None:
            return {**spooled, "replays": []}, self.ttl_s * 1000
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.get(self.keys.record(tenant, record_id))
                pipe.pttl(self.keys.record(tenant, record_id))
                pipe.lrange(self.keys.replays(tenant, record_id), 0, -1)
                raw, pttl, replays = await pipe.execute()
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
            # Index entries older than the TTL point at expired records: drop them here, on
            # the rare listing path, rather than on every write.
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.zremrangebyscore(idx, "-inf", f"({time.time() - self.ttl_s}")
                pipe.zcard(idx)
                if after is not None:
                    pipe.zrevrank(idx, after)
                _, total, *rank = await pipe.execute()
            if after is not None and rank[0] is None:
                return None
            pos = rank[0] + 1 if after is not None else 0
            page = Page([], after, False)
            seen: set[bytes] = set()
            scanned = 0
            while len(page.data) < limit and scanned < self.max_scan and pos < total:
                want = limit - len(page.data) if keep is None else max(limit, 64)
                ids = await self.redis.zrevrange(idx, pos, pos + want - 1)
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
            page.has_more = pos < total
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from exc
        return page

    async def _load(self, tenant: str, ids: list[bytes]) -> list[dict | None]:
        """Records with their replays, in the order of `ids`; None for an expired one."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for rid in ids:
                pipe.get(self.keys.record(tenant, rid.decode()))
                pipe.lrange(self.keys.replays(tenant, rid.decode()), 0, -1)
            results = await pipe.execute()
        records: list[dict | None] = []
        for raw, replays in zip(results[::2], results[1::2], strict=True):
            record = None
            if raw is not None:
                record = loads(raw)
                record["replays"] = [loads(r) for r in replays]
            records.append(record)
        return records

    async def add_replay(self, tenant: str, record_id: str, comparison: dict,
                         record_pttl_ms: int) -> None:
        """Append a comparison; the list expires with its record."""
        key = self.keys.replays(tenant, record_id)
        ttl_ms = record_pttl_ms if record_pttl_ms > 0 else self.ttl_s * 1000
        try:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.rpush(key, dumps(comparison))
                pipe.pexpire(key, ttl_ms)
                await pipe.execute()
        except (RedisError, OSError) as exc:
            raise self._unavailable(exc) from exc

    async def close(self) -> None:
        await self.redis.aclose()
        self.spool.close()


def now() -> float:
    return round(time.time(), 3)
