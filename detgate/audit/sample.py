"""What one audited request produced: the unit every other audit module works on."""

from __future__ import annotations

from dataclasses import dataclass

from detgate.contract.analysis import Answer


@dataclass(frozen=True)
class Sample(Answer):
    """One completion of the audited prompt, as parsed from an OpenAI-shaped response: the
    analysed answer (text, token ids, tokens, logprobs) plus what the audit reports beside it.

    `prompt_token_ids` comes from vLLM's `return_token_ids` extension and is None where the
    endpoint does not offer it.
    """

    prompt_token_ids: tuple[int, ...] | None = None
    finish_reason: str | None = None
    fingerprint: str | None = None
    attempts: int = 1
