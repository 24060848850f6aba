"""`GET /v1/models`, `/metrics`, `/healthz`, `/readyz`, and `/health` as vLLM's (200 with an
empty body when ready, which load tools such as guidellm check before they start)."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from detgate.gateway.router import Worker
from detgate.gateway.services import resolve_tenant, services

router = APIRouter()


@router.get("/v1/models", dependencies=[Depends(resolve_tenant)])
async def models(request: Request) -> Response:
    """OpenAI's list, each model with the fingerprints of the healthy workers serving it and
    their machines (`system_fingerprints`: [{"system_fingerprint", "machine"}]; a record
    replays on any worker of its fingerprint, whatever its machine)."""
    router = services(request).router
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "detgate",
             "system_fingerprints": _fingerprints(router.workers, m)}
            for m in router.models()]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


def _fingerprints(workers: list[Worker], model: str) -> list[dict]:
    """Each (fingerprint, machine) pair once, no worker URL."""
    seen: dict[bytes, dict] = {}
    for w in workers:
        if w.up and model in w.models:
            entry = {"system_fingerprint": w.fingerprint, "machine": w.machine}
            seen.setdefault(orjson.dumps(entry, option=orjson.OPT_SORT_KEYS), entry)
    return list(seen.values())


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(services(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz")
async def healthz() -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


def _ready(svc) -> bool:
    """A request sent now would be served: records can be stored (in Redis, or in the spool
    while Redis is away, with room for a record), a worker is healthy, and the gateway is not
    shutting down."""
    return svc.recorder.can_record() and svc.router.any_up() and not svc.drain.draining


@router.get("/health")
async def health(request: Request) -> Response:
    svc = services(request)
    await svc.recorder.ping()
    return Response(status_code=200 if _ready(svc) else 503)


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    svc = services(request)
    redis_ok = await svc.recorder.ping()
    ready = _ready(svc)
    spool = svc.recorder.spool
    body = {"status": "ready" if ready else "not ready", "redis": redis_ok,
            "spool": {"records": spool.depth, "bytes": spool.bytes,
                      "max_bytes": spool.max_bytes, "usable": spool.has_room()},
            "workers_up": sum(w.up for w in svc.router.workers),
            "draining": svc.drain.draining, "queued": svc.router.admission.depth}
    return Response(orjson.dumps(body), status_code=200 if ready else 503,
                    media_type="application/json")
