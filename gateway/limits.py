"""Per-tenant limits: requests/s, tokens/s, a record storage budget, a maximum record size.

- Rates are token buckets in this process (a second's worth of burst): with N gateways a
  tenant may get up to N times its rate. They cost no Redis call.
- Tokens/s are charged after the answer, from its `usage.total_tokens` (the gateway has no
  tokenizer and `max_tokens` is only a bound): a tenant in debt is refused until the bucket
  refills past zero.
- The storage budget is shared through Redis (the recorder's accounting, which frees bytes
  exactly as records expire and survives restarts). Every record write returns the tenant's
  total, so a busy tenant is checked against a figure at most `STORAGE_FRESH_S` old at no
  cost; otherwise one Redis read refreshes it. The budget can be overshot by the records of
  requests already admitted (at most one per request in flight).
- Refusals answer 429 with Retry-After and a code naming the limit. `/v1/score` is held to
  the rates (it costs a worker's time; charged its `token_ids`) but not to the storage
  budget (it stores nothing).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from gateway.errors import RateLimited

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
    # The tenant's label in /metrics; tenants without one share the label "other".
    name: str | None = Field(None, pattern=_NAME.pattern)


@dataclass
class Bucket:
    """A token bucket: `level` refills at `rate` per second up to `rate` (one second's worth)."""

    rate: float
    level: float
    at: float

    def refill(self, now: float) -> None:
        self.level = min(self.rate, self.level + (now - self.at) * self.rate)
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
                st.requests = Bucket(lim.requests_per_s, lim.requests_per_s, now)
            if lim.tokens_per_s:
                st.tokens = Bucket(lim.tokens_per_s, lim.tokens_per_s, now)
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
        """Take one request from the tenant's allowance, or raise RateLimited. A request that
        `stores` no record (a score) is not held to the storage budget."""
        st = self.state(tenant)
        lim = st.limits
        now = time.monotonic()
        if stores and lim.storage_bytes is not None and st.stored_bytes >= lim.storage_bytes:
            raise RateLimited(
                f"the tenant's record storage budget ({lim.storage_bytes} bytes) is used up; "
                "space frees as records expire", code="storage_budget_exceeded",
                retry_after_s=st.storage_retry_s)
        if st.tokens is not None:
            st.tokens.refill(now)
            if st.tokens.level <= 0:
                raise RateLimited(f"over the tenant's limit of {lim.tokens_per_s:g} tokens/s",
                                  code="tokens_per_s_exceeded",
                                  retry_after_s=st.tokens.wait_s(1e-9))
        if st.requests is not None:
            st.requests.refill(now)
            if st.requests.level < 1:
                raise RateLimited(
                    f"over the tenant's limit of {lim.requests_per_s:g} requests/s",
                    code="requests_per_s_exceeded", retry_after_s=st.requests.wait_s(1))
            st.requests.level -= 1

    def charge_tokens(self, tenant: str, usage: dict | None) -> int:
        """Charge an answer's tokens; returns how many."""
        total = (usage or {}).get("total_tokens")
        if not isinstance(total, int) or total <= 0:
            return 0
        st = self.state(tenant)
        if st.tokens is not None:
            st.tokens.refill(time.monotonic())
            st.tokens.level -= total
        return total
