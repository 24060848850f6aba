"""The long-lived objects of one gateway process, created in the app's lifespan."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request

from detgate.contract.record import Record
from gateway.auth import Authenticator
from gateway.config import Settings
from gateway.errors import (
    PayloadTooLarge,
    RateLimited,
    RecorderUnavailable,
    RequestTimeout,
)
from gateway.forward import Forwarder
from gateway.interrupts import Drain, Interrupts
from gateway.limits import UNNAMED, Limits
from gateway.metrics import Metrics
from gateway.protocol import CHAT
from gateway.recorder import Recorder, dumps
from gateway.router import Router
from gateway.summary import summarise
from gateway.upstream import Upstream

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
    background: set[asyncio.Task] = field(default_factory=set)

    def spawn(self, coro: Coroutine) -> None:
        """Run work that must finish even if the request that started it is cancelled."""
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def admit(self, tenant: str, *, stores: bool = True) -> None:
        """Let a request in, or raise RateLimited (counted per tenant either way)."""
        label = self.limits.state(tenant).label
        if stores and self.limits.needs_storage_figure(tenant) and self.recorder.up:
            try:
                stored = await self.recorder.stored(tenant)
            except RecorderUnavailable:
                pass  # checked against the last figure; the record goes to the spool
            else:
                self._note_stored(tenant, label, stored)
        try:
            self.limits.admit(tenant, stores=stores)
        except RateLimited as exc:
            self.metrics.count_tenant(label, exc.code)
            raise
        self.metrics.count_tenant(label, "admitted")

    def charge_tokens(self, tenant: str, usage: dict | None) -> None:
        tokens = self.limits.charge_tokens(tenant, usage)
        if tokens:
            self.metrics.count_tenant(self.limits.state(tenant).label, "tokens", tokens)

    def _note_stored(self, tenant: str, label: str, stored) -> None:
        self.limits.note_storage(tenant, stored.total, stored.frees_in_s)
        if label != UNNAMED:  # a total shared by unnamed tenants would mean nothing
            self.metrics.tenant_stored_bytes.labels(label).set(stored.total)

    async def save(self, tenant: str, record: Record, *, refused: bool = False) -> None:
        """Durable when this returns (in Redis or the spool); RecorderUnavailable if not.
        A refused request's record, or one over the tenant's maximum size, is stored as a
        bounded summary."""
        doc = record.as_dict()
        data = dumps(doc)
        limit = self.limits.max_record_bytes(tenant)
        if refused or len(data) > limit:
            reason = "refused" if refused else "record_too_large"
            doc = summarise(doc, reason, len(data), None if refused else limit)
            data = dumps(doc)
            self.metrics.records_summarised.labels(reason).inc()
        try:
            stored = await self.recorder.save(tenant, doc, data)
        except RecorderUnavailable:
            self.metrics.records_failed.inc()
            raise
        if stored is None:
            self.metrics.records_spooled.inc()  # durable, not yet in Redis
        else:
            self.metrics.records_stored.inc()
            self._note_stored(tenant, self.limits.state(tenant).label, stored)

    async def save_quietly(self, tenant: str, record: Record, *, refused: bool = False) -> None:
        """For answers already (partly) sent: a failed write is counted and logged."""
        try:
            await self.save(tenant, record, refused=refused)
        except RecorderUnavailable:
            log.warning("record %s (%s) not stored: Redis unavailable", record.id,
                        record.status)


def services(request: Request) -> Services:
    return request.app.state.services


async def resolve_tenant(request: Request) -> str:
    """The caller's tenant, from its API key (401 without a valid one). FastAPI routes take it
    as a `Tenant` parameter; the plain Starlette routes of the hot path await it."""
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
        raise PayloadTooLarge(f"the body exceeds {limit} bytes")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"the body exceeds {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(f"the body did not arrive within {timeout_s:g}s") from None
    return b"".join(chunks)
