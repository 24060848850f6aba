"""`POST /v1/drift` (run a drift report on the caller's records), `GET /v1/drift` (the last)."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from detgate.gateway import drift, protocol
from detgate.gateway.errors import NotFound
from detgate.gateway.services import Tenant, read_body, services

router = APIRouter()


def _json(obj: dict) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")


@router.post("/v1/drift")
async def run_drift(request: Request, tenant: Tenant) -> Response:
    svc = services(request)
    raw = await read_body(request, svc.settings.max_body_bytes, svc.settings.body_timeout_s)
    return _json(await drift.run(svc, tenant, protocol.parse_drift(raw, svc.settings)))


@router.get("/v1/drift")
async def last_drift(request: Request, tenant: Tenant) -> Response:
    report = await drift.last(services(request), tenant)
    if report is None:
        raise NotFound("no drift report yet: POST /v1/drift makes one")
    return _json(report)
