"""Client requests: validated in the gateway, then turned into the body sent to a worker.

One strict pydantic model per endpoint says what a request may hold. Nothing reaches a worker
unless every field is known and within limits: an unknown field (`api_base`, `base_url`, any
engine control we do not vouch for) is a 400, so a client can neither redirect the gateway nor
change numerics behind the record's back. Strict types: `"16"` or `true` is no integer. The
limits that are settings (max_tokens, n, stop sequences, score length) come in as the
validation context; rules between fields are checked after the model.

The worker body is the client's own JSON object (validated, never re-serialised from the
model, so the record holds exactly what was sent) plus what the gateway always asks for:
logprobs, token ids and (streaming) usage, and a seed for sampled requests, so that every
record can be compared and replayed exactly. `ClientAsk` remembers what the client itself
asked for, to strip the rest from its answer.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from detgate.contract.constants import MAX_LOGPROBS, ROLES, prompt_logprobs_conflict
from detgate.contract.sampling import refusal
from detgate.gateway.config import Settings
from detgate.gateway.errors import BadRequest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SCORE = "/v1/score"
INT64 = 2 ** 63
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's (and the workers') max_tokens when a completion has none


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _limit(info: ValidationInfo, name: str) -> int:
    settings: Settings = info.context
    return getattr(settings, name)


def _at_most(value: Any, limit: int, what: str) -> Any:
    if value is not None and value > limit:
        raise PydanticCustomError("limit", f"at most {limit} {what}")
    return value


def _explained(message: str) -> WrapValidator:
    """One plain message for a union's failure instead of one error per member type."""
    def validate(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("invalid", message) from None
    return WrapValidator(validate)


TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=INT64)]], Field(min_length=1)]
Prompt = Annotated[str | TokenIds | list[str] | list[TokenIds], Field(min_length=1), _explained(
    "a non-empty string, a list of token ids, or a list of either (several prompts)")]
Stop = Annotated[str | list[Annotated[str, Field(min_length=1)]],
                 _explained("a string or a list of non-empty strings")]
# A schema is client data for a worker's grammar compiler: bounded like everything else.
MAX_SCHEMA_BYTES = 64 << 10


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str = Field(min_length=1)


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    # Other message fields (name, tool_call_id, ...) go to the worker as sent.
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart] | None = None  # None: an assistant's message of tool calls

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        """Name the part the workers cannot take (an image, audio) instead of a union error."""
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise PydanticCustomError(
                        "unsupported_content", "unsupported content part type {kind!r}: the "
                        "gateway forwards text parts only", {"kind": kind[:64]})
        return v

    @model_validator(mode="after")
    def _content(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise PydanticCustomError("missing", "content is required (null only for an "
                                      "assistant's tool calls)")
        return self


class _Generation(_Strict):
    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    n: int | None = Field(None, ge=1)
    top_k: int | None = Field(None, ge=-1, le=1 << 31)
    seed: int | None = Field(None, ge=-INT64, le=INT64 - 1)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stop: Stop | None = None
    user: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's sampling extensions
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=INT64)]] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None

    @field_validator("min_tokens")
    @classmethod
    def _min_tokens(cls, v: int | None, info: ValidationInfo) -> int | None:
        return _at_most(v, _limit(info, "max_tokens"), "tokens")

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None, info: ValidationInfo) -> list[int] | None:
        if v is not None:
            _at_most(len(v), _limit(info, "max_stop"), "stop token ids")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens(cls, v: int | None, info: ValidationInfo) -> int | None:
        return _at_most(v, _limit(info, "max_tokens"), "tokens")

    @field_validator("n")
    @classmethod
    def _n(cls, v: int | None, info: ValidationInfo) -> int | None:
        return _at_most(v, _limit(info, "max_n"), "choices")

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None, info: ValidationInfo) -> str | list[str] | None:
        if isinstance(v, list):
            _at_most(len(v), _limit(info, "max_stop"), "stop sequences")
        longest = max((len(s) for s in ([v] if isinstance(v, str) else v or ())), default=0)
        _at_most(longest, _limit(info, "max_stop_chars"), "characters per stop sequence")
        return v


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, v: int | None, info: ValidationInfo) -> int | None:
        return _at_most(v, _limit(info, "max_tokens"), "tokens")


class CompletionRequest(_Generation):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token
    echo: bool | None = None  # the prompt, and its tokens' logprobs, before the completion

    @property
    def num_prompts(self) -> int:
        p = self.prompt
        return 1 if isinstance(p, str) or isinstance(p[0], int) else len(p)


