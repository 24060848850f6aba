"""`GET /v1/models`, `/metrics`, `/healthz`, `/readyz`."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Depends, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from gateway.services import resolve_tenant, services

router = APIRouter()


@router.get("/v1/models", dependencies=[Depends(resolve_tenant)])
async def models(request: Request) -> Response:
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "detgate"}
            for m in services(request).router.models()]
    return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(services(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz")
async def healthz() -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    svc = services(request)
    redis_ok = await svc.recorder.ping()
    # Records can be stored: in Redis, or in the spool while Redis is away.
    records_ok = svc.recorder.can_record()
    ready = records_ok and svc.router.any_up()
    spool = svc.recorder.spool
    body = {"status": "ready" if ready else "not ready", "redis": redis_ok,
            "spool": {"records": spool.depth, "bytes": spool.bytes,
                      "max_bytes": spool.max_bytes, "usable": spool.has_room()},
            "workers_up": sum(w.up for w in svc.router.workers)}
    return Response(orjson.dumps(body), status_code=200 if ready else 503,
                    media_type="application/json")
