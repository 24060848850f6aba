"""`POST /v1/score`: the built-in worker's teacher-forced logprobs, through the gateway.

validate -> admit (the tenant's rates) -> route -> forward -> observe. Nothing is recorded:
a score is a read-only computation (the same token ids give the same numbers on the same
fingerprint), so it needs no record and works while Redis is down.

Only built-in workers are asked (vLLM's /score is cross-encoder pair scoring, another API).
With `system_fingerprint` the client demands a worker with those numerics, as a trainer does
when it checks a record's logprobs: 409 when none is up, or when the worker that answered
turns out to have another fingerprint (it was restarted with other weights or settings).
"""

from __future__ import annotations

import time

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from detgate.gateway import protocol, responses
from detgate.gateway.errors import Conflict, UpstreamFailed
from detgate.gateway.services import read_body, resolve_tenant, services
from detgate.gateway.worker_limits import check_token_ids


async def score(request: Request) -> Response:
    svc = services(request)
    tenant = await resolve_tenant(request)
    raw = await read_body(request, svc.settings.max_body_bytes, svc.settings.body_timeout_s)
    parsed = protocol.parse_score(raw, svc.settings)
    token_ids = parsed.body["token_ids"]
    check_token_ids(svc.router.limits(parsed.model), token_ids, 0, "token_ids")
    await svc.admit(tenant, stores=False)
    deadline = time.monotonic() + svc.settings.total_timeout_s
    async with svc.forwarder.lease(parsed.model, deadline=deadline, tokens=len(token_ids),
                                   fingerprint=parsed.fingerprint, builtin=True) as lease:
        reply = await lease.send(protocol.SCORE, orjson.dumps(parsed.body))
    request.state.upstream_s = lease.upstream_s
    answer = responses.parse_answer(reply.body)
    if not isinstance(answer, dict) or not isinstance(answer.get("logprobs"), list):
        raise UpstreamFailed("the worker's score answer has no 'logprobs' list")
    fingerprint = lease.learn(answer.get("system_fingerprint"))
    if parsed.fingerprint is not None and fingerprint != parsed.fingerprint:
        raise Conflict(f"the worker now has fingerprint {fingerprint}, not "
                       f"{parsed.fingerprint}")
    await svc.charge_tokens(tenant, {"total_tokens": len(token_ids)})
    answer["system_fingerprint"] = fingerprint
    # orjson writes each float as the shortest text that reads back as the same double: the
    # worker's logprobs reach the client bit for bit.
    return Response(orjson.dumps(answer), media_type="application/json")


routes = [Route(protocol.SCORE, score, methods=["POST"])]
