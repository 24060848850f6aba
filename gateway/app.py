"""The gateway's app factory: long-lived objects live in the lifespan, on `app.state`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI

from gateway import errors, openapi
from gateway.auth import Authenticator
from gateway.config import Settings
from gateway.forward import Forwarder
from gateway.guard import OpenModeGuard
from gateway.interrupts import Drain, Interrupts
from gateway.limits import Limits
from gateway.metrics import Metrics, endpoint_label
from gateway.recorder import Recorder
from gateway.router import Router, worker_name
from gateway.routes import inference, ops, records, score, ui
from gateway.services import Services
from gateway.spool import Spool
from gateway.upstream import Upstream


class ObserveRequests:
    """ASGI middleware: request count and duration per endpoint, and the gateway's overhead
    (duration minus the upstream time a handler reports in `request.state.upstream_s`)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        state = scope.setdefault("state", {})
        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.observe_request(endpoint_label(scope["path"]), status,
                                         time.perf_counter() - t0, state.get("upstream_s"))


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    auth = Authenticator.from_pairs(settings.api_keys)
    if auth.open_mode and not settings.is_loopback():
        raise ValueError("DETGATE_API_KEYS is unset (open mode), which is allowed only on a "
                         f"loopback address, not {settings.host}")
    limits = Limits(settings.tenant_limits, settings.max_record_bytes)
    metrics = Metrics([worker_name(url) for url in settings.workers], tuple(limits.labels))
    interrupts = Interrupts()
    drain = Drain(interrupts)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        upstream = Upstream(connect_timeout_s=settings.connect_timeout_s)
        spool = Spool(settings.spool_path, settings.spool_max_bytes)
        spool.open()
        metrics.spool_records.set_function(lambda: spool.depth)
        metrics.spool_bytes.set_function(lambda: spool.bytes)
        recorder = Recorder(settings.redis_url, prefix=settings.key_prefix,
                            ttl_s=settings.record_ttl_s, timeout_s=settings.redis_timeout_s,
                            retry_after_s=settings.retry_after_s, spool=spool)
        router = Router(settings.workers, upstream, metrics, interrupts,
                        labels=settings.worker_labels,
                        probe_timeout_s=max(settings.connect_timeout_s,
                                            settings.health_timeout_s))
        forwarder = Forwarder(router, upstream, metrics, interrupts,
                              attempt_timeout_s=settings.attempt_timeout_s,
                              first_byte_timeout_s=settings.first_byte_timeout_s)
        svc = Services(settings, auth, metrics, upstream, recorder, router, forwarder,
                       interrupts, drain, limits)
        app.state.services = svc
        await recorder.ping()
        watchers = [asyncio.create_task(router.watch(settings.health_interval_s)),
                    asyncio.create_task(recorder.watch(settings.health_interval_s))]
        try:
            yield
        finally:
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, *svc.background, return_exceptions=True)
            await upstream.close()
            await recorder.close()

    app = FastAPI(title="detgate gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.drain = drain  # serve.py begins it on SIGTERM
    # `/v1/chat/completions/` is a 404, not a redirect built from the client's Host header.
    app.router.redirect_slashes = False
    errors.install(app)
    app.router.routes.extend(inference.routes)
    app.router.routes.extend(score.routes)
    app.include_router(records.router)
    app.include_router(ops.router)
    app.router.routes.extend(ui.routes())
    app.router.routes.append(openapi.route())
    if auth.open_mode:
        app.add_middleware(OpenModeGuard)
    app.add_middleware(ObserveRequests, metrics=metrics)
    return app
