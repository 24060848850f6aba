"""From engine sequences to choices: the one layer of the server that talks to the engine.

One request with n choices becomes n engine sequences (choice i seeded with seed + i), run
concurrently; their outputs are merged into one stream (n = 1 needs no merging). Text is
detokenised incrementally (each step decodes only the tokens since the last complete
character, so a completion costs O(length) decoding) and stop strings are matched on it here
(the engine knows only token ids); a choice that hits one is cut there and its sequence
aborted, which frees its blocks.

The n sequences are submitted together, and the fingerprint read with them, in one synchronous
step (`Generation`): the engine orders submissions against weight updates in that same order,
so all n run on the weights that fingerprint names.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from detgate.worker.engine.async_engine import Outputs
from detgate.worker.engine.engine import RequestOutput
from detgate.worker.engine.sequence import SamplingParams, TokenLogprob
from detgate.worker.model.tokenizer import Tokenizer
from detgate.worker.server.context import ServingContext


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
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix: int = 0
    read: int = 0

    def add(self, new_ids: list[int], final: bool) -> str:
        """The text `new_ids` add (with `final`, whatever is left, complete or not)."""
        self.ids.extend(new_ids)
        skip = self.skip_special_tokens
        settled = self.tokenizer.decode(self.ids[self.prefix:self.read], skip)
        window = self.tokenizer.decode(self.ids[self.prefix:], skip)
        if not final and (len(window) <= len(settled) or window.endswith("\ufffd")):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(settled):]


@dataclass
class Choice:
    """One choice's generated tokens and text, with the part of the text already sent.
    Stop strings count from the `min_tokens`-th token on (vLLM's rule); with
    `include_stop` the text keeps the stop string that ended it."""

    index: int
    tokenizer: Tokenizer
    stop: list[str]
    prompt_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True
    include_stop: bool = False
    min_tokens: int = 0
    tokens: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0
    opened: bool = False  # a streamed tool call's first delta (id, name) has been sent
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    detokenizer: Detokenizer = field(init=False)

    def __post_init__(self) -> None:
        self.detokenizer = Detokenizer(self.tokenizer, self.skip_special_tokens)

    def add(self, out: RequestOutput) -> None:
        self.tokens.extend(out.new_tokens)
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        checked = len(self.text)
        self.text += self.detokenizer.add([t.token_id for t in out.new_tokens], out.finished)
        if len(self.tokens) < self.min_tokens:
            return
        # The text before `checked` held no stop string: a new one ends in the added part.
        hits = [(at, at + len(s) if self.include_stop else at) for s in self.stop
                if (at := self.text.find(s, max(0, checked - len(s) + 1))) >= 0]
        if hits:
            self.text, self.finish_reason = self.text[:min(hits)[1]], "stop"
        if out.finished and self.finish_reason is None:
            self.finish_reason = out.finish_reason

    def settled_end(self) -> int:
        """End of the text that can no longer change: less what may still become a stop
        string (a partial UTF-8 character never reaches `text` before the end)."""
        end = len(self.text)
        if self.finish_reason is None:
            end -= max((len(s) - 1 for s in self.stop), default=0)
        return end

    def new_text(self, end: int | None = None) -> str:
        """Settled text not sent yet (up to `end` if given)."""
        end = self.settled_end() if end is None else end
        if end <= self.sent_chars:
            return ""
        out, self.sent_chars = self.text[self.sent_chars:end], end
        return out

    def new_tokens(self) -> list[TokenLogprob]:
        out, self.sent_tokens = self.tokens[self.sent_tokens:], len(self.tokens)
        return out


class Generation:
    """Every choice's sequence of one request (each on its `prompt_ids`), submitted when this
    is made, with `fingerprint`: the system fingerprint of the weights they run on. Use as
    `async with` (leaving it aborts every unfinished sequence: client gone, error, stop string)
    and iterate it for (choice, output) pairs as outputs arrive, each already added to its
    choice. The caller has validated every sequence (`ctx.engine.validate`), before answering
    anything."""

    def __init__(self, ctx: ServingContext, request_id: str, params: list[SamplingParams],
                 choices: list[Choice]) -> None:
        # No await from here to the last submission (see the module's docstring).
        self.fingerprint = ctx.fingerprint
        self.choices = choices
        self._streams: list[Outputs] = []
        try:
            for choice, p in zip(choices, params, strict=True):
                self._streams.append(ctx.engine.generate(
                    f"{request_id}-{choice.index}", choice.prompt_ids, p, validated=True))
        except BaseException:
            self.close()
            raise

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        for stream in self._streams:
            stream.close()

    def __aiter__(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        if len(self.choices) == 1:
            return self._one(self.choices[0], self._streams[0])
        return self._merged()

    async def _one(self, choice: Choice, stream: Outputs
                   ) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        async for out in stream:
            choice.add(out)
            yield choice, out
            if choice.finish_reason is not None:
                stream.close()  # a stop string: aborts the sequence
                return

    async def _merged(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(choice: Choice, stream: Outputs) -> None:
            try:
                async for item in self._one(choice, stream):
                    await queue.put(item)
            except Exception as exc:
                await queue.put((choice, exc))
            await queue.put((choice, done))

        tasks = [asyncio.create_task(pump(c, s))
                 for c, s in zip(self.choices, self._streams, strict=True)]
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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
