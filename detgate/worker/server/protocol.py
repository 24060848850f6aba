"""Request and response models of the worker's HTTP API: OpenAI shapes plus vLLM's extensions
(`return_token_ids`, `prompt_logprobs`, `top_k`, `ignore_eos`, `min_tokens`, `stop_token_ids`,
`skip_special_tokens`, `include_stop_str_in_output`, `stream_options.continuous_usage_stats`)
and /v1/score. Fields that would change the output but that this worker does not implement
(contract.sampling.UNSUPPORTED) are refused, all of them named in one 400.

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
    model_validator,
)
from pydantic_core import PydanticCustomError

from detgate.contract.constants import MAX_LOGPROBS, ROLES
from detgate.contract.sampling import unsupported_fields, unsupported_message


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
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = "response"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema response_format needs 'json_schema'")
        return self


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class _Request(BaseModel):
    # Unknown OpenAI fields (user, metadata, ...) are accepted and ignored, as by vLLM; those
    # that would change the output are refused (`_supported`).
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
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        # Clients send `"max_tokens": null` and the like for "not set", as the OpenAI API allows.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, data: Any) -> Any:
        names = unsupported_fields(data) if isinstance(data, dict) else []
        if names:
            raise PydanticCustomError("unsupported_parameter", unsupported_message(data),
                                      {"param": names[0]})
        return data

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


TokenIds = Annotated[list[int], Field(min_length=1)]


class CompletionRequest(_Request):
    # One prompt (text or token ids) or several: vLLM's and OpenAI's four shapes.
    prompt: Text | TokenIds | list[Text] | list[TokenIds] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal[ROLES]  # type: ignore[valid-type]
    content: Text | list[TextPart] | None = None
    # An assistant's earlier tool calls and a tool's answer, for templates that render them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        for key in ("tool_calls", "tool_call_id", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True


class ScoreRequest(BaseModel):
    """The tokens from `start` on are scored as generated tokens: under the same masks as a
    generation request with these `response_format` / `tools` / `tool_choice` /
    `parallel_tool_calls` / `min_tokens` / `stop_token_ids` / `ignore_eos` (a structured
    answer's sampled logprobs are those of the masked distribution)."""

    model: str
    token_ids: list[int] = Field(min_length=2)
    start: int = Field(1, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False


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


class FunctionCall(BaseModel):
    name: str | None = None
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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
    vocab_size: int | None = None
    max_token_chars: int | None = None
    max_num_seqs: int | None = None
    unsupported_parameters: list[str] | None = None
    system_fingerprint: str | None = None
    numerics: dict[str, str] | None = None  # the parts system_fingerprint hashes
    machine: dict[str, str | int] | None = None  # hashed only where it changes bits


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
