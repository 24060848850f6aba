"""`POST /v1/completions`, `POST /v1/chat/completions`: validate -> route -> forward -> record.

A request is checked against what its model's workers accept (gateway/worker_limits.py)
before anything is forwarded. A non-streamed answer is recorded before it is returned; a
streamed one when it ends, before `data: [DONE]`. A 2xx or a `[DONE]` is sent only once the
record is durable (in Redis or the spool); otherwise a 503, or an error event and no
`[DONE]`: a stream that fails after its first event ends in an error event, never in
`[DONE]`. A client that leaves gets its request stopped on the worker and recorded `aborted`
with the tokens generated so far (a non-streamed one too, gateway/disconnect.py); so is a
request the worker aborted for a weight update (code `weights_updated`). A shutdown past its
grace ends what still runs as `aborted`, in the error shape. The client's answer carries the
record id as `id` and in `X-Detgate-Record-Id`, and the worker's fingerprint.
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

from detgate.contract.constants import WEIGHTS_UPDATED
from detgate.contract.record import Record, RecordChoice
from detgate.gateway import protocol, responses
from detgate.gateway.disconnect import ClientWatch
from detgate.gateway.errors import (
    ClientClosed,
    GatewayError,
    RateLimited,
    RecorderUnavailable,
    ShuttingDown,
    UpstreamFailed,
    UpstreamRejected,
    UpstreamTimeout,
    error_body,
)
from detgate.gateway.forward import Lease
from detgate.gateway.interrupts import CLIENT_GONE, EJECTED, SHUTDOWN
from detgate.gateway.protocol import ParsedRequest
from detgate.gateway.recorder import now
from detgate.gateway.router import Worker
from detgate.gateway.services import Services, new_record_id, read_body, services
from detgate.gateway.upstream import TimedOut, Unreachable
from detgate.gateway.worker_limits import check_fits

RECORD_HEADER = "X-Detgate-Record-Id"


async def completions(request: Request) -> Response:
    return await handle(services(request), request, protocol.COMPLETIONS)


async def chat_completions(request: Request) -> Response:
    return await handle(services(request), request, protocol.CHAT)


# The gateway process serves these two through gateway/front.py, which calls `handle`
# directly; as routes of the app they document it (/openapi.json) and serve the app alone.
routes = [Route(protocol.COMPLETIONS, completions, methods=["POST"]),
          Route(protocol.CHAT, chat_completions, methods=["POST"])]


async def handle(svc: Services, request: Request, endpoint: str) -> Response:
    """validate -> route -> forward -> record; the answer (errors raised as GatewayError)."""
    tenant = svc.auth.tenant(request.headers.get("authorization"))
    raw = await read_body(request, svc.settings.max_body_bytes, svc.settings.body_timeout_s)
    parsed = protocol.parse(endpoint, raw, svc.settings)
    limits = svc.router.limits(parsed.model)
    check_fits(limits, parsed.body, asked=parsed.max_tokens, token_prompts=parsed.token_prompts,
               text_chars=len(raw), prompt_param="messages" if parsed.is_chat else "prompt")
    if svc.drain.draining:
        raise ShuttingDown("the gateway is shutting down; retry on another instance")
    svc.recorder.ensure_up()
    record_id = new_record_id(endpoint)
    try:
        await svc.admit(tenant)
    except RateLimited as exc:
        # Kept as a bounded summary in the tenant's refusal ring, within its storage budget.
        if await svc.save_refusal(tenant, _record(parsed, record_id, None, None, "failed",
                                                  choices=[], usage=None, error=exc.message)):
            exc.headers[RECORD_HEADER] = record_id
        raise
    lease = svc.forwarder.lease(
        parsed.model, deadline=time.monotonic() + svc.settings.total_timeout_s,
        weight=parsed.n, request_id=record_id,
        tokens=parsed.n * (parsed.max_tokens or (limits and limits.max_model_len)
                           or svc.settings.max_tokens))
    if parsed.stream:
        return await _stream(svc, request, tenant, parsed, record_id, lease)
    return await _whole(svc, request, tenant, parsed, record_id, lease)


def _record(parsed: ParsedRequest, record_id: str, worker: Worker | None,
            fingerprint: str | None, status: str, choices: list[RecordChoice],
            usage: dict | None, **extras) -> Record:
    """The record to store; `extras`: `error` and the worker's prompt token ids and logprobs."""
    return Record(id=record_id, created=now(), endpoint=parsed.endpoint, model=parsed.model,
                  request=parsed.body, worker=worker.name if worker else None,
                  system_fingerprint=fingerprint, status=status, choices=choices, usage=usage,
                  machine=worker.machine if worker else None, **extras)


