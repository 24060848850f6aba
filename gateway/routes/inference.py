"""`POST /v1/completions`, `POST /v1/chat/completions`: validate -> route -> forward -> record.

A non-streamed answer is recorded before it is returned; a streamed one when it ends, before
`data: [DONE]` (or as `aborted` when the client leaves). A 2xx or a `[DONE]` is sent only once
the record is durable (in Redis or the spool); otherwise a 503, or an error event and no
`[DONE]`. A shutdown past its grace ends what still runs as `aborted`, in the error shape.
The client's answer carries the record id as `id` and in `X-Detgate-Record-Id`, and the
worker's fingerprint.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from detgate.contract.record import Record, RecordChoice
from gateway import protocol, responses
from gateway.errors import (
    GatewayError,
    RateLimited,
    RecorderUnavailable,
    ShuttingDown,
    UpstreamFailed,
    UpstreamRejected,
    UpstreamTimeout,
    error_body,
)
from gateway.forward import Lease
from gateway.interrupts import EJECTED, SHUTDOWN
from gateway.protocol import ParsedRequest
from gateway.recorder import now
from gateway.services import Services, new_record_id, read_body, resolve_tenant, services
from gateway.upstream import TimedOut, Unreachable

RECORD_HEADER = "X-Detgate-Record-Id"


async def completions(request: Request) -> Response:
    return await _handle(request, protocol.COMPLETIONS)


async def chat_completions(request: Request) -> Response:
    return await _handle(request, protocol.CHAT)


# Plain Starlette routes: the hot path needs no dependency injection, and FastAPI's
# per-request parameter solving showed up in profiles of it.
routes = [Route(protocol.COMPLETIONS, completions, methods=["POST"]),
          Route(protocol.CHAT, chat_completions, methods=["POST"])]


async def _handle(request: Request, endpoint: str) -> Response:
    svc = services(request)
    tenant = await resolve_tenant(request)
    raw = await read_body(request, svc.settings.max_body_bytes, svc.settings.body_timeout_s)
    parsed = protocol.parse(endpoint, raw, svc.settings)
    if svc.drain.draining:
        raise ShuttingDown("the gateway is shutting down; retry on another instance")
    svc.recorder.ensure_up()
    record_id = new_record_id(endpoint)
    try:
        await svc.admit(tenant)
    except RateLimited as exc:
        # Recorded too, as a bounded summary: a flood of refusals stores little.
        exc.headers[RECORD_HEADER] = record_id
        await svc.save_quietly(tenant, _record(parsed, record_id, None, None, "failed",
                                               choices=[], usage=None, error=exc.message),
                               refused=True)
        raise
    deadline = time.monotonic() + svc.settings.total_timeout_s
    if parsed.stream:
        return await _stream(svc, request, tenant, parsed, record_id, deadline)
    return await _whole(svc, request, tenant, parsed, record_id, deadline)


def _record(parsed: ParsedRequest, record_id: str, worker: str | None, fingerprint: str | None,
            status: str, choices: list[RecordChoice], usage: dict | None, **extras) -> Record:
    """The record to store; `extras`: `error` and the worker's prompt token ids and logprobs."""
    return Record(id=record_id, created=now(), endpoint=parsed.endpoint, model=parsed.model,
                  request=parsed.body, worker=worker, system_fingerprint=fingerprint,
                  status=status, choices=choices, usage=usage, **extras)


async def _whole(svc: Services, request: Request, tenant: str, parsed: ParsedRequest,
                 record_id: str, deadline: float) -> Response:
    async with _forwarding(svc, tenant, parsed, record_id), \
            svc.forwarder.lease(parsed.model, deadline=deadline) as lease:
        reply = await lease.send(parsed.endpoint, orjson.dumps(parsed.body))
        request.state.upstream_s = lease.upstream_s
        answer = responses.parse_answer(reply.body)
    fingerprint = lease.learn(answer.get("system_fingerprint"))
    svc.charge_tokens(tenant, answer.get("usage"))
    await svc.save(tenant, _record(
        parsed, record_id, lease.worker.name, fingerprint, "complete",
        choices=responses.record_choices(parsed.is_chat, answer), usage=answer.get("usage"),
        **responses.prompt_extras(answer)))
    body = responses.shape_answer(parsed.is_chat, answer, parsed.ask, record_id, fingerprint)
    return Response(orjson.dumps(body), media_type="application/json",
                    headers={RECORD_HEADER: record_id})


