"""POST /v1/completions and /v1/chat/completions: prepare a request (all validation happens
here, before any streaming starts), then answer it whole or as SSE chunks.

A completions request may hold several prompts (vLLM's and OpenAI's lists); choice
`i * n + j` is prompt i's j-th, seeded with seed + i * n + j. A structured request (a
`response_format`, `tools`) is compiled into a grammar here (in a thread: the first compile
imports the grammar library), and each of its sequences is generated under that grammar's
mask (engine/constraint.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from detgate.contract.constants import prompt_logprobs_conflict
from detgate.worker.engine.sequence import SamplingParams, TokenLogprob
from detgate.worker.errors import InvalidRequest, WorkerError
from detgate.worker.server import answers, structured
from detgate.worker.server.abort import REQUEST_ID_HEADER
from detgate.worker.server.context import ServingContext
from detgate.worker.server.generation import Choice, Generation, new_id
from detgate.worker.server.http import Stopped, json_response, unless_disconnected
from detgate.worker.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageOut,
    ChatResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    FunctionCall,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from detgate.worker.server.structured import Structure

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
    prepared = await prepare(ctx, body)
    if body.stream:
        # Starlette cancels the body iterator when the client goes away; that aborts the
        # sequences (see generation.Generation).
        return StreamingResponse(stream(ctx, prepared), media_type="text/event-stream")
    request_id = request.headers.get(REQUEST_ID_HEADER)
    stop = ctx.aborts.register(request_id) if request_id else None
    try:
        gen = Generation(ctx, prepared.request_id, prepared.params, prepared.choices)
        await unless_disconnected(request, run(gen), stop)
    except Stopped:
        prepared.stopped()
    finally:
        if request_id:
            ctx.aborts.discard(request_id)
    return json_response(respond(ctx, prepared, gen.fingerprint))


@dataclass
class Prepared:
    req: Request
    request_id: str
    params: list[SamplingParams]
    choices: list[Choice]
    created: int
    structure: Structure
    prompt_texts: list[str | None]  # completions' text prompts, as given (echo)

    @property
    def chat(self) -> bool:
        return isinstance(self.req, ChatCompletionRequest)

    @property
    def num_prompt_tokens(self) -> int:
        n = self.req.n
        return sum(len(c.prompt_ids) for c in self.choices[::n])

    def stopped(self) -> None:
        """Stopped on request (/abort_request): the choices still running end here."""
        for c in self.choices:
            c.finish_reason = c.finish_reason or "abort"



async def prepare(ctx: ServingContext, req: Request) -> Prepared:
    ctx.check_model(req.model)
    if (conflict := prompt_logprobs_conflict(req.stream, req.prompt_logprobs)) is not None:
        raise InvalidRequest(conflict, param="prompt_logprobs")
    chat = isinstance(req, ChatCompletionRequest)
    if not chat and req.echo and req.stream:
        raise InvalidRequest("'echo' is not available when streaming", param="echo")
    texts: list[str | None] = [None] if chat else [p if isinstance(p, str) else None
                                                   for p in req.prompts]
    check_n(ctx, req.n * len(texts))
    prompts = [prompt_ids(ctx, req)] if chat else [
        ctx.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in req.prompts]
    struct = await _structure(ctx, req)
    stop_ids = tuple(req.stop_token_ids or ()) + (() if req.ignore_eos else ctx.eos_token_ids)
    constraint = structured.constraint(struct.grammar, req.min_tokens, stop_ids)
    params, choices = [], []
    for i, ids in enumerate(prompts):
        max_tokens, num_logprobs = _lengths(ctx, req, ids)
        for j in range(req.n):
            index = i * req.n + j
            params.append(sampling_params(req, max_tokens, num_logprobs, index, constraint))
            choices.append(Choice(index, ctx.tokenizer, req.stop_strings, prompt_ids=ids,
                                  skip_special_tokens=req.skip_special_tokens,
                                  include_stop=req.include_stop_str_in_output,
                                  min_tokens=req.min_tokens))
    for c, p in zip(choices, params, strict=True):  # before anything is queued or sent
        ctx.engine.validate(c.prompt_ids, p)
    request_id = new_id("chatcmpl" if chat else "cmpl")
    return Prepared(req, request_id, params, choices, int(time.time()), struct, texts)


async def _structure(ctx: ServingContext, req: Request) -> Structure:
    tools = getattr(req, "tools", None)
    choice = getattr(req, "tool_choice", None)
    if req.response_format is None and not tools and choice is None:
        return Structure(None, None)
    return await asyncio.to_thread(structured.structure, ctx.grammar, req.response_format,
                                   tools, choice, getattr(req, "parallel_tool_calls", True))


def _lengths(ctx: ServingContext, req: Request, ids: list[int]) -> tuple[int, int | None]:
    """(max_tokens, logprobs count) of one prompt's choices."""
    if not isinstance(req, ChatCompletionRequest):
        return req.max_tokens, req.logprobs
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens or req.max_tokens or ctx.max_model_len - len(ids)
    if max_tokens < 1:
        raise InvalidRequest(f"the prompt ({len(ids)} tokens) fills the context of "
                             f"{ctx.max_model_len} tokens", param="messages",
                             code="context_length_exceeded")
    return max_tokens, num_logprobs