class ScoreBody(_Strict):
    """The built-in worker's score request: 0 < start < len(token_ids), start 1 when absent;
    token ids are non-negative (the worker checks them against its vocabulary)."""

    model: str = Field(min_length=1)
    token_ids: list[Annotated[int, Field(ge=0, lt=INT64)]] = Field(min_length=2)
    start: int = Field(1, ge=1)
    system_fingerprint: str | None = Field(None, min_length=1)
    # The masks the scored tokens were generated under (a structured answer's logprobs are
    # those of the masked distribution): the generation request's own fields.
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=INT64)]] | None = None
    ignore_eos: bool | None = None

    @field_validator("token_ids")
    @classmethod
    def _length(cls, v: list[int], info: ValidationInfo) -> list[int]:
        _at_most(len(v), _limit(info, "max_score_tokens"), "token ids")
        return v


class ReplayBody(_Strict):
    load: int = Field(0, ge=0)  # other requests sent to the worker alongside the replay

    @field_validator("load")
    @classmethod
    def _load(cls, v: int, info: ValidationInfo) -> int:
        return _at_most(v, _limit(info, "max_replay_load"), "concurrent requests")


class DriftBody(_Strict):
    """`POST /v1/drift`: replay the caller's records made on `from_fingerprint` on workers of
    `to_fingerprint`; `sample` of them (drawn with `seed`), or every one found."""

    from_fingerprint: str = Field(min_length=1, max_length=128)
    to_fingerprint: str = Field(min_length=1, max_length=128)
    sample: int | None = Field(None, ge=1)
    endpoint: Literal[COMPLETIONS, CHAT] | None = None  # type: ignore[valid-type]
    seed: int = Field(0, ge=0, lt=INT64)
    concurrency: int = Field(8, ge=1)

    @field_validator("sample")
    @classmethod
    def _sample(cls, v: int | None, info: ValidationInfo) -> int | None:
        return _at_most(v, _limit(info, "max_drift_records"), "records")

    @field_validator("concurrency")
    @classmethod
    def _concurrency(cls, v: int, info: ValidationInfo) -> int:
        return _at_most(v, _limit(info, "max_drift_concurrency"), "replays at once")


_MODELS: dict[str, type[_Generation]] = {CHAT: ChatRequest, COMPLETIONS: CompletionRequest}
_FORWARDED_ONLY = "the gateway forwards only parameters it records and can replay"


@dataclass(frozen=True)
class ClientAsk:
    """What the client asked for; the worker is always asked for more."""

    logprobs: bool
    top_logprobs: int  # chat: top_logprobs; completions: the `logprobs` count
    token_ids: bool
    include_usage: bool


@dataclass(frozen=True)
class ParsedRequest:
    endpoint: str
    model: str
    stream: bool
    body: dict[str, Any]  # exactly what the worker gets, effective seed included
    wire: bytes  # `body` as sent (serialised once)
    ask: ClientAsk
    n: int
    max_tokens: int | None  # per choice; None: up to the end of the context
    token_prompts: list[list[int]]  # prompts given as token ids

    @property
    def is_chat(self) -> bool:
        return self.endpoint == CHAT


@dataclass(frozen=True)
class ScoreRequest:
    model: str
    body: dict[str, Any]  # exactly what the worker gets: model, token_ids, start
    fingerprint: str | None  # the client demands a worker with this fingerprint


def _json_object(raw: bytes) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


# Deeper JSON is refused: the record nests the body once more and orjson writes at most 254
# levels, and no request field needs more than a few.
MAX_JSON_DEPTH = 64


