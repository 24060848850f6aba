"""Lua functions the gateway's Redis scripts share (gateway/accounting.py, gateway/rates.py):
Redis's clock, settling a tenant's expired bytes, and the token buckets' arithmetic.

Every script reads the time from Redis (TIME; allowed before writes since scripts replicate
their effects, the only mode of Redis 7), so that neither the gateways' clocks nor their skew
enter a total, an expiry or a bucket.
"""

from __future__ import annotations

CLOCK_LUA = """
local function clock_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
"""

# Subtract records expired by `now` (seconds; at most 1000 a call: the rest on the next one)
# from the total, then return the total and the milliseconds until the earliest expiry still
# counted (0: none).
EXPIRE_LUA = """
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
  local frees_ms = 0
  if first[2] then frees_ms = math.max(1, math.ceil((tonumber(first[2]) - now) * 1000)) end
  return {tonumber(redis.call('GET', total_key) or '0'), frees_ms}
end
"""

# A tenant's buckets (gateway/rates.py): the microsecond at which each is full again, requests
# (`r`) and tokens (`t`), never earlier than `now`. `keep` writes both and lets the key expire
# when both are full again (an absent key is two full buckets); '%.17g' keeps every bit of a
# double. `charged`: a tokens bucket after `n` tokens (negative: given back, up to full).
BUCKETS_LUA = """
local function buckets(key, now)
  local at = redis.call('HMGET', key, 'r', 't')
  return math.max(tonumber(at[1]) or now, now), math.max(tonumber(at[2]) or now, now)
end
local function keep(key, now, r, t)
  redis.call('HSET', key, 'r', string.format('%.17g', r), 't', string.format('%.17g', t))
  redis.call('PEXPIRE', key, math.max(1, math.ceil((math.max(r, t) - now) / 1000)))
end
local function charged(t, now, rate, n)
  return math.max(now, t + n * 1e6 / rate)
end
"""
