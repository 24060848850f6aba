"""One error hierarchy for the gateway, mapped to the OpenAI error shape in one place.

Every failure a client can see is a `GatewayError`; `install(app)` turns those, FastAPI's
validation errors, unknown routes and anything unexpected into
`{"error": {"message", "type", "param", "code"}}`, never a stack trace. Bad input is
always a 4xx: validation errors answer 400, not FastAPI's 422.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from detgate.contract import errors

log = logging.getLogger("detgate.gateway")


class GatewayError(Exception):
    """A failure the client sees. Each kind of error names its `status`, and the error
    shape's `type` and default `code`, in its class statement:
    `class NotFound(GatewayError, status=404, type="not_found_error", code="not_found")`."""

    status = 500
    type = "server_error"
    code: str | None = None

    def __init_subclass__(cls, *, status: int | None = None, type: str | None = None,
                          code: str | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, value in (("status", status), ("type", type), ("code", code)):
            if value is not None:
                setattr(cls, name, value)

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}


class BadRequest(GatewayError, status=400, type=errors.INVALID_REQUEST):
    """Input the gateway does not accept (FastAPI's validation errors included)."""


class Unauthorized(GatewayError, status=401, type="authentication_error",
                   code="invalid_api_key"):
    """No API key, or one that no tenant has."""


class NotFound(GatewayError, status=404, type="not_found_error", code="not_found"):
    """No such record or model."""


class Conflict(GatewayError, status=409, type="conflict_error", code="no_matching_worker"):
    """The request is valid but cannot be served as asked: no worker with the fingerprint
    asked for, a record that cannot be replayed."""


class RequestTimeout(GatewayError, status=408, type="invalid_request_error",
                     code="request_timeout"):
    """The request's body did not arrive in time."""


class PayloadTooLarge(GatewayError, status=413, type="invalid_request_error",
                      code="request_too_large"):
    """The request's body is over the limit."""


class RateLimited(GatewayError, status=429, type="rate_limit_error"):
    """Over one of the tenant's limits; `code` names which (gateway/limits.py)."""

    def __init__(self, message: str, *, code: str, retry_after_s: int) -> None:
        super().__init__(message, code=code, headers={"Retry-After": str(retry_after_s)})


class UpstreamRejected(GatewayError, type="invalid_request_error"):
    """A worker answered 4xx: its message and status reach the client unchanged."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)
        self.status = status


class UpstreamFailed(GatewayError, status=502, type="upstream_error", code="upstream_failed"):
    """No usable answer from a worker (unreachable, 5xx, broken stream, not JSON)."""


class UpstreamTimeout(GatewayError, status=504, type="upstream_error",
                      code="upstream_timeout"):
    """A worker did not answer in time, or the request ran out of its total time."""


class NoWorker(GatewayError, status=503, type="service_unavailable",
               code="no_healthy_worker"):
    """No healthy worker, or none that serves the model."""


class Overloaded(GatewayError, status=503, type="service_unavailable", code="overloaded"):
    """Every worker slot is taken and the gateway's queue is full, or a request waited in it
    too long (gateway/admission.py)."""


class ClientClosed(GatewayError, status=499, type="invalid_request_error",
                   code="client_closed_request"):
    """The client left before its answer: the status is only for metrics and logs."""


class ShuttingDown(GatewayError, status=503, type="service_unavailable",
                   code="shutting_down"):
    """The gateway is stopping: a new request, or one still running when the grace ended."""


class RecorderUnavailable(GatewayError, status=503, type="service_unavailable",
                          code="recorder_unavailable"):
    """Redis is unreachable: answers that cannot be recorded are not served."""


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> bytes:
    return orjson.dumps(errors.error_body(message, type_, param, code))


def error_response(exc: GatewayError) -> Response:
    body = error_body(exc.message, exc.type, exc.param, exc.code)
    return Response(body, status_code=exc.status, media_type="application/json",
                    headers=exc.headers)


def install(app: FastAPI) -> None:
    @app.exception_handler(GatewayError)
    async def _gateway_error(request: Request, exc: GatewayError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        message, param, code = errors.validation_error(exc.errors())
        return error_response(BadRequest(message, param=param, code=code))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        body = error_body(str(exc.detail), errors.http_error_type(exc.status_code))
        # Starlette's 405 names the allowed methods in `Allow`: keep it.
        return Response(body, status_code=exc.status_code, media_type="application/json",
                        headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(GatewayError("internal error"))
