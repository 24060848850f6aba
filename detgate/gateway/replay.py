"""`POST /replay/{id}`: re-run a record on a worker with the same fingerprint and compare.

With `load` K > 0, K other requests (varied prompt lengths, greedy) go to that same worker
at the same moment, so the replay is scheduled inside a different batch than the original
was: exactly the situation in which a kernel that is not batch-invariant changes numbers.

A replay is held to the tenant's limits like a request: admitted by the route (requests/s,
storage budget), charged here every token it and its load make the worker run, its
comparison counted in the tenant's stored bytes; `max_replay_load` caps its load.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import orjson

from detgate.contract.compare import compare_choices
from detgate.contract.record import Record
from detgate.gateway import protocol, responses
from detgate.gateway.errors import BadRequest, Conflict, GatewayError, NotFound, UpstreamFailed
from detgate.gateway.limits import usage_tokens
from detgate.gateway.recorder import now
from detgate.gateway.router import Worker
from detgate.gateway.services import Services

_FILLER = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while",
           "a", "determinism", "gateway", "records", "every", "token", "it", "sees"]


def load_body(record: Record, i: int) -> dict:
    """The i-th background request: its own prompt length, so batch shapes keep changing."""
    words = " ".join(_FILLER[(i + j) % len(_FILLER)] for j in range(3 + (i * 7) % 40))
    req = record.request
    max_tokens = req.get("max_tokens") or req.get("max_completion_tokens") \
        or protocol.COMPLETIONS_MAX_TOKENS
    body = {"model": req["model"], "max_tokens": max_tokens, "temperature": 0}
    if record.endpoint == protocol.CHAT:
        body["messages"] = [{"role": "user", "content": f"load {i}: {words}"}]
    else:
        body["prompt"] = f"load {i}: {words}"
    return body


def replayable(record_id: str, stored: dict) -> Record:
    """The stored record as one that can be replayed, or the 409 saying why not."""
    record = Record.from_dict(stored)
    if record.status != "complete":
        raise Conflict(f"record '{record_id}' is {record.status}: nothing to compare",
                       code="record_not_complete")
    if "summary" in stored:
        raise Conflict(f"record '{record_id}' is stored as a summary "
                       f"({stored['summary']['reason']}): it cannot be replayed",
                       code="record_summarised")
    return record


async def replay(svc: Services, tenant: str, record_id: str, load: int) -> dict:
    """Run and store the comparison. The caller has admitted the request (requests/s, the
    storage budget); `rerun` charges the tokens it makes workers run."""
    cap = svc.limits.replay_load(tenant, svc.settings.max_replay_load)
    if load > cap:
        raise BadRequest(f"'load': at most {cap} concurrent requests for this tenant",
                         param="load")
    found = await svc.recorder.get(tenant, record_id)
    if found is None:
        raise NotFound(f"no record '{record_id}'", param="id")
    stored, pttl_ms = found
    record = replayable(record_id, stored)
    try:
        comparison = await rerun(svc, tenant, record, record.system_fingerprint, load)
    except GatewayError:
        svc.metrics.replays.labels("error").inc()
        raise
    comparison["id"] = record_id
    await svc.save_replay(tenant, record_id, comparison, pttl_ms)
    svc.metrics.observe_replay(comparison)
    return comparison


async def rerun(svc: Services, tenant: str, record: Record, fingerprint: str | None,
                load: int) -> dict:
    """Send the recorded request again to a worker of `fingerprint` (the record's own for
    `/replay`, another for a drift report), under `load`; its comparison with the record.
    The tokens are charged to `tenant` (limits.py): estimated from the record before anything
    runs (RateLimited past the tenant's tokens/s), settled with what the answers used (a
    replay that fails keeps its estimate). Stores and counts nothing else: the callers do."""
    estimate = (1 + load) * max(usage_tokens(record.usage), 1)
    await svc.take_tokens(tenant, estimate)
    used = estimate
    try:
        worker = svc.forwarder.choose(record.model, fingerprint=fingerprint)
        comparison, used = await _run(svc, record, worker, load, fingerprint)
    finally:
        await svc.settle_tokens(tenant, estimate, used)
    return comparison


def _tokens_asked(request: dict, default: int) -> tuple[int, int]:
    """(n, max_tokens x n) of a recorded request (`default` without max_tokens): its lease's
    weight and timeout."""
    n = request.get("n") or 1
    return n, n * (request.get("max_tokens") or request.get("max_completion_tokens") or default)


async def _run(svc: Services, record: Record, worker: Worker, load: int,
               wanted: str | None) -> tuple[dict, int]:
    """The comparison, and the tokens every answer (the replay's and its load's) used."""
    deadline = time.monotonic() + svc.settings.total_timeout_s

    async def send(body: dict) -> dict:
        weight, tokens = _tokens_asked(body, svc.settings.max_tokens)
        async with svc.forwarder.lease(record.model, deadline=deadline, pinned=worker,
                                       weight=weight, tokens=tokens) as lease:
            reply = await lease.send(record.endpoint, orjson.dumps(body))
        return responses.parse_answer(reply.body)

    background = [asyncio.create_task(send(load_body(record, i))) for i in range(load)]
    if background:
        await asyncio.sleep(0)  # let the load reach the worker first
    target = asyncio.create_task(send(protocol.replay_body(record.request)))
    results = await asyncio.gather(target, *background, return_exceptions=True)
    used = sum(usage_tokens(r.get("usage")) for r in results if isinstance(r, dict))
    answer = results[0]
    if isinstance(answer, BaseException):
        if isinstance(answer, GatewayError):
            raise answer
        raise UpstreamFailed(f"replay failed: {answer}")
    fingerprint = answer.get("system_fingerprint") or worker.fingerprint
    if wanted is not None and fingerprint != wanted:  # its weights were updated meanwhile
        raise Conflict(f"the worker's fingerprint changed to {fingerprint} before the replay "
                       f"ran: no worker has {wanted} now", code="fingerprint_changed")
    choices = responses.record_choices(record.endpoint == protocol.CHAT, answer,
                                       bool(record.request.get("echo")))
    cmp = compare_choices(record.choices, choices).as_dict()
    # The replay's own tokens are kept with its comparison, so both sides can be shown aligned.
    return {
        "id": record.id, "replay_id": "rpl-" + secrets.token_hex(12), **cmp,
        "original_fingerprint": record.system_fingerprint, "replay_fingerprint": fingerprint,
        # The machines, for people (a record may replay on another machine of its fingerprint).
        "original_machine": record.machine, "replay_machine": worker.machine,
        "worker": worker.name, "load": load, "created": now(),
        "replay_choices": [c.as_dict() for c in choices],
    }, used
