"""A choice's tokens as OpenAI's shapes: completion and chat logprobs, vLLM's prompt logprobs,
an echoed prompt, and tool calls.

A logprob is the float the sampler computed; a top alternative that the request's mask ruled
out has logprob -inf, which JSON cannot write: it is left out (it was never a candidate).
"""

from __future__ import annotations

import math
from typing import Any

from detgate.worker.engine.sequence import TokenLogprob
from detgate.worker.server.context import ServingContext
from detgate.worker.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)


def _candidates(top: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return [(i, lp) for i, lp in top if math.isfinite(lp)]


def completion_logprobs(ctx: ServingContext, tokens: list[TokenLogprob],
                        echoed: list[TokenLogprob | None] = (), offset: int = 0
                        ) -> CompletionLogprobs:
    """`echoed`: the prompt's tokens first (None for the first one, which has no logprob);
    `offset`: the text offset of the first token."""
    out = CompletionLogprobs()
    for t in [*echoed, *tokens]:
        text = ctx.token_text(t.token_id)
        top = _candidates(t.top) if t.logprob is not None else []
        out.tokens.append(text)
        out.token_logprobs.append(t.logprob)
        out.top_logprobs.append({ctx.token_text(i): lp for i, lp in top} if top else None)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def echoed_prompt(ids: list[int], lps: list[TokenLogprob] | None) -> list[TokenLogprob]:
    """The prompt's tokens as logprob entries: the first without a logprob, then each with
    the logprob it was scored with (when asked for)."""
    scored = lps or []
    return [TokenLogprob(ids[0])] + [scored[i] if i < len(scored) else TokenLogprob(t)
                                     for i, t in enumerate(ids[1:])]


def chat_logprobs(ctx: ServingContext, tokens: list[TokenLogprob]) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        text = ctx.token_text(token_id)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    return ChatLogprobs(content=[
        ChatTokenLogprob(**top(t.token_id, t.logprob).model_dump(),
                         top_logprobs=[top(i, lp) for i, lp in _candidates(t.top)])
        for t in tokens
    ])


def prompt_logprobs(ctx: ServingContext, lps: list[TokenLogprob] | None
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
