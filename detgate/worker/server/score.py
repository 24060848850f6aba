"""POST /v1/score: teacher-forced logprobs of given token ids (the trainer's view)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from detgate.worker.engine.sequence import SamplingParams
from detgate.worker.errors import InvalidRequest
from detgate.worker.server import structured
from detgate.worker.server.context import ServingContext
from detgate.worker.server.generation import Choice, Generation, new_id
from detgate.worker.server.http import json_response, unless_disconnected
from detgate.worker.server.protocol import ScoreRequest, ScoreResponse

router = APIRouter()


@router.post("/v1/score")
async def score_route(body: ScoreRequest, request: Request):
    ctx: ServingContext = request.app.state.ctx
    logprobs, fingerprint = await unless_disconnected(request, score(ctx, body))
    return json_response(ScoreResponse(model=body.model, start=body.start,
                                       token_ids=body.token_ids, logprobs=logprobs,
                                       system_fingerprint=fingerprint))


async def score(ctx: ServingContext, req: ScoreRequest) -> tuple[list[float], str]:
    """Teacher-forced logprobs of token_ids[start:], from one prefill of the whole sequence that
    reuses no cached K/V; under the request's masks from `start` on, if it has any (a token
    the mask rules out scores -inf, written as null); and the fingerprint of the weights they
    came from."""
    ctx.check_model(req.model)
    if req.start >= len(req.token_ids):
        raise InvalidRequest("start must be smaller than the number of token ids", param="start")
    struct = structured.Structure(None, None)
    if req.response_format is not None or req.tools or req.tool_choice is not None:
        struct = await asyncio.to_thread(structured.structure, ctx.grammar, req.response_format,
                                         req.tools, req.tool_choice, req.parallel_tool_calls)
    stop_ids = tuple(req.stop_token_ids or ()) + (() if req.ignore_eos else ctx.eos_token_ids)
    constraint = structured.constraint(struct.grammar, req.min_tokens, stop_ids)
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, single_pass=True,
                            constraint=constraint, score_start=req.start)
    ctx.engine.validate(req.token_ids, params)
    choice = Choice(0, ctx.tokenizer, [], prompt_ids=req.token_ids)
    async with Generation(ctx, new_id("score"), [params], [choice]) as gen:
        async for _ in gen:
            pass
    assert choice.prompt_logprobs is not None
    return [t.logprob for t in choice.prompt_logprobs[req.start - 1:]], gen.fingerprint
