"""`GET /openapi.json`: the gateway's OpenAPI document, built from the protocol models.

The request bodies are the same pydantic models that validate requests (gateway/protocol.py),
so the document cannot drift from what is accepted; the limits that are settings (max_tokens,
n, ...) are checked at run time and answered 400 like any other bad input.
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from detgate.contract.constants import STATUSES
from detgate.gateway import protocol

_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}},
}
_OBJECT = {"type": "object"}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _responses(ok: str, ok_content: dict | None = None) -> dict:
    return {"200": {"description": ok, "content": ok_content or _json(_OBJECT)},
            "default": {"description": "an error, always in this shape",
                        "content": _json({"$ref": "#/components/schemas/Error"})}}


def document() -> dict[str, Any]:
    schemas: dict[str, Any] = {"Error": _ERROR}

    def body(model: type[BaseModel], required: bool = True) -> dict:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        return {"required": required,
                "content": _json({"$ref": f"#/components/schemas/{model.__name__}"})}

    record_id = {"name": "record_id", "in": "path", "required": True,
                 "schema": {"type": "string"}}
    generation = {"text/event-stream": {"schema": {"type": "string"}}, **_json(_OBJECT)}
    paths = {
        protocol.CHAT: {"post": {
            "operationId": "chat_completions", "requestBody": body(protocol.ChatRequest),
            "responses": _responses("the answer (or an SSE stream); recorded", generation)}},
        protocol.COMPLETIONS: {"post": {
            "operationId": "completions", "requestBody": body(protocol.CompletionRequest),
            "responses": _responses("the answer (or an SSE stream); recorded", generation)}},
        protocol.SCORE: {"post": {
            "operationId": "score", "requestBody": body(protocol.ScoreBody),
            "responses": _responses("teacher-forced logprobs")}},
        "/v1/models": {"get": {"operationId": "models", "responses": _responses("models")}},
        "/v1/requests": {"get": {
            "operationId": "list_records",
            "parameters": [
                {"name": "limit", "in": "query",
                 "schema": {"type": "integer", "minimum": 1, "maximum": 1000}},
                {"name": "after", "in": "query", "schema": {"type": "string"}},
                {"name": "status", "in": "query", "schema": {"enum": list(STATUSES)}},
                {"name": "replay", "in": "query",
                 "schema": {"enum": ["match", "diverged", "none"]}}],
            "responses": _responses("the caller's records, newest first")}},
        "/v1/requests/{record_id}": {"get": {
            "operationId": "get_record", "parameters": [record_id],
            "responses": _responses("the record")}},
        "/replay/{record_id}": {"post": {
            "operationId": "replay", "parameters": [record_id],
            "requestBody": body(protocol.ReplayBody, required=False),
            "responses": _responses("the comparison")}},
        "/v1/drift": {
            "post": {"operationId": "drift", "requestBody": body(protocol.DriftBody),
                     "responses": _responses("the drift report")},
            "get": {"operationId": "last_drift",
                    "responses": _responses("the caller's last drift report")}},
        "/metrics": {"get": {"operationId": "metrics", "responses": _responses(
            "Prometheus text", {"text/plain": {"schema": {"type": "string"}}})}},
        "/healthz": {"get": {"operationId": "healthz", "responses": _responses("up")}},
        "/readyz": {"get": {"operationId": "readyz", "responses": _responses("ready")}},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "detgate gateway", "version": "1"},
        "paths": paths,
        "components": {"schemas": schemas, "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}, {}],
    }


def route() -> Route:
    raw = orjson.dumps(document())

    async def openapi(request: Request) -> Response:
        return Response(raw, media_type="application/json")

    return Route("/openapi.json", openapi, methods=["GET"])
