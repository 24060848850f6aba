"""From OpenAI requests to engine requests, and from engine outputs to OpenAI responses.

One request with n choices becomes n engine sequences (choice i seeded with seed + i), run
concurrently; their outputs are merged into one stream. Stop strings are matched on the
detokenised text here (the engine knows only token ids); a choice that hits one is cut there
and its sequence aborted, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from worker.engine import AsyncEngine, RequestOutput
from worker.engine_config import EngineConfig
from worker.errors import InvalidRequest
from worker.protocol import ChatCompletionRequest, CompletionRequest, ScoreRequest
from worker.sequence import SamplingParams, TokenLogprob
from worker.tokenizer import Tokenizer


@dataclass
class ServingContext:
    """The long-lived objects every handler needs (built in the app's lifespan)."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    config: EngineConfig
    model_name: str
    model_aliases: frozenset[str]
    fingerprint: str
    created: int = field(default_factory=lambda: int(time.time()))
    _token_text: dict[int, str] = field(default_factory=dict)

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def check_model(self, name: str) -> None:
        if name not in self.model_aliases:
            raise InvalidRequest(f"model {name!r} does not exist; this worker serves "
                                 f"{self.model_name!r}", param="model", code="model_not_found")

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.id_to_token(token_id)
        return text


@dataclass
class Choice:
    """One choice's generated tokens and text, with the part of the text already sent."""

    index: int
    tokenizer: Tokenizer
    stop: list[str]
    tokens: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.tokens.extend(out.new_tokens)
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text = self.tokenizer.decode([t.token_id for t in self.tokens])
        for s in self.stop:
            at = self.text.find(s)
            if at >= 0:
                self.text, self.finish_reason = self.text[:at], "stop"
        if out.finished and self.finish_reason is None:
            self.finish_reason = out.finish_reason

    def new_text(self) -> str:
        """Text not sent yet, holding back what may still change: a partial UTF-8 character,
        or the beginning of a stop string."""
        end = len(self.text)
        if self.finish_reason is None:
            end -= max((len(s) - 1 for s in self.stop), default=0)
            while end > self.sent_chars and self.text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.sent_chars:
            return ""
        out, self.sent_chars = self.text[self.sent_chars:end], end
        return out

    def new_tokens(self) -> list[TokenLogprob]:
        out, self.sent_tokens = self.tokens[self.sent_tokens:], len(self.tokens)
        return out


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
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


def prompt_ids(ctx: ServingContext, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
    if isinstance(req, ChatCompletionRequest):
        return ctx.tokenizer.encode_chat([m.as_template_input() for m in req.messages])
    return list(req.prompt) if isinstance(req.prompt, list) else ctx.tokenizer.encode(req.prompt)


def check_n(ctx: ServingContext, n: int) -> None:
    if n > ctx.config.max_n:
        raise InvalidRequest(f"n must be at most {ctx.config.max_n}", param="n")


async def generate(ctx: ServingContext, request_id: str, ids: list[int],
                   params: list[SamplingParams], choices: list[Choice]
                   ) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Run every choice's sequence; yield (choice, output) as outputs arrive. Leaving early
    (client gone, error) aborts every unfinished sequence."""
    for p in params:  # fail before anything is queued
        ctx.engine.engine.validate(ids, p)
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(choice: Choice, p: SamplingParams) -> None:
        try:
            stream = ctx.engine.generate(f"{request_id}-{choice.index}", ids, p)
            async with aclosing(stream):
                async for out in stream:
                    choice.add(out)
                    await queue.put((choice, out))
                    if choice.finish_reason is not None:
                        break  # a stop string: closing the stream aborts the sequence
        except Exception as exc:
            await queue.put((choice, exc))
        await queue.put((choice, done))

    tasks = [asyncio.create_task(pump(c, p)) for c, p in zip(choices, params, strict=True)]
    try:
        remaining = len(tasks)
        while remaining:
            choice, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield choice, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def score(ctx: ServingContext, req: ScoreRequest) -> list[float]:
    """Teacher-forced logprobs of token_ids[start:], from one prefill of the whole sequence that
    reuses no cached K/V."""
    ctx.check_model(req.model)
    if req.start >= len(req.token_ids):
        raise InvalidRequest("start must be smaller than the number of token ids", param="start")
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, single_pass=True)
    choice = Choice(0, ctx.tokenizer, [])
    async for _ in generate(ctx, new_id("score"), req.token_ids, [params], [choice]):
        pass
    assert choice.prompt_logprobs is not None
    return [t.logprob for t in choice.prompt_logprobs[req.start - 1:]]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
