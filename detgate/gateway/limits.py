"""Per-tenant limits: requests/s, tokens/s, a record storage budget, a maximum record size.

- Rates are token buckets of one second's worth (at least one request). By default they live
  in Redis, shared by every gateway replica and exact under concurrency (gateway/rates.py);
  `DETGATE_RATE_LIMITS=process` keeps them in each process instead (this module's `Bucket`),
  which costs no Redis call but gives a tenant up to N times its rates with N gateways. While
  Redis is unreachable the shared mode falls back to these per-process buckets at the full
  rate: an outage does not turn into refusals, and a tenant may get up to N times its rates
  for its duration.
- Tokens/s are charged after the answer, from its `usage.total_tokens` (the gateway has no
  tokenizer and `max_tokens` is only a bound): a tenant in debt is refused until the bucket
  refills past zero.
- The storage budget is shared through Redis (the recorder's accounting, which frees bytes
  exactly as records expire and survives restarts). With shared rates, admission reads the
  tenant's total in the same call as its buckets. Per process, every record write returns the
  tenant's total, so a busy tenant is checked against a figure at most `STORAGE_FRESH_S` old at
  no cost; otherwise one Redis read refreshes it. Either way the budget can be overshot by the
  records of requests already admitted (at most one per request in flight).
- Refusals answer 429 with Retry-After and a code naming the limit. `/v1/score` is held to
  the rates (it costs a worker's time; charged its `token_ids`) but not to the storage
  budget (it stores nothing).
- A replay is a request like any other (requests/s, the storage budget: its comparison is
  stored), and is charged every token it makes a worker run, its load's included. Those are
  estimated from the record and taken when the record is read, so that concurrent replays
  cannot all start before the first is charged; the estimate is settled against the answers'
  usage afterwards. `max_replay_load` caps the load one replay may ask for.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from detgate.gateway.errors import RateLimited

STORAGE_FRESH_S = 1.0
UNNAMED = "other"  # the metrics label of tenants without a configured name
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class TenantLimits(BaseModel):
    """One tenant's limits (None: unlimited), as written in DETGATE_TENANT_LIMITS."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    requests_per_s: float | None = Field(None, gt=0)
    tokens_per_s: float | None = Field(None, gt=0)
    storage_bytes: int | None = Field(None, gt=0)
    max_record_bytes: int | None = Field(None, ge=4096)
    max_replay_load: int | None = Field(None, ge=0)
    # The tenant's label in /metrics; tenants without one share the label "other".
    name: str | None = Field(None, pattern=_NAME.pattern)


def over_storage(lim: TenantLimits, retry_s: int) -> RateLimited:
    return RateLimited(f"the tenant's record storage budget ({lim.storage_bytes} bytes) is used "
                       "up; space frees as records expire", code="storage_budget_exceeded",
                       retry_after_s=retry_s)


def over_tokens(lim: TenantLimits, retry_s: int) -> RateLimited:
    return RateLimited(f"over the tenant's limit of {lim.tokens_per_s:g} tokens/s",
                       code="tokens_per_s_exceeded", retry_after_s=retry_s)


def over_requests(lim: TenantLimits, retry_s: int) -> RateLimited:
    return RateLimited(f"over the tenant's limit of {lim.requests_per_s:g} requests/s",
                       code="requests_per_s_exceeded", retry_after_s=retry_s)


@dataclass
class Bucket:
    """A token bucket: `level` refills at `rate` per second up to `capacity` (one second's
    worth; a requests bucket holds at least one request)."""

    rate: float
    capacity: float
    level: float
    at: float

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now

    def wait_s(self, need: float) -> int:
        """Whole seconds until the level reaches `need` (Retry-After)."""
        return max(1, math.ceil((need - self.level) / self.rate))


@dataclass
class TenantState:
    limits: TenantLimits
    label: str
    requests: Bucket | None = None
    tokens: Bucket | None = None
    stored_bytes: int = 0
    stored_at: float = -math.inf  # monotonic time of the last figure from Redis
    storage_retry_s: int = 1


@dataclass
class Limits:
    """The configured limits of every tenant: `table` by tenant, "*" for the rest."""

    table: dict[str, TenantLimits]
    default_max_record_bytes: int
    states: dict[str, TenantState] = field(default_factory=dict)

    @property
    def labels(self) -> list[str]:
        named = {lim.name for tenant, lim in self.table.items() if lim.name and tenant != "*"}
        return sorted(named | {UNNAMED})

    def state(self, tenant: str) -> TenantState:
        st = self.states.get(tenant)
        if st is None:
            lim = self.table.get(tenant) or self.table.get("*") or TenantLimits()
            now = time.monotonic()
            # "*" gives its limits, not its name, to the tenants it covers.
            label = lim.name if lim.name and tenant in self.table else UNNAMED
            st = TenantState(lim, label)
            if lim.requests_per_s:
                burst = max(lim.requests_per_s, 1.0)
                st.requests = Bucket(lim.requests_per_s, burst, burst, now)
            if lim.tokens_per_s:
                st.tokens = Bucket(lim.tokens_per_s, lim.tokens_per_s, lim.tokens_per_s, now)
            self.states[tenant] = st
        return st

    def max_record_bytes(self, tenant: str) -> int:
        return self.state(tenant).limits.max_record_bytes or self.default_max_record_bytes

    def needs_storage_figure(self, tenant: str) -> bool:
        st = self.state(tenant)
        return (st.limits.storage_bytes is not None
                and time.monotonic() - st.stored_at > STORAGE_FRESH_S)

    def note_storage(self, tenant: str, total: int, retry_s: int | None = None) -> None:
        st = self.state(tenant)
        st.stored_bytes, st.stored_at = total, time.monotonic()
        if retry_s is not None:
            st.storage_retry_s = max(1, retry_s)

    def admit(self, tenant: str, *, stores: bool = True) -> None:
        """Take one request from the tenant's allowance in this process, or raise
        RateLimited. A request that `stores` no record (a score) is not held to the storage
        budget."""
        st = self.state(tenant)
        lim = st.limits
        now = time.monotonic()
        if stores and lim.storage_bytes is not None and st.stored_bytes >= lim.storage_bytes:
            raise over_storage(lim, st.storage_retry_s)
        if st.tokens is not None:
            self.take_tokens(tenant, 0)
        if st.requests is not None:
            st.requests.refill(now)
            if st.requests.level < 1:
                raise over_requests(lim, st.requests.wait_s(1))
            st.requests.level -= 1

    def replay_load(self, tenant: str, cap: int) -> int:
        """The most load a replay of this tenant may ask for (`cap`: the gateway's)."""
        own = self.state(tenant).limits.max_replay_load
        return cap if own is None else min(own, cap)

    def take_tokens(self, tenant: str, tokens: int) -> None:
        """Charge `tokens` before the work, or raise RateLimited if the tenant is in debt."""
        st = self.state(tenant)
        if st.tokens is None:
            return
        st.tokens.refill(time.monotonic())
        if st.tokens.level <= 0:
            raise over_tokens(st.limits, st.tokens.wait_s(1e-9))
        st.tokens.level -= tokens

    def charge(self, tenant: str, tokens: int) -> None:
        """Charge `tokens` (negative: give back an estimate's excess)."""
        st = self.state(tenant)
        if st.tokens is not None:
            st.tokens.refill(time.monotonic())
            st.tokens.level = min(st.tokens.capacity, st.tokens.level - tokens)



def usage_tokens(usage: dict | None) -> int:
    """An answer's `usage.total_tokens`, 0 when absent or odd."""
    total = (usage or {}).get("total_tokens")
    return total if isinstance(total, int) and total > 0 else 0
