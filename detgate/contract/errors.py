"""The OpenAI error shape, and the mappings both HTTP servers (gateway and worker) share.

`{"error": {"message", "type", "param", "code"}}` is every error a client of detgate sees;
each server maps its own exception hierarchy to it in one place (gateway/errors.py,
worker/server/app.py) and takes what is common from here: the body, the reading of a request
validation failure, and the type of a plain HTTP status.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

INVALID_REQUEST = "invalid_request_error"


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_error(errors: Sequence[dict[str, Any]]) -> tuple[str, str | None, str | None]:
    """(message, param, code) of a request that failed validation, from pydantic's error list:
    the first error, its location in the body as `param` (dotted), its type as `code`."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None, "json_invalid"
    # A model-level error names its field in its context (the first of several refused).
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") \
        or (first.get("ctx") or {}).get("param")
    message = first.get("msg", "invalid request")
    return (f"{param}: {message}" if param else message), param, first.get("type")


def http_error_type(status: int) -> str:
    """The error type of a plain HTTP status (an unknown route, a wrong method): OpenAI's API
    answers an unknown URL with invalid_request_error too."""
    return INVALID_REQUEST if status < 500 else "server_error"