def _too_deep(value: Any, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item \
            if isinstance(item, list) else None
        if children is not None:
            if depth > limit:
                return True
            stack.extend((child, depth + 1) for child in children)
    return False


def _check_depth(raw: bytes, body: dict) -> None:
    # Fewer brackets than the limit cannot nest deeper: most bodies skip the walk.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _too_deep(body, MAX_JSON_DEPTH):
        raise BadRequest(f"the body nests JSON more than {MAX_JSON_DEPTH} levels deep")


def _validate(model: type[BaseModel], body: dict, settings: Settings, why: str) -> Any:
    """The body as `model`, or the 400 for its first problem; unknown fields come first, all
    of them named at once."""
    try:
        return model.model_validate(body, context=settings)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    if unknown:  # every one of them, so that a client learns all it must change at once
        names = list(dict.fromkeys(_path(e["loc"]) for e in unknown))
        raise BadRequest(refusal(names, why), param=str(unknown[0]["loc"][0]),
                         code="unknown_parameter") from None
    first = errors[0]
    loc = first["loc"]
    message = f"'{_path(loc)}': {first['msg']}" if loc else first["msg"]
    raise BadRequest(message, param=str(loc[0]) if loc else None) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _path(loc: tuple) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; union member tags are left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not out:
            out = part
        elif part not in _TYPE_TAGS and "[" not in part:  # a union member's tag, not a field
            out += f".{part}"
    return out


def parse(endpoint: str, raw: bytes, settings: Settings) -> ParsedRequest:
    body = _json_object(raw)
    _check_depth(raw, body)
    req = _validate(_MODELS[endpoint], body, settings, _FORWARDED_ONLY)
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise BadRequest("'stream_options' needs 'stream': true", param="stream_options")
    if (conflict := prompt_logprobs_conflict(stream, req.prompt_logprobs)) is not None:
        raise BadRequest(conflict, param="prompt_logprobs")
    _check_structure(req, settings)

    out = dict(body)
    if isinstance(req, ChatRequest):
        asked = bool(req.logprobs)
        top = req.top_logprobs
        if top is not None and not asked:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        out["logprobs"] = True
        out["top_logprobs"] = top or 0
    else:
        top = req.logprobs
        asked = top is not None
        # At least one alternative, so every worker reports the chosen token's logprob (and,
        # with echo, the prompt's: recorded too).
        out["logprobs"] = max(top or 0, 1)
    out["return_token_ids"] = True
    if stream:
        out["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    if req.seed is None and (req.temperature is None or req.temperature > 0):
        out["seed"] = secrets.randbelow(1 << 31)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    ask = ClientAsk(logprobs=asked, top_logprobs=top or 0, token_ids=bool(req.return_token_ids),
                    include_usage=include_usage)
    if isinstance(req, ChatRequest):
        max_tokens, token_prompts = req.max_completion_tokens or req.max_tokens, []
    else:
        max_tokens = req.max_tokens or COMPLETIONS_MAX_TOKENS
        token_prompts = _token_prompts(req.prompt)
    return ParsedRequest(endpoint=endpoint, model=req.model, stream=stream, body=out,
                         wire=orjson.dumps(out), ask=ask, n=req.n or 1, max_tokens=max_tokens,
                         token_prompts=token_prompts)


def _token_prompts(prompt) -> list[list[int]]:
    """The prompts given as token ids: one list of ids, or several (text prompts: none)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], str):
        return []
    return [prompt] if isinstance(prompt[0], int) else list(prompt)


def _check_structure(req: _Generation, settings: Settings) -> None:
    """Rules between the new fields: choices (prompts x n) within max_n, echo not streamed
    (its prompt logprobs come with a whole answer, as prompt_logprobs do), schemas bounded,
    a json_schema format with its schema, a named tool among the tools."""
    if isinstance(req, CompletionRequest):
        if req.num_prompts * (req.n or 1) > settings.max_n:
            raise BadRequest(f"at most {settings.max_n} choices (prompts x n) per request",
                             param="prompt")
        if req.echo and req.stream:
            raise BadRequest("'echo' is not available when streaming", param="echo")
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_schema" and (fmt.json_schema is None
                                                          or fmt.json_schema.schema_ is None):
        raise BadRequest("a 'json_schema' response_format needs 'json_schema.schema'",
                         param="response_format")
    tools = getattr(req, "tools", None) or []
    schemas = [fmt.json_schema.schema_ if fmt and fmt.json_schema else None,
               *(t.function.parameters for t in tools)]
    if len(orjson.dumps(schemas)) > MAX_SCHEMA_BYTES:
        raise BadRequest(f"schemas of more than {MAX_SCHEMA_BYTES} bytes in all",
                         param="tools" if tools else "response_format")
    choice = getattr(req, "tool_choice", None)
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {
            t.function.name for t in tools}:
        raise BadRequest(f"'tool_choice' names '{choice.function.name}', which is not among "
                         "'tools'", param="tool_choice")
    if choice == "required" and not tools:
        raise BadRequest("'tool_choice': 'required' needs 'tools'", param="tool_choice")


def parse_score(raw: bytes, settings: Settings) -> ScoreRequest:
    raw_body = _json_object(raw)
    req = _validate(ScoreBody, raw_body, settings,
                    f"a score request holds only {sorted(ScoreBody.model_fields)}")
    if req.start >= len(req.token_ids):
        raise BadRequest(f"'start' must be an integer from 1 to {len(req.token_ids) - 1} "
                         "(len(token_ids) - 1): the first token has no context to be scored in",
                         param="start")
    body = {k: v for k, v in raw_body.items() if k != "system_fingerprint" and v is not None}
    return ScoreRequest(model=req.model, body=body, fingerprint=req.system_fingerprint)


def parse_replay(raw: bytes, settings: Settings) -> int:
    """`POST /replay/{id}`'s optional body: the load to run the replay under (0 without)."""
    if not raw.strip():
        return 0
    return _validate(ReplayBody, _json_object(raw), settings, "the body may hold only 'load'").load


def parse_drift(raw: bytes, settings: Settings) -> DriftBody:
    return _validate(DriftBody, _json_object(raw), settings,
                     "see the README's drift section for the fields")


def replay_body(recorded: dict) -> dict:
    """The recorded worker body, made non-streaming: the comparison needs the whole answer."""
    body = dict(recorded)
    body["stream"] = False
    body.pop("stream_options", None)
    return body