def sampling_params(req: Request, max_tokens: int, num_logprobs: int | None, choice: int,
                    constraint=None) -> SamplingParams:
    prompt_logprobs = req.prompt_logprobs
    if getattr(req, "echo", False) and num_logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, num_logprobs)  # the echoed prompt's
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(req.top_k, 0),
        seed=None if req.seed is None else req.seed + choice,
        logprobs=num_logprobs,
        prompt_logprobs=prompt_logprobs,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        constraint=constraint,
    )


def prompt_ids(ctx: ServingContext, req: ChatCompletionRequest) -> list[int]:
    extra = {"tools": [t.model_dump(exclude_none=True) for t in req.tools]} if req.tools else {}
    return ctx.tokenizer.encode_chat([m.as_template_input() for m in req.messages], **extra)


def check_n(ctx: ServingContext, n: int) -> None:
    if n > ctx.config.max_n:
        raise InvalidRequest(f"n times the number of prompts must be at most {ctx.config.max_n}",
                             param="n")


async def run(gen: Generation) -> None:
    """Generate every choice to its end (the choices collect the tokens as they come)."""
    async with gen:
        async for _ in gen:
            pass


def respond(ctx: ServingContext, p: Prepared, fingerprint: str
            ) -> CompletionResponse | ChatResponse:
    """The whole answer: what the choices hold (all of it, or what came before a stop), and
    the fingerprint of the weights they ran on."""
    choices = [_whole_choice(ctx, p, c) for c in p.choices]
    return _response(ctx, p, choices, _usage(p), fingerprint)


async def stream(ctx: ServingContext, p: Prepared) -> AsyncIterator[bytes]:
    """SSE events: one chunk per choice per step (with usage when continuous_usage_stats),
    a usage chunk if asked, then [DONE]."""
    options = p.req.stream_options
    continuous = options is not None and options.include_usage and options.continuous_usage_stats
    try:
        async with Generation(ctx, p.request_id, p.params, p.choices) as gen:
            fingerprint = gen.fingerprint
            if p.chat:
                first = [ChatChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))
                         for c in p.choices]
                yield _sse(_response(ctx, p, first, _usage(p) if continuous else None,
                                     fingerprint))
            async for choice, _ in gen:
                for out in _chunk_choices(ctx, p, choice):
                    yield _sse(_response(ctx, p, [out], _usage(p) if continuous else None,
                                         fingerprint))
        if options is not None and options.include_usage:
            yield _sse(_response(ctx, p, [], _usage(p), fingerprint))
    except WorkerError as exc:
        yield _sse({"error": {"message": exc.message, "type": exc.type, "param": exc.param,
                              "code": exc.code}})
    yield b"data: [DONE]\n\n"


# -- choices ---------------------------------------------------------------------------------


def _whole_choice(ctx: ServingContext, p: Prepared, c: Choice) -> CompletionChoice | ChatChoice:
    want_logprobs = p.params[c.index].logprobs is not None
    token_ids = [t.token_id for t in c.tokens] if p.req.return_token_ids else None
    if not p.chat:
        return _completion_choice(ctx, p, c, c.tokens, c.text, c.finish_reason, first=True)
    content, calls = c.text, []
    mode = p.structure.tools
    if mode is not None:
        content, calls = structured.tool_calls(mode, c.text, _call_id(p, c))
    message = ChatMessageOut(content=content,
                             tool_calls=[ToolCall(**call) for call in calls] or None)
    return ChatChoice(index=c.index, message=message, token_ids=token_ids,
                      logprobs=answers.chat_logprobs(ctx, c.tokens) if want_logprobs else None,
                      finish_reason=_finish_reason(c.finish_reason, calls))


