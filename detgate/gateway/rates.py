"""Requests/s and tokens/s shared by every gateway replica: token buckets kept in Redis.

A tenant's two buckets are one hash, `<prefix>:lim:{tenant}` (gateway/keys.py), each bucket
stored as the time it is full again (GCRA's "theoretical arrival time", in microseconds of
Redis's own clock, read with TIME inside the script: the replicas' clocks play no part). A
bucket of `rate` per second holds one second's worth, at least one request; its level at
`now` is capacity - rate x max(0, full_at - now), and taking n makes full_at
max(full_at, now) + n / rate. An absent key (it expires once both buckets are full) is two
full buckets.

Every check is one script, so it is exact under any concurrency and across replicas: two
gateways cannot both take the last request of a second. The admission script also checks the
storage budget (gateway/accounting.py's total, with expired records subtracted first) in the
same call, so admitting a request is one round trip whatever the tenant's limits; a tenant
without limits costs none. Tokens charged after an answer ride on its record's write (the
same slot: gateway/accounting.py's WRITE_LUA); scores, replays' estimates and their
settlement are a call each.

Semantics are the per-process buckets' (gateway/limits.py): requests need a whole request's
worth; tokens are admitted while the level is above zero, charged afterwards, and may take the
level below zero (debt), which refuses the tenant's next requests until it is paid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from detgate.gateway.accounting import Stored
from detgate.gateway.keys import Keys
from detgate.gateway.limits import TenantLimits, over_requests, over_storage, over_tokens
from detgate.gateway.lua import BUCKETS_LUA, CLOCK_LUA, EXPIRE_LUA
from detgate.gateway.store import Store

ADMITTED, STORAGE, TOKENS, REQUESTS = 0, 1, 2, 3

# KEYS: buckets, stored total, expiries; ARGV: requests/s, tokens/s, storage budget (0: none,
# or a request that stores nothing). Returns {verdict, retry ms, stored total or -1, ms until
# the oldest stored record expires}.
ADMIT_LUA = CLOCK_LUA + EXPIRE_LUA + BUCKETS_LUA + """
local now = clock_us()
local req_rate, tok_rate, budget = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local stored = {-1, 0}
if budget > 0 then
  stored = settle(KEYS[2], KEYS[3], now / 1e6)
  if stored[1] >= budget then return {1, stored[2], stored[1], stored[2]} end
end
local r, t = buckets(KEYS[1], now)
if tok_rate > 0 and t - now >= 1e6 then
  return {2, math.ceil((t - now - 1e6 + 1) / 1000), stored[1], stored[2]}
end
if req_rate > 0 then
  local window = math.max(req_rate, 1) / req_rate * 1e6
  local after = r + 1e6 / req_rate
  if after - now > window then
    return {3, math.ceil((after - now - window) / 1000), stored[1], stored[2]}
  end
  keep(KEYS[1], now, after, t)
end
return {0, 0, stored[1], stored[2]}
"""

# KEYS: buckets; ARGV: tokens/s, tokens (negative: an estimate's excess given back), check
# (1: refuse while in debt, before charging). Returns {verdict, retry ms}.
CHARGE_LUA = CLOCK_LUA + BUCKETS_LUA + """
local now = clock_us()
local r, t = buckets(KEYS[1], now)
if ARGV[3] == '1' and t - now >= 1e6 then
  return {2, math.ceil((t - now - 1e6 + 1) / 1000)}
end
keep(KEYS[1], now, r, charged(t, now, tonumber(ARGV[1]), tonumber(ARGV[2])))
return {0, 0}
"""


@dataclass
class Verdict:
    refused: int  # ADMITTED, or the limit: STORAGE, TOKENS, REQUESTS
    retry_s: int
    stored: Stored | None  # the tenant's stored bytes, when the budget was checked

    def error(self, lim: TenantLimits):
        """The RateLimited to raise (refused verdicts only)."""
        over = {STORAGE: over_storage, TOKENS: over_tokens, REQUESTS: over_requests}
        return over[self.refused](lim, self.retry_s)


def _verdict(reply: list) -> Verdict:
    stored = Stored.parse(reply[2:4]) if len(reply) > 2 and reply[2] >= 0 else None
    return Verdict(int(reply[0]), max(1, math.ceil(int(reply[1]) / 1000)), stored)


class SharedRates:
    """The tenants' buckets in Redis. Calls raise RedisError or OSError when Redis fails:
    the caller falls back to the per-process buckets."""

    def __init__(self, store: Store, keys: Keys) -> None:
        self.store = store
        self.keys = keys
        self._admit = store.script(ADMIT_LUA)
        self._charge = store.script(CHARGE_LUA)
        self._tenant_keys: dict[str, list[str]] = {}

    def applies(self, lim: TenantLimits, stores: bool) -> bool:
        """Whether admitting this request needs Redis at all."""
        return bool(lim.requests_per_s or lim.tokens_per_s
                    or (stores and lim.storage_bytes))

    def _keys(self, tenant: str) -> list[str]:
        keys = self._tenant_keys.get(tenant)
        if keys is None:
            keys = [self.keys.rates(tenant), self.keys.stored(tenant),
                    self.keys.expiries(tenant)]
            self._tenant_keys[tenant] = keys
        return keys

    async def admit(self, tenant: str, lim: TenantLimits, *, stores: bool) -> Verdict:
        budget = lim.storage_bytes if stores and lim.storage_bytes else 0
        reply = await self.store.run(self._admit, self._keys(tenant), [
            lim.requests_per_s or 0, lim.tokens_per_s or 0, budget])
        return _verdict(reply)

    async def take(self, tenant: str, lim: TenantLimits, tokens: int) -> Verdict:
        """Charge `tokens` before the work, unless the tenant is in debt (then refused)."""
        return _verdict(await self.store.run(self._charge, self._keys(tenant)[:1],
                                             [lim.tokens_per_s, tokens, 1]))

    async def charge(self, tenant: str, lim: TenantLimits, tokens: int) -> None:
        await self.store.run(self._charge, self._keys(tenant)[:1],
                             [lim.tokens_per_s, tokens, 0])
