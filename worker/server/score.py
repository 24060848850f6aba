"""POST /v1/score: teacher-forced logprobs of given token ids (the trainer's view)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from worker.engine.sequence import SamplingParams
from worker.errors import InvalidRequest
from worker.server.context import ServingContext
from worker.server.generation import Choice, generate, new_id
from worker.server.http import json_response, unless_disconnected
from worker.server.protocol import ScoreRequest, ScoreResponse

router = APIRouter()


@router.post("/v1/score")
async def score_route(body: ScoreRequest, request: Request):
    ctx: ServingContext = request.app.state.ctx
    logprobs = await unless_disconnected(request, score(ctx, body))
    return json_response(ScoreResponse(model=body.model, start=body.start,
                                       token_ids=body.token_ids, logprobs=logprobs,
                                       system_fingerprint=ctx.fingerprint))


async def score(ctx: ServingContext, req: ScoreRequest) -> list[float]:
    """Teacher-forced logprobs of token_ids[start:], from one prefill of the whole sequence that
    reuses no cached K/V."""
    ctx.check_model(req.model)
    if req.start >= len(req.token_ids):
        raise InvalidRequest("start must be smaller than the number of token ids", param="start")
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, single_pass=True)
    ctx.engine.validate(req.token_ids, params)
    choice = Choice(0, ctx.tokenizer, [])
    async for _ in generate(ctx, new_id("score"), req.token_ids, [params], [choice]):
        pass
    assert choice.prompt_logprobs is not None
    return [t.logprob for t in choice.prompt_logprobs[req.start - 1:]]
