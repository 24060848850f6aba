"""GET /health, /metrics and /v1/models.

The model card advertises, beside vLLM's `max_model_len`, what a gateway checks requests
against before it forwards them: the vocabulary size, the most characters one token adds to
a text, the parameters this worker refuses when set, and `max_num_seqs`, the sequences the
engine runs at once (a gateway sends no more); and the `system_fingerprint` with what it hashes
(`numerics`) and the `machine` beside it (worker/model/numerics.py says which is which).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from detgate.contract.constants import FINGERPRINT_HEADER
from detgate.contract.sampling import UNSUPPORTED
from detgate.worker.server.context import ServingContext, numerics
from detgate.worker.server.http import json_response
from detgate.worker.server.protocol import ModelCard, ModelList

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine serves, with the fingerprint of the weights it serves now in a
    header (how the gateway follows weight updates); 503 once its loop stopped or a step has
    run longer than the stall timeout (hung: the gateway ejects the worker on this, never on
    slowness)."""
    ctx: ServingContext = request.app.state.ctx
    problem = ctx.engine.problem(ctx.stall_timeout_s)
    if problem is not None:
        return json_response({"error": {"message": problem, "type": "service_unavailable",
                                        "param": None, "code": "engine_unhealthy"}}, 503)
    return Response(status_code=200, headers={FINGERPRINT_HEADER: ctx.fingerprint})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/v1/models")
async def models(request: Request) -> Response:
    ctx: ServingContext = request.app.state.ctx
    return json_response(ModelList(data=[ModelCard(
        id=ctx.model_name, created=ctx.created, max_model_len=ctx.max_model_len,
        vocab_size=ctx.engine.vocab_size, max_token_chars=ctx.max_token_chars,
        max_num_seqs=ctx.config.max_num_seqs,
        unsupported_parameters=sorted(UNSUPPORTED), system_fingerprint=ctx.fingerprint,
        numerics=numerics(ctx.fingerprint_parts), machine=ctx.machine)]))
