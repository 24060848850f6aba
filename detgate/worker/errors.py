"""The worker's error types. The server maps each to an HTTP status and the OpenAI error shape
in one place; the engine raises them without knowing about HTTP."""

from __future__ import annotations

from detgate.contract.constants import WEIGHTS_UPDATED


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


class WeightsUpdated(WorkerError):
    """The sequence was aborted by a weight update (`abort_all_requests`): it would otherwise
    have mixed two versions of the weights. 409, which OpenAI clients retry."""

    status = 409
    type = "conflict_error"

    def __init__(self) -> None:
        super().__init__("aborted: the worker's weights were updated while this request ran; "
                         "retry to run it on the new weights", code=WEIGHTS_UPDATED)


class AdminUnauthorized(WorkerError):
    status = 401
    type = "authentication_error"


class AdminDisabled(WorkerError):
    status = 403
    type = "permission_error"


class NotFoundError(WorkerError):
    status = 404
    type = "not_found_error"
