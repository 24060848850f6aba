"""What one audited request produced: the unit every other audit module works on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """One completion of the audited prompt, as parsed from an OpenAI-shaped response.

    `token_ids` and `prompt_token_ids` come from vLLM's `return_token_ids` extension and are
    None where the endpoint does not offer it; `tokens` and `logprobs` come from the standard
    logprobs field and are None where the endpoint returned none. Positions of `tokens`,
    `token_ids` and `logprobs` refer to the same generated tokens.
    """

    index: int
    text: str
    token_ids: tuple[int, ...] | None = None
    tokens: tuple[str, ...] | None = None
    logprobs: tuple[float | None, ...] | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    finish_reason: str | None = None
    fingerprint: str | None = None
    attempts: int = 1
