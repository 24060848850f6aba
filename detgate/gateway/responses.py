"""Worker answers: what a record keeps from them, and what the client gets back.

Accepts the built-in worker's and vLLM's shapes: `token_ids` per choice (vLLM's
`return_token_ids`), `prompt_token_ids` at the top (chat) or per choice (completions),
`prompt_logprobs` (a list of `{token_id: {"logprob", "rank", "decoded_token"}}` or null),
errors as `{"error": {..., "code": 400}}` or vLLM's older flat `{"object": "error", ...}`,
and `system_fingerprint` null (the router then supplies a derived one).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson

from detgate.contract.record import RecordChoice
from detgate.gateway.errors import UpstreamFailed, UpstreamRejected
from detgate.gateway.protocol import ClientAsk

_TOKEN_ID_PREFIX = "token_id:"


def _chat_logprob_entries(choice: dict) -> list[dict]:
    return ((choice.get("logprobs") or {}).get("content")) or []


def _token_ids_from_strings(entries: list[dict]) -> list[int] | None:
    """vLLM's `return_tokens_as_token_ids` spells tokens 'token_id:N': a fallback for ids."""
    ids = []
    for e in entries:
        token = e.get("token")
        if not isinstance(token, str) or not token.startswith(_TOKEN_ID_PREFIX):
            return None
        ids.append(int(token[len(_TOKEN_ID_PREFIX):]))
    return ids


def choice_logprobs(is_chat: bool, choice: dict) -> list[float | None]:
    if is_chat:
        return [e.get("logprob") for e in _chat_logprob_entries(choice)]
    return list(((choice.get("logprobs") or {}).get("token_logprobs")) or [])


def choice_token_ids(is_chat: bool, choice: dict) -> list[int] | None:
    ids = choice.get("token_ids")
    if ids is not None:
        return list(ids)
    if is_chat:
        return _token_ids_from_strings(_chat_logprob_entries(choice))
    tokens = ((choice.get("logprobs") or {}).get("tokens")) or []
    return _token_ids_from_strings([{"token": t} for t in tokens])


def choice_tokens(is_chat: bool, choice: dict) -> list[str | None]:
    """Each generated token's text, as the worker spelled it (for showing the answer token by
    token; the comparison uses ids and logprobs only)."""
    if is_chat:
        return [e.get("token") for e in _chat_logprob_entries(choice)]
    return list(((choice.get("logprobs") or {}).get("tokens")) or [])


def choice_top_logprobs(is_chat: bool, choice: dict) -> list[list[dict]]:
    """The alternatives per position as `[{"token", "logprob"}, ...]` (empty where none)."""
    if is_chat:
        return [[{"token": t.get("token"), "logprob": t.get("logprob")}
                 for t in e.get("top_logprobs") or []]
                for e in _chat_logprob_entries(choice)]
    tops = ((choice.get("logprobs") or {}).get("top_logprobs")) or []
    return [[{"token": k, "logprob": v} for k, v in (d or {}).items()] for d in tops]


def choice_text(is_chat: bool, choice: dict) -> str:
    if is_chat:
        return ((choice.get("message") or choice.get("delta") or {}).get("content")) or ""
    return choice.get("text") or ""


def _displayed(tops: list[list[dict]]) -> list[list[dict]] | None:
    """Top logprobs for people reading a record: only where the worker sent any."""
    return tops if any(tops) else None


def record_choices(is_chat: bool, answer: dict, echo: bool = False) -> list[RecordChoice]:
    """The record's per-choice view of a complete (non-streamed) answer. With `echo` a
    completion's logprobs start with its prompt's: those are kept apart (compared too)."""
    out = []
    for i, c in enumerate(answer.get("choices") or []):
        choice = RecordChoice(index=c.get("index", i), text=choice_text(is_chat, c),
                              finish_reason=c.get("finish_reason"),
                              token_ids=choice_token_ids(is_chat, c),
                              logprobs=choice_logprobs(is_chat, c),
                              tokens=choice_tokens(is_chat, c),
                              top_logprobs=_displayed(choice_top_logprobs(is_chat, c)),
                              tool_calls=_tool_calls(is_chat, c))
        if echo and not is_chat:
            _split_echo(choice, c.get("prompt_token_ids") or [])
        out.append(choice)
    return out


def _tool_calls(is_chat: bool, choice: dict) -> list[dict] | None:
    if not is_chat:
        return None
    return (choice.get("message") or {}).get("tool_calls") or None


def _split_echo(choice: RecordChoice, prompt_ids: list[int]) -> None:
    n = len(prompt_ids)
    choice.prompt_token_ids = list(prompt_ids)
    choice.prompt_logprobs, choice.logprobs = choice.logprobs[:n], choice.logprobs[n:]
    if choice.tokens is not None:
        choice.tokens = choice.tokens[n:]
    if choice.top_logprobs is not None:
        choice.top_logprobs = choice.top_logprobs[n:]


def prompt_extras(answer: dict) -> dict[str, Any]:
    """Prompt token ids and prompt logprobs, wherever this worker put them."""
    out: dict[str, Any] = {}
    first = (answer.get("choices") or [{}])[0]
    ids = answer.get("prompt_token_ids") or first.get("prompt_token_ids")
    if ids is not None:
        out["prompt_token_ids"] = ids
    plp = answer.get("prompt_logprobs") or first.get("prompt_logprobs")
    if plp is not None:
        out["prompt_logprobs"] = plp
    return out


