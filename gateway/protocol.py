"""Client requests: validated in the gateway, then turned into the body sent to a worker.

Nothing reaches a worker unless every field is known and within limits: an unknown field
(`api_base`, `base_url`, any engine control we do not vouch for) is a 400, so a client can
neither redirect the gateway nor change numerics behind the record's back.

The worker body always asks for logprobs, token ids and (streaming) usage, and carries a
seed for sampled requests, so that every record can be compared and replayed exactly.
`ClientAsk` remembers what the client itself asked for, to strip the rest from its answer.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import orjson

from detgate.contract.constants import MAX_LOGPROBS, ROLES, prompt_logprobs_conflict
from gateway.config import Settings
from gateway.errors import BadRequest

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
SCORE = "/v1/score"
INT64 = 2 ** 63

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "stream",
           "stream_options", "seed", "user", "presence_penalty", "frequency_penalty",
           "logprobs", "return_token_ids", "prompt_logprobs"}
ALLOWED = {
    CHAT: _COMMON | {"messages", "top_logprobs", "max_completion_tokens"},
    COMPLETIONS: _COMMON | {"prompt"},
}
_SCORE_FIELDS = {"model", "token_ids", "start", "system_fingerprint"}


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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _int(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v) or not lo <= v <= hi:
        raise BadRequest(f"'{name}' must be an integer from {lo} to {hi}", param=name)
    return v


def _num(body: dict, name: str, lo: float, hi: float, *, open_lo: bool = False) -> None:
    v = body.get(name)
    if v is None:
        return
    if not _is_num(v) or v > hi or v < lo or (open_lo and v == lo):
        raise BadRequest(f"'{name}' must be a number in {'(' if open_lo else '['}{lo}, {hi}]",
                         param=name)


def _bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be a boolean", param=name)
    return v


def _messages(body: dict) -> None:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}] needs a 'role' among {sorted(ROLES)}",
                             param=f"messages[{i}]")
        content = m.get("content")
        if not isinstance(content, str | list):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts",
                             param=f"messages[{i}].content")


def _prompt(body: dict) -> None:
    p = body.get("prompt")
    ok = (isinstance(p, str) and p != "") or (
        isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p))
    if not ok:
        raise BadRequest("'prompt' must be a non-empty string or a list of token ids "
                         "(one prompt per request, so that each answer has one record)",
                         param="prompt")


def _stop(body: dict, max_stop: int) -> None:
    stop = body.get("stop")
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a string or a list of non-empty strings", param="stop")
    if len(stop) > max_stop:
        raise BadRequest(f"'stop' may hold at most {max_stop} sequences", param="stop")


@dataclass(frozen=True)
class ScoreRequest:
    model: str
    body: dict[str, Any]  # exactly what the worker gets: model, token_ids, start
    fingerprint: str | None  # the client demands a worker with this fingerprint


def _json_object(raw: bytes, allowed: set[str], why: str) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unsupported parameter '{unknown[0]}' ({why})", param=unknown[0],
                         code="unknown_parameter")
    return body


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    return model


def parse(endpoint: str, raw: bytes, settings: Settings) -> ParsedRequest:
    body = _json_object(raw, ALLOWED[endpoint],
                        "the gateway forwards only parameters it records and can replay")
    model = _model(body)
    if endpoint == CHAT:
        _messages(body)
    else:
        _prompt(body)
    _int(body, "max_tokens", 1, settings.max_tokens)
    _int(body, "max_completion_tokens", 1, settings.max_tokens)
    _int(body, "n", 1, settings.max_n)
    _int(body, "top_k", -1, 1 << 31)
    _int(body, "seed", -INT64, INT64 - 1)
    _int(body, "prompt_logprobs", 0, MAX_LOGPROBS)
    _num(body, "temperature", 0.0, 2.0)
    _num(body, "top_p", 0.0, 1.0, open_lo=True)
    _num(body, "presence_penalty", -2.0, 2.0)
    _num(body, "frequency_penalty", -2.0, 2.0)
    _stop(body, settings.max_stop)
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise BadRequest("'user' must be a string", param="user")
    stream = bool(_bool(body, "stream"))
    token_ids = bool(_bool(body, "return_token_ids"))
    include_usage = _stream_options(body, stream)
    if (conflict := prompt_logprobs_conflict(stream, body.get("prompt_logprobs"))) is not None:
        raise BadRequest(conflict, param="prompt_logprobs")

    out = dict(body)
    if endpoint == CHAT:
        asked = bool(_bool(body, "logprobs"))
        top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
        if top is not None and not asked:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        out["logprobs"] = True
        out["top_logprobs"] = top or 0
    else:
        top = _int(body, "logprobs", 0, MAX_LOGPROBS)
        asked = top is not None
        # At least one alternative, so every worker reports the chosen token's logprob.
        out["logprobs"] = max(top or 0, 1)
    out["return_token_ids"] = True
    if stream:
        out["stream_options"] = {"include_usage": True}
    temperature = body.get("temperature")
    if body.get("seed") is None and (temperature is None or temperature > 0):
        out["seed"] = secrets.randbelow(1 << 31)
    ask = ClientAsk(logprobs=asked, top_logprobs=top or 0, token_ids=token_ids,
                    include_usage=include_usage)
    return ParsedRequest(endpoint=endpoint, model=model, stream=stream, body=out, ask=ask)


def _stream_options(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise BadRequest("'stream_options' needs 'stream': true", param="stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
        raise BadRequest("'stream_options' may hold only 'include_usage'", param="stream_options")
    include = opts.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise BadRequest("'stream_options.include_usage' must be a boolean",
                         param="stream_options")
    return bool(include)


def parse_score(raw: bytes, settings: Settings) -> ScoreRequest:
    """The built-in worker's score request, with its rules: 0 < start < len(token_ids), start
    1 when absent; token ids are non-negative (the worker checks them against its vocabulary)."""
    body = _json_object(raw, _SCORE_FIELDS, f"a score request holds only {sorted(_SCORE_FIELDS)}")
    model = _model(body)
    ids = body.get("token_ids")
    limit = settings.max_score_tokens
    if not isinstance(ids, list) or not 2 <= len(ids) <= limit:
        raise BadRequest(f"'token_ids' must be a list of 2 to {limit} token ids",
                         param="token_ids")
    if not all(_is_int(t) and 0 <= t < INT64 for t in ids):
        raise BadRequest("'token_ids' must hold non-negative integers", param="token_ids")
    start = body.get("start", 1)
    if not _is_int(start) or not 0 < start < len(ids):
        raise BadRequest(f"'start' must be an integer from 1 to {len(ids) - 1} (len(token_ids) "
                         "- 1): the first token has no context to be scored in", param="start")
    fingerprint = body.get("system_fingerprint")
    if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
        raise BadRequest("'system_fingerprint' must be a non-empty string",
                         param="system_fingerprint")
    return ScoreRequest(model=model, body={"model": model, "token_ids": ids, "start": start},
                        fingerprint=fingerprint)


def replay_body(recorded: dict) -> dict:
    """The recorded worker body, made non-streaming: the comparison needs the whole answer."""
    body = dict(recorded)
    body["stream"] = False
    body.pop("stream_options", None)
    return body
