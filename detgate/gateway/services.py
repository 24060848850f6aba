"""The long-lived objects of one gateway process, created in the app's lifespan."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from redis.exceptions import RedisError
from starlette.requests import ClientDisconnect

from detgate.contract.record import Record
from detgate.gateway.auth import Authenticator
from detgate.gateway.config import Settings
from detgate.gateway.errors import (
    ClientClosed,
    PayloadTooLarge,
    RateLimited,
    RecorderUnavailable,
    RequestTimeout,
)
from detgate.gateway.forward import Forwarder
from detgate.gateway.interrupts import Drain, Interrupts
from detgate.gateway.limits import UNNAMED, Limits, TenantState, usage_tokens
from detgate.gateway.metrics import Metrics
from detgate.gateway.protocol import CHAT
from detgate.gateway.rates import SharedRates
from detgate.gateway.recorder import Recorder, dumps
from detgate.gateway.router import Router
from detgate.gateway.summary import summarise
from detgate.gateway.upstream import Upstream

log = logging.getLogger("detgate.gateway")


@dataclass
class Services:
    settings: Settings
    auth: Authenticator
    metrics: Metrics
    upstream: Upstream
    recorder: Recorder
    router: Router
    forwarder: Forwarder
    interrupts: Interrupts
    drain: Drain
    limits: Limits
    rates: SharedRates | None  # None: per-process buckets (DETGATE_RATE_LIMITS=process)
    background: set[asyncio.Task] = field(default_factory=set)

    def spawn(self, coro: Coroutine) -> None:
        """Run work that must finish even if the request that started it is cancelled."""
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def _shared(self) -> bool:
        """Rates are checked in Redis now (shared mode, Redis reachable); otherwise in this
        process, at the full rate (gateway/limits.py)."""
        return self.rates is not None and self.recorder.up

    async def admit(self, tenant: str, *, stores: bool = True) -> None:
        """Let a request in, or raise RateLimited (counted per tenant either way)."""
        state = self.limits.state(tenant)
        try:
            if self._shared() and self.rates.applies(state.limits, stores):
                await self._admit_shared(tenant, state, stores)
            else:
                if stores and self.limits.needs_storage_figure(tenant) and self.recorder.up:
                    await self._refresh_stored(tenant, state)
                self.limits.admit(tenant, stores=stores)
        except RateLimited as exc:
            self.metrics.count_tenant(state.label, exc.code)
            raise
        self.metrics.count_tenant(state.label, "admitted")

    async def _admit_shared(self, tenant: str, state: TenantState, stores: bool) -> None:
        try:
            verdict = await self.rates.admit(tenant, state.limits, stores=stores)
        except (RedisError, OSError) as exc:
            self.recorder.store.mark_down(exc)
            self.limits.admit(tenant, stores=stores)
            return
        if verdict.stored is not None:
            self._note_stored(tenant, state.label, verdict.stored)
        if verdict.refused:
            raise verdict.error(state.limits)

    async def _refresh_stored(self, tenant: str, state: TenantState) -> None:
        try:
            stored = await self.recorder.stored(tenant)
        except RecorderUnavailable:
            pass  # checked against the last figure; the record goes to the spool
        else:
            self._note_stored(tenant, state.label, stored)

    async def take_tokens(self, tenant: str, tokens: int) -> None:
        """Charge tokens before the work (a replay's estimate), or raise RateLimited."""
        state = self.limits.state(tenant)
        if state.limits.tokens_per_s is None:
            return
        try:
            if self._shared():
                try:
                    verdict = await self.rates.take(tenant, state.limits, tokens)
                except (RedisError, OSError) as exc:
                    self.recorder.store.mark_down(exc)
                else:
                    if verdict.refused:
                        raise verdict.error(state.limits)
                    return
            self.limits.take_tokens(tenant, tokens)
        except RateLimited as exc:
            self.metrics.count_tenant(state.label, exc.code)
            raise

    async def _charge(self, tenant: str, tokens: int) -> None:
        """Charge `tokens` (negative: give back an estimate's excess)."""
        lim = self.limits.state(tenant).limits
        if not tokens or lim.tokens_per_s is None:
            return
        if self._shared():
            try:
                await self.rates.charge(tenant, lim, tokens)
                return
            except (RedisError, OSError) as exc:
                self.recorder.store.mark_down(exc)
        self.limits.charge(tenant, tokens)

    async def settle_tokens(self, tenant: str, estimate: int, used: int) -> None:
        """The tokens work charged in advance by `estimate` really took."""
        await self._charge(tenant, used - estimate)
        if used:
            self.metrics.count_tenant(self.limits.state(tenant).label, "tokens", used)

    async def save_replay(self, tenant: str, record_id: str, comparison: dict,
                          record_pttl_ms: int) -> None:
        stored = await self.recorder.add_replay(tenant, record_id, comparison, record_pttl_ms)
        self._note_stored(tenant, self.limits.state(tenant).label, stored)

    async def charge_tokens(self, tenant: str, usage: dict | None) -> None:
        """Charge an answer that stores no record (a score)."""
        tokens = usage_tokens(usage)
        if tokens:
            await self._charge(tenant, tokens)
            self.metrics.count_tenant(self.limits.state(tenant).label, "tokens", tokens)

    def _note_stored(self, tenant: str, label: str, stored) -> None:
        self.limits.note_storage(tenant, stored.total, stored.frees_in_s)
        if label != UNNAMED:  # a total shared by unnamed tenants would mean nothing
            self.metrics.tenant_stored_bytes.labels(label).set(stored.total)

    async def save(self, tenant: str, record: Record, *, rejected: bool = False,
                   usage: dict | None = None) -> None:
        """Durable when this returns (in Redis or the spool); RecorderUnavailable if not.
        A record over the tenant's maximum size, or of a request its worker `rejected`
        (4xx), is stored as a bounded summary. `usage`: the answer's, whose tokens are
        charged to the tenant (with shared rates, in the record's own write)."""
        doc = record.as_dict()
        data = dumps(doc)
        state = self.limits.state(tenant)
        limit = self.limits.max_record_bytes(tenant)
        if rejected or len(data) > limit:
            reason = "rejected" if rejected else "record_too_large"
            doc = summarise(doc, reason, len(data), None if rejected else limit)
            data = dumps(doc)
            self.metrics.records_summarised.labels(reason).inc()
        tokens = usage_tokens(usage)
        rate = state.limits.tokens_per_s if tokens and self.rates is not None else None
        stored = None
        try:
            stored = await self.recorder.save(tenant, doc, data, tokens=tokens,
                                              tokens_per_s=rate)
        except RecorderUnavailable:
            self.metrics.records_failed.inc()
            raise
        finally:
            if tokens:
                if stored is None or rate is None:  # not charged with the record
                    await self._charge(tenant, tokens)
                self.metrics.count_tenant(state.label, "tokens", tokens)
        if stored is None or stored.spooled:
            self.metrics.records_spooled.inc()  # durable, not yet (all) in Redis
        else:
            self.metrics.records_stored.inc()
        if stored is not None:
            self._note_stored(tenant, state.label, stored)

    async def save_quietly(self, tenant: str, record: Record, *, rejected: bool = False) -> None:
        """For answers already (partly) sent: a failed write is counted and logged."""
        try:
            await self.save(tenant, record, rejected=rejected)
        except RecorderUnavailable:
            log.warning("record %s (%s) not stored: Redis unavailable", record.id,
                        record.status)

    async def save_refusal(self, tenant: str, record: Record) -> bool:
        """Store a refused request as a bounded summary in the tenant's refusal ring, unless
        that would take the tenant over its storage budget (or Redis is away): then it is
        only counted. True when stored."""
        state = self.limits.state(tenant)
        budget = state.limits.storage_bytes
        stored = None
        # A flood of refusals from a tenant over its budget costs neither a summary nor Redis.
        if budget is None or state.stored_bytes < budget:
            doc = record.as_dict()
            doc = summarise(doc, "refused", len(dumps(doc)))
            data = dumps(doc)
            self.metrics.records_summarised.labels("refused").inc()
            stored = await self.recorder.save_refusal(tenant, doc, data, cap=budget,
                                                      ring=self.settings.refusal_ring)
        if stored is not None:
            self._note_stored(tenant, state.label, stored)
        if stored is None or not stored.written:
            self.metrics.records_skipped.inc()
            return False
        self.metrics.records_stored.inc()
        return True


def services(request: Request) -> Services:
    return request.app.state.services


async def resolve_tenant(request: Request) -> str:
    """The caller's tenant, from its API key (401 without a valid one). FastAPI routes take it
    as a `Tenant` parameter; plain Starlette routes await it (the hot path, served by
    gateway/front.py, asks `Services.auth` itself)."""
    return services(request).auth.tenant(request.headers.get("authorization"))


Tenant = Annotated[str, Depends(resolve_tenant)]


def new_record_id(endpoint: str) -> str:
    return ("chatcmpl-" if endpoint == CHAT else "cmpl-") + secrets.token_hex(12)


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The whole body, at most `limit` bytes, read within `timeout_s` (a client that sends
    its body slowly, or not at all, holds a connection and a task: 408)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and len(declared) < 20 \
            and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    # The connection is closed after the 413 ("Connection: close"): the
                    # rest of the body is never read, however long the client sends it.
                    raise _too_large(limit)
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(f"the body did not arrive within {timeout_s:g}s") from None
    except ClientDisconnect:  # a load tool cancelling what it had started, say
        raise ClientClosed("the client left before its body arrived") from None
    return b"".join(chunks)


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the body exceeds {limit} bytes", headers={"Connection": "close"})
