"""The record (`GET /v1/requests/{id}`): what the gateway stores for every request, and what
replay, the audit and the tests read back. JSON in Redis; these types are its one shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RecordChoice:
    """One generated choice: its text, token ids (None when the worker gave none) and the
    chosen token's logprob at each position, as the floats the worker sent."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] | None = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    # For people reading the record only (the comparison uses ids and logprobs): each token's
    # text, and the alternatives per position as [{"token", "logprob"}, ...].
    tokens: list[str | None] | None = None
    top_logprobs: list[list[dict[str, Any]]] | None = None
    # A chat answer's tool calls (OpenAI's `tool_calls`), as the client got them.
    tool_calls: list[dict[str, Any]] | None = None
    # An echoed prompt (completions' `echo`): its token ids and each one's logprob (None for
    # the first), compared on replay like the generated ones.
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[float | None] | None = None

    _OPTIONAL = ("tokens", "top_logprobs", "tool_calls", "prompt_token_ids", "prompt_logprobs")

    def as_dict(self) -> dict[str, Any]:
        out = {"index": self.index, "text": self.text, "finish_reason": self.finish_reason,
               "token_ids": self.token_ids, "logprobs": self.logprobs}
        for name in self._OPTIONAL:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RecordChoice:
        return cls(index=d.get("index", 0), text=d.get("text") or "",
                   finish_reason=d.get("finish_reason"), token_ids=d.get("token_ids"),
                   logprobs=list(d.get("logprobs") or []),
                   **{name: d.get(name) for name in cls._OPTIONAL})


@dataclass
class Record:
    """One served (or failed, or aborted) request. `request` is the exact body the worker got,
    effective seed included, so that the record can be replayed."""

    id: str
    created: float
    endpoint: str
    model: str
    request: dict[str, Any]
    worker: str | None
    system_fingerprint: str | None
    status: str  # one of constants.STATUSES
    choices: list[RecordChoice]
    usage: dict[str, int] | None = None
    error: str | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[Any] | None = None
    # The machine of the worker that answered (CPU, threads, versions: what its /v1/models
    # card says), for people: the fingerprint alone decides where a record may replay. None
    # for vLLM workers and records stored before the field existed.
    machine: dict[str, Any] | None = None
    replays: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The stored shape; optional fields only when set, replays kept apart (stored in a
        list of their own, added on reading)."""
        out: dict[str, Any] = {
            "id": self.id, "created": self.created, "endpoint": self.endpoint,
            "model": self.model, "request": self.request, "worker": self.worker,
            "system_fingerprint": self.system_fingerprint, "status": self.status,
            "choices": [c.as_dict() for c in self.choices], "usage": self.usage}
        for name in ("error", "prompt_token_ids", "prompt_logprobs", "machine"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        return cls(
            id=d["id"], created=d["created"], endpoint=d["endpoint"], model=d["model"],
            request=d["request"], worker=d.get("worker"),
            system_fingerprint=d.get("system_fingerprint"), status=d["status"],
            choices=[RecordChoice.from_dict(c) for c in d.get("choices") or []],
            usage=d.get("usage"), error=d.get("error"),
            prompt_token_ids=d.get("prompt_token_ids"),
            prompt_logprobs=d.get("prompt_logprobs"), machine=d.get("machine"),
            replays=list(d.get("replays") or []))
