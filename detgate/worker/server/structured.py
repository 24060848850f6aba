"""Structured output: `response_format` and `tools` / `tool_choice` as a grammar over the
generated text, and the generated text back as OpenAI `tool_calls`.

Tool calls follow vLLM's forms, so a gateway's clients see the same answers from either kind
of worker: a named function's call is its `parameters` schema alone (the text is the call's
arguments); `required` is a JSON array of `{"name", "parameters"}` (at most one item without
`parallel_tool_calls`; with a single tool, that tool's named form); `auto` is free text in
which each call is Hermes' `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`, its
arguments held to the tool's schema from the tag on (an xgrammar structural tag). `none`
and `text` constrain nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from detgate.worker.engine.constraint import Constraint
from detgate.worker.errors import InvalidRequest
from detgate.worker.model.grammar import CompiledGrammar, GrammarCompiler, GrammarError
from detgate.worker.server.protocol import NamedToolChoice, ResponseFormat, Tool

TOOL_CALL_OPEN = "<tool_call>"
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolMode:
    """How a chat answer's text becomes tool calls: "named" (its name), "required", "auto"."""

    kind: str
    name: str | None = None


@dataclass(frozen=True)
class Structure:
    grammar: CompiledGrammar | None
    tools: ToolMode | None


def structure(compiler: GrammarCompiler, response_format: ResponseFormat | None,
              tools: list[Tool] | None, tool_choice: Any, parallel: bool) -> Structure:
    """The grammar a request's fields ask for (compiled, cached by the compiler) and how its
    answer is read. A forced tool call (`required`, a named function) wins over
    `response_format`; `auto` with a JSON `response_format` keeps the format."""
    mode = _tool_mode(tools, tool_choice)
    try:
        if mode is not None and mode.kind == "named":
            return Structure(compiler.json_schema(_parameters(tools, mode.name)), mode)
        if mode is not None and mode.kind == "required":
            return Structure(compiler.json_schema(_required_schema(tools, parallel)), mode)
        if response_format is not None and response_format.type != "text":
            return Structure(compiler.json_schema(_format_schema(response_format)), None)
        if mode is not None:  # auto
            return Structure(compiler.structural_tag(_auto_tag(tools, parallel)), mode)
    except GrammarError as exc:
        param = "tools" if mode is not None else "response_format"
        raise InvalidRequest(f"cannot constrain the answer to this schema: {exc}",
                             param=param) from None
    return Structure(None, None)


def constraint(grammar: CompiledGrammar | None, min_tokens: int, stop_ids: tuple[int, ...]
               ) -> Constraint | None:
    if grammar is None and not min_tokens:
        return None
    return Constraint(grammar, min_tokens, stop_ids)


def _tool_mode(tools: list[Tool] | None, choice: Any) -> ToolMode | None:
    if not tools:
        if isinstance(choice, NamedToolChoice) or choice == "required":
            raise InvalidRequest("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in {t.function.name for t in tools}:
            raise InvalidRequest(f"tool_choice names '{choice.function.name}', which is not "
                                 "among 'tools'", param="tool_choice")
        return ToolMode("named", choice.function.name)
    if choice == "required" and len(tools) == 1:
        # One tool to call: the named form, without the array around it (shorter, and the
        # call a client gets is the same).
        return ToolMode("named", tools[0].function.name)
    return ToolMode(choice)


def _parameters(tools: list[Tool], name: str) -> dict[str, Any]:
    tool = next(t for t in tools if t.function.name == name)
    return tool.function.parameters or _ANY_OBJECT


def _required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": t.function.parameters or _ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _format_schema(fmt: ResponseFormat) -> dict[str, Any]:
    if fmt.type == "json_object":
        return _ANY_OBJECT  # OpenAI's json_object is an object, not any JSON value
    return fmt.json_schema.schema_ or _ANY_OBJECT


def _auto_tag(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    tags = [{"type": "tag",
             "begin": f'{TOOL_CALL_OPEN}\n{{"name": {json.dumps(t.function.name)}, '
                      '"arguments": ',
             "content": {"type": "json_schema",
                         "json_schema": t.function.parameters or _ANY_OBJECT},
             "end": "}\n</tool_call>"}
            for t in tools]
    return {"type": "structural_tag",
            "format": {"type": "triggered_tags", "triggers": [TOOL_CALL_OPEN], "tags": tags,
                       "at_least_one": False, "stop_after_first": not parallel}}


# -- reading the answer ----------------------------------------------------------------------


def tool_calls(mode: ToolMode, text: str, call_id: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of a finished answer's text; calls as OpenAI's `tool_calls` items,
    their ids `call_id` plus the call's index. Text that does not parse (cut by max_tokens)
    stays content, except a named call, whose text is its arguments however far it got."""
    if mode.kind == "named":
        return None, [_call(call_id, 0, mode.name, text)]
    if mode.kind == "required":
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        return None, [_call(call_id, i, it["name"], _dumps(it["parameters"]))
                      for i, it in enumerate(items)]
    calls = []
    for match in _CALL.finditer(text):
        try:
            body = json.loads(match.group(1))
        except ValueError:
            continue
        calls.append(_call(call_id, len(calls), body.get("name"),
                           _dumps(body.get("arguments", {}))))
    if not calls:
        return text, []
    content = _CALL.sub("", text).strip()
    return content or None, calls


def streamed_content(mode: ToolMode | None, text: str) -> str:
    """The part of a growing answer that is content for sure (sent as it comes): all of it
    without tools; none for a forced call; up to the first tool call for `auto`, less any tail
    that could still begin one."""
    if mode is None:
        return text
    if mode.kind != "auto":
        return ""
    at = text.find(TOOL_CALL_OPEN)
    if at >= 0:
        return text[:at]
    for k in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-k:]):
            return text[:-k]
    return text


def _call(call_id: str, index: int, name: str | None, arguments: str) -> dict:
    return {"id": f"{call_id}-{index}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
