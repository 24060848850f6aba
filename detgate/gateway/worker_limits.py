"""What the workers of a model accept, as their model cards advertise it, and the check of a
request against it before anything is forwarded.

The gateway has no tokenizer, so a text prompt's length is bounded from below: a token's
text has at most `max_token_chars` characters (the built-in worker advertises it), so a
prompt of C characters is at least C / max_token_chars tokens. A request that cannot fit
by that bound is refused here (400); one that the bound lets through and the worker still
refuses is recorded as a bounded summary, never whole. Token-id prompts are checked
exactly (length and vocabulary). Limits a worker does not advertise (vLLM's vocabulary, say)
are not checked here: the worker checks them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from detgate.contract.sampling import unsupported_fields
from detgate.gateway.errors import BadRequest


def _positive(card: dict, name: str) -> int | None:
    value = card.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def _lowest(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int | None = None
    vocab_size: int | None = None
    max_token_chars: int | None = None
    # Request parameters the worker cannot honour: refused unless absent or at their neutral
    # value (contract/sampling.py says which value that is for each).
    unsupported: frozenset[str] = frozenset()

    @classmethod
    def from_card(cls, card: dict) -> ModelLimits:
        names = card.get("unsupported_parameters")
        return cls(max_model_len=_positive(card, "max_model_len"),
                   vocab_size=_positive(card, "vocab_size"),
                   max_token_chars=_positive(card, "max_token_chars"),
                   unsupported=frozenset(n for n in names if isinstance(n, str))
                   if isinstance(names, list) else frozenset())

    def tightest(self, other: ModelLimits) -> ModelLimits:
        """What both accept."""
        return ModelLimits(_lowest(self.max_model_len, other.max_model_len),
                           _lowest(self.vocab_size, other.vocab_size),
                           _lowest(self.max_token_chars, other.max_token_chars),
                           self.unsupported | other.unsupported)


def check_fits(limits: ModelLimits | None, body: dict[str, Any], *, asked: int | None,
               token_prompts: list[list[int]], text_chars: int, prompt_param: str) -> None:
    """Refuse (400) a request these limits say no worker would accept. `asked`: the tokens
    to generate per choice (None: up to the context's end); `token_prompts`: prompts given
    as token ids; `text_chars`: an upper bound of the characters of the text prompt (the
    exact count is taken only when the bound could decide)."""
    if limits is None:
        return
    if limits.unsupported:
        used = sorted(n for n in unsupported_fields(body) if n in limits.unsupported)
        if used:
            raise BadRequest(f"unsupported parameter{'s' if len(used) > 1 else ''} "
                             f"{', '.join(repr(n) for n in used)}: the workers of model "
                             f"'{body.get('model')}' do not support "
                             f"{'them' if len(used) > 1 else 'it'}", param=used[0],
                             code="unsupported_parameter")
    context = limits.max_model_len
    if context is None:
        return
    least = asked or 1  # a chat without max_tokens still generates a token
    if asked is not None and asked >= context:  # the prompt has a token at least
        raise BadRequest(f"'max_tokens' ({asked}) must be less than the model's context "
                         f"length of {context} tokens", param="max_tokens",
                         code="context_length_exceeded")
    for ids in token_prompts:
        check_token_ids(limits, ids, least, prompt_param)
    if limits.max_token_chars is not None and text_chars // limits.max_token_chars + least \
            > context:
        counted = _text_chars(body)
        _fits(counted // limits.max_token_chars, least, context, prompt_param, exact=False)


def check_token_ids(limits: ModelLimits | None, ids: list[int], least: int, param: str) -> None:
    """Token ids in the vocabulary, and with `least` more tokens within the context."""
    if limits is None:
        return
    if limits.vocab_size is not None and ids and max(ids) >= limits.vocab_size:
        raise BadRequest(f"token ids must be in [0, {limits.vocab_size}): the model's "
                         "vocabulary", param=param, code="invalid_token_id")
    if limits.max_model_len is not None:
        _fits(len(ids), least, limits.max_model_len, param, exact=True)


def _fits(tokens: int, least: int, context: int, param: str, *, exact: bool) -> None:
    if tokens + least > context:
        what = f"{tokens} tokens" if exact else f"at least {tokens} tokens"
        more = f" and {least} generated token{'s' if least > 1 else ''}" if least else ""
        raise BadRequest(f"the prompt ({what}){more} exceed the model's context length of "
                         f"{context} tokens", param=param, code="context_length_exceeded")


def _text_chars(body: dict[str, Any]) -> int:
    """Characters of the prompt text: the completion prompt (the longest of several), or every
    message's content."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return max(map(len, prompt))
    total = 0
    for message in body.get("messages") or ():
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return total
