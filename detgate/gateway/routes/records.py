"""`GET /v1/requests/{id}`, `GET /v1/requests`, `POST /replay/{id}`: the caller's own records."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from detgate.contract.constants import STATUSES
from detgate.gateway import protocol
from detgate.gateway.errors import BadRequest, NotFound
from detgate.gateway.replay import replay
from detgate.gateway.services import Tenant, read_body, services

router = APIRouter()


def _json(obj: dict) -> Response:
    return Response(orjson.dumps(obj), media_type="application/json")


@router.get("/v1/requests/{record_id}")
async def get_record(record_id: str, request: Request, tenant: Tenant) -> Response:
    found = await services(request).recorder.get(tenant, record_id)
    if found is None:
        raise NotFound(f"no record '{record_id}'", param="id")
    return _json(found[0])


_REPLAY_RESULTS = ("match", "diverged", "none")


def _last_replay_result(record: dict) -> str:
    replays = record["replays"]
    if not replays:
        return "none"
    return "match" if replays[-1]["match"] else "diverged"


@router.get("/v1/requests")
async def list_records(request: Request, tenant: Tenant) -> Response:
    """Newest first, OpenAI-style paging: `after=<last_id>` gives the next page; filters
    `status` (complete, aborted, failed) and `replay` (the last replay's result: match,
    diverged, none)."""
    query = request.query_params
    raw = query.get("limit", "20")
    # ASCII digits only, and few of them: str.isdigit() accepts '²' and '١', which int()
    # refuses or reads, and int() refuses strings of more than 4,300 digits.
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 4) or not 1 <= int(raw) <= 1000:
        raise BadRequest("'limit' must be an integer from 1 to 1000", param="limit")
    status, result = query.get("status"), query.get("replay")
    if status is not None and status not in STATUSES:
        raise BadRequest(f"'status' must be one of {', '.join(STATUSES)}", param="status")
    if result is not None and result not in _REPLAY_RESULTS:
        raise BadRequest(f"'replay' must be one of {', '.join(_REPLAY_RESULTS)}",
                         param="replay")
    keep = None
    if status is not None or result is not None:
        def keep(record: dict) -> bool:
            return ((status is None or record["status"] == status)
                    and (result is None or _last_replay_result(record) == result))
    after = query.get("after") or None
    page = await services(request).recorder.list(tenant, int(raw), after=after, keep=keep)
    if page is None:
        raise BadRequest(f"'after' names no record of yours: '{after}'", param="after")
    return _json({"object": "list", "data": page.data,
                  "first_id": page.data[0]["id"] if page.data else None,
                  "last_id": page.last_id, "has_more": page.has_more})


@router.post("/replay/{record_id}")
async def replay_record(record_id: str, request: Request, tenant: Tenant) -> Response:
    svc = services(request)
    raw = await read_body(request, svc.settings.max_body_bytes, svc.settings.body_timeout_s)
    load = protocol.parse_replay(raw, svc.settings)
    await svc.admit(tenant)  # a replay is a request: the tenant's rates and storage budget
    return _json(await replay(svc, tenant, record_id, load))
