"""From OpenAI requests to engine requests, and from engine outputs to OpenAI responses.

One request with n choices becomes n engine sequences (choice i seeded with seed + i), run
concurrently; their outputs are merged into one stream (n = 1 needs no merging). Text is
detokenised incrementally (each step decodes only the tokens since the last complete
character, so a completion costs O(length) decoding) and stop strings are matched on it here
(the engine knows only token ids); a choice that hits one is cut there and its sequence
aborted, which frees its blocks.
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
class Detokenizer:
    """The text of a growing token sequence, decoded a window at a time.

    Tokens before `read` are in the text already; the window starts one step earlier, at
    `prefix`, so that decoding it and the settled part [prefix, read) and taking the
    difference gives exactly what the new tokens add (a tokenizer may spell a token
    differently at the start of a decode). Text ending in U+FFFD, an incomplete UTF-8
    character, waits for the next tokens; the window then grows until it completes.
    """

    tokenizer: Tokenizer
    ids: list[int] = field(default_factory=list)
    prefix: int = 0
    read: int = 0

    def add(self, new_ids: list[int], final: bool) -> str:
        """The text `new_ids` add (with `final`, whatever is left, complete or not)."""
        self.ids.extend(new_ids)
        settled = self.tokenizer.decode(self.ids[self.prefix:self.read])
        window = self.tokenizer.decode(self.ids[self.prefix:])
        if not final and (len(window) <= len(settled) or window.endswith("\ufffd")):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(settled):]


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
    detokenizer: Detokenizer = field(init=False)

    def __post_init__(self) -> None:
        self.detokenizer = Detokenizer(self.tokenizer)

    def add(self, out: RequestOutput) -> None:
        self.tokens.extend(out.new_tokens)
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        checked = len(self.text)
        self.text += self.detokenizer.add([t.token_id for t in out.new_tokens], out.finished)
        # The text before `checked` held no stop string: a new one ends in the added part.
        hits = [at for s in self.stop if (at := self.text.find(s, max(0, checked - len(s) + 1)))
                >= 0]
        if hits:
            self.text, self.finish_reason = self.text[:min(hits)], "stop"
        if out.finished and self.finish_reason is None:
            self.finish_reason = out.finish_reason

    def new_text(self) -> str:
        """Text not sent yet, holding back what may still change: the beginning of a stop
        string (a partial UTF-8 character never reaches `text` before the end)."""
        end = len(self.text)
        if self.finish_reason is None:
            end -= max((len(s) - 1 for s in self.stop), default=0)
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
    if len(choices) == 1:
        async with aclosing(_outputs(ctx, request_id, ids, params[0], choices[0])) as outs:
            async for out in outs:
                yield choices[0], out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(choice: Choice, p: SamplingParams) -> None:
        try:
            async with aclosing(_outputs(ctx, request_id, ids, p, choice)) as outs:
                async for out in outs:
                    await queue.put((choice, out))
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


async def _outputs(ctx: ServingContext, request_id: str, ids: list[int], params: SamplingParams,
                   choice: Choice) -> AsyncIterator[RequestOutput]:
    """One choice's sequence, each output added to the choice before it is yielded."""
    stream = ctx.engine.generate(f"{request_id}-{choice.index}", ids, params)
    async with aclosing(stream):
        async for out in stream:
            choice.add(out)
            yield out
            if choice.finish_reason is not None:
                break  # a stop string: closing the stream aborts the sequence


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
