"""The long-lived objects of one gateway process, created in the app's lifespan."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Coroutine
from dataclasses import dataclass, field

from fastapi import Request

from gateway.auth import Authenticator
from gateway.config import Settings
from gateway.errors import PayloadTooLarge, RecorderUnavailable, RequestTimeout
from gateway.forward import Forwarder
from gateway.interrupts import Drain, Interrupts
from gateway.metrics import Metrics
from gateway.protocol import CHAT
from gateway.recorder import Recorder
from gateway.router import Router
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
    background: set[asyncio.Task] = field(default_factory=set)

    def spawn(self, coro: Coroutine) -> None:
        """Run work that must finish even if the request that started it is cancelled."""
        task = asyncio.create_task(coro)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def save(self, tenant: str, record: dict) -> None:
        """Durable when this returns (in Redis or the spool); RecorderUnavailable if not."""
        try:
            spooled = await self.recorder.save(tenant, record)
        except RecorderUnavailable:
            self.metrics.records_failed.inc()
            raise
        (self.metrics.records_spooled if spooled else self.metrics.records_stored).inc()

    async def save_quietly(self, tenant: str, record: dict) -> None:
        """For answers already (partly) sent: a failed write is counted and logged."""
        try:
            await self.save(tenant, record)
        except RecorderUnavailable:
            log.warning("record %s (%s) not stored: Redis unavailable", record["id"],
                        record["status"])


def services(request: Request) -> Services:
    return request.app.state.services


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