def _chunk_choices(ctx: ServingContext, p: Prepared, c: Choice) -> list:
    """This step's chunk(s) for one choice (none when nothing new can be sent)."""
    tokens = c.new_tokens()
    final = c.finish_reason is not None
    if not p.chat:
        first = c.sent_tokens == len(tokens)
        text = c.new_text()
        if not (tokens or text or final):
            return []
        return [_completion_choice(ctx, p, c, tokens, text, c.finish_reason if final else None,
                                   first)]
    mode = p.structure.tools
    content_end = len(structured.streamed_content(mode, c.text[:c.settled_end()]))
    delta = ChatDelta(content=c.new_text(content_end))
    calls: list[dict] = []
    if mode is not None and mode.kind == "named":
        delta = _named_call_delta(p, c)
    elif mode is not None and final:
        content, calls = structured.tool_calls(mode, c.text, _call_id(p, c))
        if not calls:  # all of it was content after all
            delta.content = (delta.content or "") + c.new_text(len(c.text))
        delta.tool_calls = [ToolCallDelta(index=i, id=call["id"], type="function",
                                          function=FunctionCall(**call["function"]))
                            for i, call in enumerate(calls)] or None
    if not (tokens or delta.content or delta.tool_calls or final):
        return []
    want_logprobs = p.params[c.index].logprobs is not None
    return [ChatChoice(index=c.index, delta=delta,
                       token_ids=[t.token_id for t in tokens] if p.req.return_token_ids else None,
                       logprobs=answers.chat_logprobs(ctx, tokens) if want_logprobs else None,
                       finish_reason=_finish_reason(c.finish_reason, calls or
                                                    (mode is not None and mode.kind == "named"))
                       if final else None)]


def _named_call_delta(p: Prepared, c: Choice) -> ChatDelta:
    """A named call streams its arguments as they come; its first delta carries id and name."""
    opening = c.sent_chars == 0 and not c.opened
    c.opened = True
    name = p.structure.tools.name
    call = ToolCallDelta(index=0, function=FunctionCall(arguments=c.new_text()))
    if opening:
        call.id, call.type, call.function.name = f"{_call_id(p, c)}-0", "function", name
    return ChatDelta(tool_calls=[call])


def _completion_choice(ctx: ServingContext, p: Prepared, c: Choice, tokens: list[TokenLogprob],
                       text: str, finish_reason: str | None, first: bool) -> CompletionChoice:
    """`first`: the choice's first chunk (or the whole answer), which carries the
    prompt-side fields and, with `echo`, the prompt itself."""
    want_logprobs = p.params[c.index].logprobs is not None
    echoed: list[TokenLogprob] = []
    if first and p.req.echo:
        prompt = p.prompt_texts[c.index // p.req.n]
        echo_text = prompt if prompt is not None else ctx.tokenizer.decode(c.prompt_ids)
        text = echo_text + text
        echoed = answers.echoed_prompt(c.prompt_ids, c.prompt_logprobs)
    return CompletionChoice(
        index=c.index, text=text, finish_reason=finish_reason,
        token_ids=[t.token_id for t in tokens] if p.req.return_token_ids else None,
        logprobs=answers.completion_logprobs(ctx, tokens, echoed) if want_logprobs else None,
        prompt_token_ids=c.prompt_ids if p.req.return_token_ids and first else None,
        prompt_logprobs=(answers.prompt_logprobs(ctx, c.prompt_logprobs)
                         if first and p.req.prompt_logprobs is not None else None),
    )


def _finish_reason(reason: str | None, calls: Any) -> str | None:
    """An answer that ends in tool calls says so (OpenAI's "tool_calls")."""
    return "tool_calls" if calls and reason == "stop" else reason


def _call_id(p: Prepared, c: Choice) -> str:
    return f"call_{p.request_id.rpartition('-')[2][:24]}_{c.index}"


def _response(ctx: ServingContext, p: Prepared, choices: list, usage: Usage | None,
              fingerprint: str):
    """`fingerprint`: the one the request's sequences were submitted under (Generation)."""
    common = {"id": p.request_id, "created": p.created, "model": p.req.model,
              "system_fingerprint": fingerprint, "choices": choices, "usage": usage}
    if not p.chat:
        return CompletionResponse(**common)
    if p.req.stream:
        return ChatResponse(object="chat.completion.chunk", **common)
    first = p.choices[0]
    plp = answers.prompt_logprobs(ctx, first.prompt_logprobs) \
        if p.req.prompt_logprobs is not None else None
    return ChatResponse(object="chat.completion", **common, prompt_logprobs=plp,
                        prompt_token_ids=first.prompt_ids if p.req.return_token_ids else None)


def _usage(p: Prepared) -> Usage:
    completion = sum(len(c.tokens) for c in p.choices)
    cached = max(c.num_cached_tokens for c in p.choices)
    prompt = p.num_prompt_tokens
    return Usage(prompt_tokens=prompt, completion_tokens=completion,
                 total_tokens=prompt + completion,
                 prompt_tokens_details={"cached_tokens": cached})


def _sse(body: Any) -> bytes:
    if hasattr(body, "model_dump"):
        body = body.model_dump(exclude_none=True)
    return b"data: " + orjson.dumps(body) + b"\n\n"
