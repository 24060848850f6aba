"""Request and response models of the worker's HTTP API: OpenAI shapes plus vLLM's extensions
(`return_token_ids`, `prompt_logprobs`, `top_k`, `ignore_eos`, `stop_token_ids`) and /v1/score.

Validation errors raised here become 400s in the OpenAI error shape (see app.py).
Logprobs are Python floats made from float32 values, so they are exact and round-trip
through JSON unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from detgate.contract.constants import MAX_LOGPROBS, ROLES


def _utf8(text: str) -> str:
    """JSON can spell a lone surrogate (\\ud800) that no tokenizer can encode: a 400, not a 500."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError("text holds a lone surrogate, which is not a character") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    # Unknown OpenAI fields (user, metadata, ...) are accepted and ignored, as by vLLM.
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    n: int = Field(1, ge=1)
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Clients send `"max_tokens": null` and the like for "not set", as the OpenAI API allows.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("penalties are not supported by this worker")
        return value

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class CompletionRequest(_Request):
    prompt: Text | list[int] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal[ROLES]  # type: ignore[valid-type]
    content: Text | list[TextPart] | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class ScoreRequest(BaseModel):
    model: str
    token_ids: list[int] = Field(min_length=2)
    start: int = Field(1, ge=1)


# -- responses -------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut | None = None
    delta: ChatDelta | None = None
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class ScoreResponse(BaseModel):
    model: str
    start: int
    token_ids: list[int]
    logprobs: list[float]
    system_fingerprint: str


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "detgate"
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
