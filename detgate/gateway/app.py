"""The gateway's app factory: long-lived objects live in the lifespan, on `app.state`."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI

from detgate.gateway import errors, openapi
from detgate.gateway.admission import Admission
from detgate.gateway.auth import Authenticator
from detgate.gateway.config import Settings
from detgate.gateway.discovery import Discovery, make_resolver
from detgate.gateway.forward import Forwarder
from detgate.gateway.front import Front, observed
from detgate.gateway.guard import OpenModeGuard
from detgate.gateway.interrupts import Drain, Interrupts
from detgate.gateway.limits import Limits
from detgate.gateway.metrics import Metrics, endpoint_label
from detgate.gateway.rates import SharedRates
from detgate.gateway.recorder import Recorder
from detgate.gateway.router import Router, worker_name
from detgate.gateway.routes import drift, inference, ops, records, score, ui
from detgate.gateway.services import Services
from detgate.gateway.spool import Spool
from detgate.gateway.store import Store
from detgate.gateway.upstream import Upstream

# How long a shutdown waits for the cancelled background loops (health, Redis, DNS).
WATCHERS_STOP_S = 5.0


class ObserveRequests:
    """ASGI middleware: request count and duration per endpoint, and the gateway's overhead
    (duration minus the upstream time a handler reports in `request.state.upstream_s`); it
    also puts `x-request-id` on every answer."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await observed(self.metrics, scope, endpoint_label(scope["path"]), send,
                       lambda send_marked: self.app(scope, receive, send_marked))


def create_app(settings: Settings | None = None) -> Front:
    """The gateway's ASGI application: the front (gateway/front.py) over the FastAPI app."""
    settings = settings or Settings()
    auth = Authenticator.from_pairs(settings.api_keys)
    if auth.open_mode and not settings.is_loopback():
        raise ValueError("DETGATE_API_KEYS is unset (open mode), which is allowed only on a "
                         f"loopback address, not {settings.host}")
    limits = Limits(settings.tenant_limits, settings.max_record_bytes)
    metrics = Metrics([worker_name(url) for url in settings.static_workers],
                      tuple(limits.labels))
    interrupts = Interrupts()
    drain = Drain(interrupts)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router: Router | None = None

        def reconnected(url: str) -> None:
            worker = next((w for w in router.workers if url.startswith(w.url)), None)
            if worker is not None:
                metrics.reconnects.labels(worker.name).inc()

        upstream = Upstream(connect_timeout_s=settings.connect_timeout_s,
                            keepalive_s=settings.upstream_keepalive_s,
                            progress_timeout_s=settings.progress_timeout_s,
                            on_reconnect=reconnected)
        spool = Spool(settings.spool_path, settings.spool_max_bytes)
        spool.open()
        metrics.spool_records.set_function(lambda: spool.depth)
        metrics.spool_bytes.set_function(lambda: spool.bytes)
        store = Store(settings.redis_target, timeout_s=settings.redis_timeout_s,
                      max_connections=settings.redis_max_connections,
                      wait_replicas=settings.wait_replicas,
                      wait_timeout_ms=settings.redis_wait_timeout_ms)
        recorder = Recorder(store, prefix=settings.key_prefix, ttl_s=settings.record_ttl_s,
                            retry_after_s=settings.retry_after_s, spool=spool)
        rates = SharedRates(store, recorder.keys) if settings.rate_limits == "redis" else None
        admission = Admission(queue_factor=settings.queue_factor,
                              timeout_s=settings.queue_timeout_s,
                              retry_after_s=settings.retry_after_s)
        metrics.queue_depth.set_function(lambda: admission.depth)
        router = Router(settings.static_workers, upstream, metrics, interrupts, admission,
                        labels=settings.worker_labels,
                        probe_timeout_s=max(settings.connect_timeout_s,
                                            settings.health_timeout_s),
                        default_capacity=settings.default_worker_capacity)
        forwarder = Forwarder(router, upstream, metrics, interrupts,
                              first_byte_timeout_s=settings.first_byte_timeout_s,
                              token_timeout_s=settings.token_timeout_s)
        svc = Services(settings, auth, metrics, upstream, recorder, router, forwarder,
                       interrupts, drain, limits, rates)
        app.state.services = svc
        await recorder.ping()
        watchers = [asyncio.create_task(router.watch(settings.health_interval_s)),
                    asyncio.create_task(recorder.watch(settings.health_interval_s))]
        if settings.dns_sources:
            resolver = make_resolver(settings.dns_nameservers, settings.connect_timeout_s)
            discovery = Discovery(settings.dns_sources, router, metrics, resolver,
                                  refresh_s=settings.dns_refresh_s)
            watchers.append(asyncio.create_task(discovery.watch()))
        try:
            yield
        finally:
            for task in watchers:
                task.cancel()
            # Each watcher stops at its next turn even if a library swallowed the cancellation
            # (interrupts.stopping); the wait is bounded all the same, so that a shutdown ends.
            await asyncio.wait(watchers, timeout=WATCHERS_STOP_S)
            await asyncio.gather(*svc.background, return_exceptions=True)
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
    app.include_router(drift.router)
    app.include_router(ops.router)
    app.router.routes.extend(ui.routes())
    app.router.routes.append(openapi.route())
    if auth.open_mode:
        app.add_middleware(OpenModeGuard)
    app.add_middleware(ObserveRequests, metrics=metrics)
    return Front(app, metrics, open_mode=auth.open_mode)
