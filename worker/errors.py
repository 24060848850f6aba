"""The worker's error types. The server maps each to an HTTP status and the OpenAI error shape
in one place; the engine raises them without knowing about HTTP."""

from __future__ import annotations


class WorkerError(Exception):
    status = 500
    type = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequest(WorkerError):
    status = 400
    type = "invalid_request_error"


class EngineDead(WorkerError):
    """The engine loop stopped (shutdown or a failed step); the request cannot be served."""

    status = 503
    type = "service_unavailable"
