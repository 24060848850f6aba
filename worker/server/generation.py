"""From engine sequences to choices: the one layer of the server that talks to the engine.

One request with n choices becomes n engine sequences (choice i seeded with seed + i), run
concurrently; their outputs are merged into one stream (n = 1 needs no merging). Text is
detokenised incrementally (each step decodes only the tokens since the last complete
character, so a completion costs O(length) decoding) and stop strings are matched on it here
(the engine knows only token ids); a choice that hits one is cut there and its sequence
aborted, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from worker.engine.engine import RequestOutput
from worker.engine.sequence import SamplingParams, TokenLogprob
from worker.model.tokenizer import Tokenizer
from worker.server.context import ServingContext


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


async def generate(ctx: ServingContext, request_id: str, ids: list[int],
                   params: list[SamplingParams], choices: list[Choice]
                   ) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Run every choice's sequence; yield (choice, output) as outputs arrive. Leaving early
    (client gone, error) aborts every unfinished sequence. The caller has validated every
    sequence (`ctx.engine.validate`), before answering anything."""
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
    stream = ctx.engine.generate(f"{request_id}-{choice.index}", ids, params, validated=True)
    async with aclosing(stream):
        async for out in stream:
            choice.add(out)
            yield out
            if choice.finish_reason is not None:
                break  # a stop string: closing the stream aborts the sequence


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
