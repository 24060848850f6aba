"""POST /v1/completions and /v1/chat/completions: prepare a request (all validation happens
here, before any streaming starts), then answer it whole or as SSE chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from detgate.contract.constants import prompt_logprobs_conflict
from worker.engine.sequence import SamplingParams, TokenLogprob
from worker.errors import InvalidRequest, WorkerError
from worker.server.context import ServingContext
from worker.server.generation import Choice, generate, new_id
from worker.server.http import json_response, unless_disconnected
from worker.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatResponse,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    TopLogprob,
    Usage,
)

Request = CompletionRequest | ChatCompletionRequest


router = APIRouter()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: HTTPRequest):
    return await _answer(request, body)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest):
    return await _answer(request, body)


async def _answer(request: HTTPRequest, body: Request):
    ctx: ServingContext = request.app.state.ctx
    prepared = prepare(ctx, body)
    if body.stream:
        # Starlette cancels the body iterator when the client goes away; that aborts the
        # sequences (see generation.generate).
        return StreamingResponse(stream(ctx, prepared), media_type="text/event-stream")
    return json_response(await unless_disconnected(request, respond(ctx, prepared)))


@dataclass
class Prepared:
    req: Request
    request_id: str
    prompt_ids: list[int]
    params: list[SamplingParams]
    choices: list[Choice]
    created: int

    @property
    def chat(self) -> bool:
        return isinstance(self.req, ChatCompletionRequest)


def prepare(ctx: ServingContext, req: Request) -> Prepared:
    ctx.check_model(req.model)
    check_n(ctx, req.n)
    if (conflict := prompt_logprobs_conflict(req.stream, req.prompt_logprobs)) is not None:
        raise InvalidRequest(conflict, param="prompt_logprobs")
    ids = prompt_ids(ctx, req)
    if isinstance(req, ChatCompletionRequest):
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens or ctx.max_model_len - len(ids)
        if max_tokens < 1:
            raise InvalidRequest(f"the prompt ({len(ids)} tokens) fills the context of "
                                 f"{ctx.max_model_len} tokens", param="messages",
                                 code="context_length_exceeded")
        request_id = new_id("chatcmpl")
    else:
        num_logprobs, max_tokens, request_id = req.logprobs, req.max_tokens, new_id("cmpl")
    params = [sampling_params(req, max_tokens, num_logprobs, i) for i in range(req.n)]
    for p in params:  # once per sequence, before anything is queued or sent
        ctx.engine.validate(ids, p)
    choices = [Choice(i, ctx.tokenizer, req.stop_strings) for i in range(req.n)]
    return Prepared(req, request_id, ids, params, choices, int(time.time()))


def sampling_params(req: Request, max_tokens: int,
                    num_logprobs: int | None, choice: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(req.top_k, 0),
        seed=None if req.seed is None else req.seed + choice,
        logprobs=num_logprobs,
        prompt_logprobs=req.prompt_logprobs,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
    )


def prompt_ids(ctx: ServingContext, req: Request) -> list[int]:
    if isinstance(req, ChatCompletionRequest):
        return ctx.tokenizer.encode_chat([m.as_template_input() for m in req.messages])
    return list(req.prompt) if isinstance(req.prompt, list) else ctx.tokenizer.encode(req.prompt)


def check_n(ctx: ServingContext, n: int) -> None:
    if n > ctx.config.max_n:
        raise InvalidRequest(f"n must be at most {ctx.config.max_n}", param="n")


async def respond(ctx: ServingContext, p: Prepared) -> CompletionResponse | ChatResponse:
    async for _ in generate(ctx, p.request_id, p.prompt_ids, p.params, p.choices):
        pass
    choices = [_choice(ctx, p, c, c.tokens, c.text, final=True) for c in p.choices]
    return _response(ctx, p, choices, _usage(p))


async def stream(ctx: ServingContext, p: Prepared) -> AsyncIterator[bytes]:
    """SSE events: one chunk per choice per step, a usage chunk if asked, then [DONE]."""
    try:
        if p.chat:
            first = [ChatChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))
                     for c in p.choices]
            yield _sse(_response(ctx, p, first, None))
        async for choice, _ in generate(ctx, p.request_id, p.prompt_ids, p.params, p.choices):
            tokens, text = choice.new_tokens(), choice.new_text()
            final = choice.finish_reason is not None
            if tokens or text or final:
                yield _sse(_response(ctx, p, [_choice(ctx, p, choice, tokens, text, final)], None))
        options = p.req.stream_options
        if options is not None and options.include_usage:
            yield _sse(_response(ctx, p, [], _usage(p)))
    except WorkerError as exc:
        yield _sse({"error": {"message": exc.message, "type": exc.type, "param": exc.param,
                              "code": exc.code}})
    yield b"data: [DONE]\n\n"


def _choice(ctx: ServingContext, p: Prepared, c: Choice, tokens: list[TokenLogprob], text: str,
            final: bool) -> CompletionChoice | ChatChoice:
    want_logprobs = p.params[c.index].logprobs is not None
    token_ids = [t.token_id for t in tokens] if p.req.return_token_ids else None
    finish_reason = c.finish_reason if final else None
    if p.chat:
        logprobs = _chat_logprobs(ctx, tokens) if want_logprobs else None
        body = ({"message": ChatMessageOut(content=text)} if not p.req.stream
                else {"delta": ChatDelta(content=text)})
        return ChatChoice(index=c.index, logprobs=logprobs, finish_reason=finish_reason,
                          token_ids=token_ids, **body)
    # Prompt-side fields go out once: in the response, or in a choice's first chunk.
    first_chunk = not p.req.stream or c.sent_tokens == len(tokens)
    return CompletionChoice(
        index=c.index, text=text, finish_reason=finish_reason, token_ids=token_ids,
        logprobs=_completion_logprobs(ctx, tokens) if want_logprobs else None,
        prompt_token_ids=p.prompt_ids if p.req.return_token_ids and first_chunk else None,
        prompt_logprobs=_prompt_logprobs(ctx, c.prompt_logprobs) if first_chunk else None,
    )


def _response(ctx: ServingContext, p: Prepared, choices: list, usage: Usage | None):
    common = {"id": p.request_id, "created": p.created, "model": p.req.model,
              "system_fingerprint": ctx.fingerprint, "choices": choices, "usage": usage}
    if not p.chat:
        return CompletionResponse(**common)
    if p.req.stream:
        return ChatResponse(object="chat.completion.chunk", **common)
    return ChatResponse(object="chat.completion", **common,
                        prompt_token_ids=p.prompt_ids if p.req.return_token_ids else None,
                        prompt_logprobs=_prompt_logprobs(ctx, p.choices[0].prompt_logprobs))


def _usage(p: Prepared) -> Usage:
    completion = sum(len(c.tokens) for c in p.choices)
    cached = max(c.num_cached_tokens for c in p.choices)
    return Usage(prompt_tokens=len(p.prompt_ids), completion_tokens=completion,
                 total_tokens=len(p.prompt_ids) + completion,
                 prompt_tokens_details={"cached_tokens": cached})


def _completion_logprobs(ctx: ServingContext, tokens: list[TokenLogprob]) -> CompletionLogprobs:
    out = CompletionLogprobs()
    offset = 0
    for t in tokens:
        text = ctx.token_text(t.token_id)
        out.tokens.append(text)
        out.token_logprobs.append(t.logprob)
        out.top_logprobs.append({ctx.token_text(i): lp for i, lp in t.top} if t.top else None)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _chat_logprobs(ctx: ServingContext, tokens: list[TokenLogprob]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = ctx.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    return ChatLogprobs(content=[
        ChatTokenLogprob(**top(t.token_id, t.logprob).model_dump(),
                         top_logprobs=[top(i, lp) for i, lp in t.top])
        for t in tokens
    ])


def _prompt_logprobs(ctx: ServingContext, lps: list[TokenLogprob] | None
                     ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's shape: None for the first token, then {token_id: {logprob, rank, decoded_token}}
    holding the prompt token and the top alternatives."""
    if lps is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for t in lps:
        entry = {str(t.token_id): {"logprob": t.logprob, "rank": t.rank,
                                   "decoded_token": ctx.token_text(t.token_id)}}
        for rank, (i, lp) in enumerate(t.top, start=1):
            entry.setdefault(str(i), {"logprob": lp, "rank": rank,
                                      "decoded_token": ctx.token_text(i)})
        out.append(entry)
    return out


def _sse(body: Any) -> bytes:
    if hasattr(body, "model_dump"):
        body = body.model_dump(exclude_none=True)
    return b"data: " + orjson.dumps(body) + b"\n\n"