async def _whole(svc: Services, request: Request, tenant: str, parsed: ParsedRequest,
                 record_id: str, lease: Lease) -> Response:
    with ClientWatch(svc, request, lease, record_id, abort=True) as watch:
        async with _forwarding(svc, tenant, parsed, record_id, lease), lease:
            reply = await lease.send(parsed.endpoint, parsed.wire)
    request.state.upstream_s = lease.upstream_s
    answer = responses.parse_answer(reply.body)
    fingerprint = lease.learn(answer.get("system_fingerprint"))
    # A client that left got nothing: its record keeps what the worker had generated.
    status = "aborted" if watch.gone else "complete"
    usage = answer.get("usage")
    await svc.save(tenant, _record(
        parsed, record_id, lease.worker, fingerprint, status,
        choices=responses.record_choices(parsed.is_chat, answer, bool(parsed.body.get("echo"))),
        usage=usage, **responses.prompt_extras(answer)), usage=usage)
    if watch.gone:
        raise ClientClosed("the client left before its answer")
    body = responses.shape_answer(parsed.is_chat, answer, parsed.ask, record_id, fingerprint)
    return Response(orjson.dumps(body), media_type="application/json",
                    headers={RECORD_HEADER: record_id})


@contextlib.asynccontextmanager
async def _forwarding(svc: Services, tenant: str, parsed: ParsedRequest, record_id: str,
                      lease: Lease) -> AsyncIterator[None]:
    """Around sending a request to a worker (tracked for the shutdown drain): a request that
    gets no answer is recorded `failed` (a summary when the worker refused it), or `aborted`
    when the gateway shuts down or the client leaves first (if it reached a worker)."""
    try:
        with svc.drain.track():
            yield
    except UpstreamRejected as exc:
        if exc.code == WEIGHTS_UPDATED:  # the worker aborted it for a weight update
            await _record_failure(svc, tenant, parsed, record_id, exc, status="aborted")
        else:
            await _record_failure(svc, tenant, parsed, record_id, exc, rejected=True)
        raise
    except (UpstreamFailed, UpstreamTimeout) as exc:
        await _record_failure(svc, tenant, parsed, record_id, exc)
        raise
    except asyncio.CancelledError:
        if svc.interrupts.take(SHUTDOWN):
            exc = ShuttingDown("the gateway shut down before the worker answered")
        elif svc.interrupts.take(CLIENT_GONE):
            exc = ClientClosed("the client left before its answer")
            if not lease.forwarded:
                raise exc from None
        else:
            raise
        await _record_failure(svc, tenant, parsed, record_id, exc, status="aborted")
        raise exc from None


async def _record_failure(svc: Services, tenant: str, parsed: ParsedRequest, record_id: str,
                          exc: GatewayError, status: str = "failed", *,
                          rejected: bool = False) -> None:
    """A forwarded request that got no answer is recorded too, and the client told its id."""
    exc.headers[RECORD_HEADER] = record_id
    await svc.save_quietly(tenant, _record(parsed, record_id, None, None, status,
                                           choices=[], usage=None, error=exc.message),
                           rejected=rejected)


async def _stream(svc: Services, request: Request, tenant: str, parsed: ParsedRequest,
                  record_id: str, lease: Lease) -> Response:
    with ClientWatch(svc, request, lease, record_id, abort=False):
        async with _forwarding(svc, tenant, parsed, record_id, lease):
            await lease.open_stream(parsed.endpoint, parsed.wire)
    return StreamingResponse(  # the relay owns the open lease from here
        _relay(svc, request, tenant, parsed, record_id, lease),
        media_type="text/event-stream",
        headers={RECORD_HEADER: record_id, "Cache-Control": "no-cache"})


def _sse(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _relay(svc: Services, request: Request, tenant: str, parsed: ParsedRequest,
                 record_id: str, lease: Lease) -> AsyncIterator[bytes]:
    worker = lease.worker
    acc = responses.StreamAccumulator(parsed.is_chat)
    error: GatewayError | None = None
    status = "failed"

    def record() -> Record:
        fingerprint = acc.fingerprint or worker.fingerprint
        extra = {"error": error.message} if error is not None else {}
        return _record(parsed, record_id, worker, fingerprint, status,
                       choices=acc.record_choices(), usage=acc.usage, **acc.extras, **extra)

    try:
        async with lease:  # an ejection of the worker interrupts the relay (EJECTED)
            with svc.drain.track():
                async for chunk in lease.events():
                    message = responses.stream_error(chunk)
                    if message is not None:
                        code = responses.stream_error_code(chunk)
                        error = UpstreamFailed(message, code=code)
                        status = "aborted" if code == WEIGHTS_UPDATED else "failed"
                        break
                    acc.add(chunk)
                    fingerprint = acc.fingerprint or worker.fingerprint
                    out = responses.shape_chunk(parsed.is_chat, chunk, parsed.ask, record_id,
                                                fingerprint)
                    if out is not None:
                        yield _sse(out)
                    if lease.out_of_time():
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
    try:
        await svc.save(tenant, record(), usage=acc.usage)
    except RecorderUnavailable as exc:
        # `[DONE]` promises a durable record: without one the stream ends in an error event.
        error = exc
        yield _error_event(error)
        return
    if error is not None:
        # A stream that failed after its first bytes ends in its error event and never in
        # `[DONE]`, which says the answer is whole (and recorded).
        yield _error_event(error)
        return
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
