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
)
from pydantic_core import PydanticCustomError

from detgate.contract.constants import MAX_LOGPROBS, ROLES, prompt_logprobs_conflict
from gateway.config import Settings
from gateway.errors import BadRequest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SCORE = "/v1/score"
INT64 = 2 ** 63


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


Prompt = Annotated[str | list[Annotated[int, Field(ge=0)]], Field(min_length=1), _explained(
    "a non-empty string or a list of token ids (one prompt per request, so that each answer "
    "has one record)")]
Stop = Annotated[str | list[Annotated[str, Field(min_length=1)]],
                 _explained("a string or a list of non-empty strings")]


class StreamOptions(_Strict):
    include_usage: bool | None = None


class Message(BaseModel):
    # Other message fields (name, tool_call_id, ...) go to the worker as sent.
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[Any]


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
        return v


class ChatRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens(cls, v: int | None, info: ValidationInfo) -> int | None:
        return _at_most(v, _limit(info, "max_tokens"), "tokens")


class CompletionRequest(_Generation):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # alternatives per token


class ScoreBody(_Strict):
    """The built-in worker's score request: 0 < start < len(token_ids), start 1 when absent;
    token ids are non-negative (the worker checks them against its vocabulary)."""

    model: str = Field(min_length=1)
    token_ids: list[Annotated[int, Field(ge=0, lt=INT64)]] = Field(min_length=2)
    start: int = Field(1, ge=1)
    system_fingerprint: str | None = Field(None, min_length=1)

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
    ask: ClientAsk

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


def _validate(model: type[BaseModel], body: dict, settings: Settings, why: str) -> Any:
    """The body as `model`, or the 400 for its first problem (an unknown field first)."""
    try:
        return model.model_validate(body, context=settings)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        name = _path(unknown[0]["loc"])
        raise BadRequest(f"unsupported parameter '{name}' ({why})",
                         param=str(unknown[0]["loc"][0]), code="unknown_parameter") from None
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
    req = _validate(_MODELS[endpoint], body, settings, _FORWARDED_ONLY)
    stream = bool(req.stream)
    if req.stream_options is not None and not stream:
        raise BadRequest("'stream_options' needs 'stream': true", param="stream_options")
    if (conflict := prompt_logprobs_conflict(stream, req.prompt_logprobs)) is not None:
        raise BadRequest(conflict, param="prompt_logprobs")

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
        # At least one alternative, so every worker reports the chosen token's logprob.
        out["logprobs"] = max(top or 0, 1)
    out["return_token_ids"] = True
    if stream:
        out["stream_options"] = {"include_usage": True}
    if req.seed is None and (req.temperature is None or req.temperature > 0):
        out["seed"] = secrets.randbelow(1 << 31)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    ask = ClientAsk(logprobs=asked, top_logprobs=top or 0, token_ids=bool(req.return_token_ids),
                    include_usage=include_usage)
    return ParsedRequest(endpoint=endpoint, model=req.model, stream=stream, body=out, ask=ask)


def parse_score(raw: bytes, settings: Settings) -> ScoreRequest:
    req = _validate(ScoreBody, _json_object(raw), settings,
                    f"a score request holds only {sorted(ScoreBody.model_fields)}")
    if req.start >= len(req.token_ids):
        raise BadRequest(f"'start' must be an integer from 1 to {len(req.token_ids) - 1} "
                         "(len(token_ids) - 1): the first token has no context to be scored in",
                         param="start")
    return ScoreRequest(model=req.model,
                        body={"model": req.model, "token_ids": req.token_ids, "start": req.start},
                        fingerprint=req.system_fingerprint)


def parse_replay(raw: bytes, settings: Settings) -> int:
    """`POST /replay/{id}`'s optional body: the load to run the replay under (0 without)."""
    if not raw.strip():
        return 0
    return _validate(ReplayBody, _json_object(raw), settings, "the body may hold only 'load'").load


def replay_body(recorded: dict) -> dict:
    """The recorded worker body, made non-streaming: the comparison needs the whole answer."""
    body = dict(recorded)
    body["stream"] = False
    body.pop("stream_options", None)
    return body
