"""Storage accounting (the tenants' storage budgets, gateway/limits.py): each record write adds
its bytes to the tenant's total and `<id>:<bytes>` to a sorted set scored by the record's
expiry; every write (and every read of the total) first subtracts the records whose expiry
has passed. One Lua script does the record, its index entry and the accounting, so a write
stays one round trip and the total stays exact across gateways, restarts and expiry. A
replay's comparison is counted the same way, until its record expires.

Refused requests (over a tenant limit) are stored as summaries in a fixed-size ring per
tenant, the newest `refusal_ring` of them, and only while their bytes keep the tenant within
its storage budget: past that, and while Redis is away, they are counted in the metrics but
not stored, so that a flood of refusals stores a bounded amount whatever its size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from detgate.gateway.lua import BUCKETS_LUA, CLOCK_LUA, EXPIRE_LUA

# KEYS: record, index, total, expiries, refusals, rate buckets; ARGV: record JSON, ttl_s, id,
# created, member, cap, ring, record key prefix, tokens, tokens/s. The member is `<id>:<bytes>`:
# the same record written again (a retry, a spool drain) is counted once; a record id is never
# rewritten with other bytes. With `cap` > 0 the record is written only if the total stays
# within it; with `ring` > 0 it is a refusal, and the tenant's refusals beyond the newest
# `ring` are deleted (record, index entry and bytes). With `tokens` > 0 the answer's tokens are
# charged to the tenant's tokens/s bucket (gateway/rates.py) in the same call. Returns {total,
# ms until the earliest expiry, written 1/0}.
WRITE_LUA = CLOCK_LUA + EXPIRE_LUA + BUCKETS_LUA + """
local now_us = clock_us()
local now = now_us / 1e6
local ttl = tonumber(ARGV[2])
local cap = tonumber(ARGV[6])
local ring = tonumber(ARGV[7])
local tokens = tonumber(ARGV[9])
if tokens > 0 then
  local r, t = buckets(KEYS[6], now_us)
  keep(KEYS[6], now_us, r, charged(t, now_us, tonumber(ARGV[10]), tokens))
end
local total = settle(KEYS[3], KEYS[4], now)
if cap > 0 and total[1] + string.len(ARGV[1]) > cap then
  total[3] = 0
  return total
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ttl)
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[3])
redis.call('EXPIRE', KEYS[2], ttl)
if redis.call('ZADD', KEYS[4], now + ttl, ARGV[5]) == 1 then
  total[1] = redis.call('INCRBY', KEYS[3], string.len(ARGV[1]))
end
if ring > 0 then
  redis.call('LPUSH', KEYS[5], ARGV[5])
  redis.call('EXPIRE', KEYS[5], ttl)
  while redis.call('LLEN', KEYS[5]) > ring do
    local old = redis.call('RPOP', KEYS[5])
    local id, size = string.match(old, '^(.*):(%d+)$')
    redis.call('DEL', ARGV[8] .. id)
    redis.call('ZREM', KEYS[2], id)
    if redis.call('ZREM', KEYS[4], old) == 1 then
      total[1] = redis.call('DECRBY', KEYS[3], tonumber(size))
    end
  end
end
redis.call('EXPIRE', KEYS[3], ttl)
redis.call('EXPIRE', KEYS[4], ttl)
if total[2] == 0 then total[2] = ttl * 1000 end
total[3] = 1
return total
"""

# KEYS: replays, total, expiries; ARGV: comparison JSON, ttl_ms, member: a comparison
# appended to its record's list and counted in the tenant's total until the record expires.
REPLAY_LUA = CLOCK_LUA + EXPIRE_LUA + """
local now = clock_us() / 1e6
local ttl_ms = tonumber(ARGV[2])
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ttl_ms)
local total = settle(KEYS[2], KEYS[3], now)
if redis.call('ZADD', KEYS[3], now + ttl_ms / 1000, ARGV[3]) == 1 then
  total[1] = redis.call('INCRBY', KEYS[2], string.len(ARGV[1]))
end
if total[2] == 0 then total[2] = ttl_ms end
local keep = math.ceil(ttl_ms / 1000)
if redis.call('TTL', KEYS[2]) < keep then redis.call('EXPIRE', KEYS[2], keep) end
if redis.call('TTL', KEYS[3]) < keep then redis.call('EXPIRE', KEYS[3], keep) end
return total
"""

# KEYS: total, expiries.
STORED_LUA = CLOCK_LUA + EXPIRE_LUA + "return settle(KEYS[1], KEYS[2], clock_us() / 1e6)"


@dataclass
class Stored:
    """A tenant's record bytes in Redis, and seconds until the oldest of them expires;
    `written`: the write this came from was made (a refusal may not be); `spooled`: it was
    kept in the spool as well, too few replicas having acknowledged it."""

    total: int
    frees_in_s: int
    written: bool = True
    spooled: bool = False

    @classmethod
    def parse(cls, reply: list) -> Stored:
        """From a script's {total, ms until the earliest expiry[, written]}."""
        return cls(int(reply[0]), max(1, math.ceil(int(reply[1]) / 1000)),
                   len(reply) < 3 or bool(reply[2]))
