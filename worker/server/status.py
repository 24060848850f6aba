"""GET /health, /metrics and /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from worker.server.context import ServingContext
from worker.server.http import json_response
from worker.server.protocol import ModelCard, ModelList

router = APIRouter()


@router.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    return json_response(ModelList(data=[ModelCard(id=ctx.model_name, created=ctx.created,
                                                   max_model_len=ctx.max_model_len)]))