def _strip_choice(is_chat: bool, choice: dict, ask: ClientAsk) -> None:
    if not ask.token_ids:
        choice.pop("token_ids", None)
        choice.pop("prompt_token_ids", None)
    lp = choice.get("logprobs")
    if not ask.logprobs:
        if "logprobs" in choice:
            choice["logprobs"] = None
    elif lp and not is_chat and lp.get("top_logprobs"):
        # Completions were asked for at least one alternative; give the count asked.
        k = ask.top_logprobs
        lp["top_logprobs"] = [None if d is None else dict(list(d.items())[:k])
                              for d in lp["top_logprobs"]]


def shape_answer(is_chat: bool, answer: dict, ask: ClientAsk, record_id: str,
                 fingerprint: str | None) -> dict:
    """The client's answer: our id and fingerprint, and only what the client asked for."""
    answer["id"] = record_id
    answer["system_fingerprint"] = fingerprint
    if not ask.token_ids:
        answer.pop("prompt_token_ids", None)
    for choice in answer.get("choices") or []:
        _strip_choice(is_chat, choice, ask)
    return answer


def shape_chunk(is_chat: bool, chunk: dict, ask: ClientAsk, record_id: str,
                fingerprint: str | None) -> dict | None:
    """One SSE chunk for the client, or None to drop it (a usage chunk nobody asked for)."""
    choices = chunk.get("choices") or []
    if not choices and chunk.get("usage") is not None and not ask.include_usage:
        return None
    if not ask.include_usage:
        chunk.pop("usage", None)
    shape_answer(is_chat, chunk, ask, record_id, fingerprint)
    return chunk


class StreamAccumulator:
    """Builds the record's choices from streamed chunks, as they pass through."""

    def __init__(self, is_chat: bool) -> None:
        self.is_chat = is_chat
        self.choices: dict[int, RecordChoice] = {}
        self.usage: dict | None = None
        self.fingerprint: str | None = None
        self.extras: dict[str, Any] = {}
        self.model: str | None = None

    def add(self, chunk: dict) -> None:
        if chunk.get("system_fingerprint"):
            self.fingerprint = chunk["system_fingerprint"]
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        self.model = self.model or chunk.get("model")
        if not self.extras:
            self.extras = prompt_extras(chunk)
        for c in chunk.get("choices") or []:
            idx = c.get("index", 0)
            acc = self.choices.setdefault(idx, RecordChoice(idx, tokens=[], top_logprobs=[]))
            acc.text += choice_text(self.is_chat, c)
            ids = choice_token_ids(self.is_chat, c)
            if ids is None:
                acc.token_ids = None  # some tokens came without ids: do not fake a sequence
            elif acc.token_ids is not None:
                acc.token_ids.extend(ids)
            acc.logprobs.extend(choice_logprobs(self.is_chat, c))
            acc.tokens.extend(choice_tokens(self.is_chat, c))
            acc.top_logprobs.extend(choice_top_logprobs(self.is_chat, c))
            for delta in ((c.get("delta") or {}).get("tool_calls") or []) if self.is_chat else []:
                _merge_call(acc, delta)
            if c.get("finish_reason") is not None:
                acc.finish_reason = c["finish_reason"]

    def record_choices(self) -> list[RecordChoice]:
        return [replace(self.choices[i], top_logprobs=_displayed(self.choices[i].top_logprobs))
                for i in sorted(self.choices)]


def _merge_call(acc: RecordChoice, delta: dict) -> None:
    """OpenAI's streamed tool calls: a call's first delta has its id and name, later ones
    add to its arguments (matched by `index`)."""
    calls = acc.tool_calls = acc.tool_calls or []
    index = delta.get("index", len(calls))
    while len(calls) <= index:
        calls.append({"id": None, "type": "function", "function": {"name": None,
                                                                   "arguments": ""}})
    call, fn = calls[index], delta.get("function") or {}
    call["id"] = delta.get("id") or call["id"]
    call["function"]["name"] = fn.get("name") or call["function"]["name"]
    call["function"]["arguments"] += fn.get("arguments") or ""


def parse_answer(raw: bytes) -> Any:
    """A worker's whole answer, decoded; UpstreamFailed when it is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UpstreamFailed("the worker's answer is not JSON") from None


def worker_error(status: int, raw: bytes) -> UpstreamRejected:
    """A worker's 4xx as our error, whichever shape it used (vLLM's code is an integer)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        err = body if isinstance(body, dict) else {}
    message = err.get("message") or err.get("detail") or raw[:500].decode(errors="replace") \
        or f"worker answered {status}"
    if not isinstance(message, str):
        message = orjson.dumps(message).decode()
    code = err.get("code")
    param = err.get("param")
    return UpstreamRejected(status, message,
                            param=param if isinstance(param, str) else None,
                            code=code if isinstance(code, str) else None)


def stream_error_code(chunk: dict) -> str | None:
    """The `code` of a stream's error event, when it is a string."""
    err = chunk.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None


def stream_error(chunk: dict) -> str | None:
    """vLLM reports failures inside a stream as a `data: {"error": {...}}` event."""
    err = chunk.get("error")
    if err is None:
        return None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)