@contextlib.asynccontextmanager
async def _forwarding(svc: Services, tenant: str, parsed: ParsedRequest, record_id: str
                      ) -> AsyncIterator[None]:
    """Around sending a request to a worker (tracked for the shutdown drain): a request that
    gets no answer is recorded `failed`, or `aborted` when the gateway shuts down first."""
    try:
        with svc.drain.track():
            yield
    except (UpstreamRejected, UpstreamFailed, UpstreamTimeout) as exc:
        await _record_failure(svc, tenant, parsed, record_id, exc)
        raise
    except asyncio.CancelledError:
        if not svc.interrupts.take(SHUTDOWN):
            raise
        exc = ShuttingDown("the gateway shut down before the worker answered")
        await _record_failure(svc, tenant, parsed, record_id, exc, status="aborted")
        raise exc from None


async def _record_failure(svc: Services, tenant: str, parsed: ParsedRequest, record_id: str,
                          exc: GatewayError, status: str = "failed") -> None:
    """A forwarded request that got no answer is recorded too, and the client told its id."""
    exc.headers[RECORD_HEADER] = record_id
    await svc.save_quietly(tenant, _record(parsed, record_id, None, None, status,
                                           choices=[], usage=None, error=exc.message))


async def _stream(svc: Services, request: Request, tenant: str, parsed: ParsedRequest,
                  record_id: str, deadline: float) -> Response:
    lease = svc.forwarder.lease(parsed.model, deadline=deadline)
    async with _forwarding(svc, tenant, parsed, record_id):
        await lease.open_stream(parsed.endpoint, orjson.dumps(parsed.body))
    return StreamingResponse(  # the relay owns the open lease from here
        _relay(svc, request, tenant, parsed, record_id, deadline, lease),
        media_type="text/event-stream",
        headers={RECORD_HEADER: record_id, "Cache-Control": "no-cache"})


def _sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _relay(svc: Services, request: Request, tenant: str, parsed: ParsedRequest,
                 record_id: str, deadline: float, lease: Lease) -> AsyncIterator[bytes]:
    worker = lease.worker
    acc = responses.StreamAccumulator(parsed.is_chat)
    error: GatewayError | None = None
    status = "failed"

    def record() -> Record:
        fingerprint = acc.fingerprint or worker.fingerprint
        extra = {"error": error.message} if error is not None else {}
        return _record(parsed, record_id, worker.name, fingerprint, status,
                       choices=acc.record_choices(), usage=acc.usage, **acc.extras, **extra)

    ended = True
    try:
        async with lease:  # an ejection of the worker interrupts the relay (EJECTED)
            with svc.drain.track():
                async for chunk in lease.events():
                    message = responses.stream_error(chunk)
                    if message is not None:
                        error = UpstreamFailed(message)
                        break
                    acc.add(chunk)
                    fingerprint = acc.fingerprint or worker.fingerprint
                    out = responses.shape_chunk(parsed.is_chat, chunk, parsed.ask, record_id,
                                                fingerprint)
                    if out is not None:
                        yield _sse(out)
                    if time.monotonic() > deadline:
                        error = UpstreamTimeout("the request ran out of its total time")
                        break
                else:
                    if lease.complete:
                        status = "complete"
                    else:
                        error = UpstreamFailed("the worker ended the stream without [DONE]")
    except (Unreachable, TimedOut, orjson.JSONDecodeError) as exc:
        error = UpstreamFailed(f"the worker failed mid-stream ({_what(exc)})")
    except asyncio.CancelledError:
        if svc.interrupts.take(EJECTED):
            # Tokens already reached the client: no retry, a failed record at once.
            error = UpstreamFailed("the worker stopped answering mid-stream")
        elif svc.interrupts.take(SHUTDOWN):
            status = "aborted"
            error = ShuttingDown("the gateway shut down before the stream ended")
            ended = False
        else:  # the client left: record what was sent
            status = "aborted"
            svc.spawn(svc.save_quietly(tenant, record()))
            raise
    except BaseException:
        # The generator was closed: record what was sent.
        status = "aborted"
        svc.spawn(svc.save_quietly(tenant, record()))
        raise
    finally:
        request.state.upstream_s = lease.upstream_s
    lease.learn(acc.fingerprint)
    svc.charge_tokens(tenant, acc.usage)
    try:
        await svc.save(tenant, record())
    except RecorderUnavailable as exc:
        # `[DONE]` promises a durable record: without one the stream ends in an error event.
        error = exc
        yield _error_event(error)
        return
    if error is not None:
        yield _error_event(error)
    if ended:  # a cut stream ends in its error event; a failed one is over and recorded
        yield b"data: [DONE]\n\n"


def _what(exc: Exception) -> str:
    """A tenant-facing cause: no worker address, no user-info, no library text."""
    if isinstance(exc, TimedOut):
        return "timed out"
    if isinstance(exc, orjson.JSONDecodeError):
        return "an event that is not JSON"
    return "connection lost"


def _error_event(error: GatewayError) -> bytes:
    return b"data: " + error_body(error.message, error.type, None, error.code) + b"\n\n"
