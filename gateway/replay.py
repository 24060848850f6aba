"""`POST /replay/{id}`: re-run a record on a worker with the same fingerprint and compare.

With `load` K > 0, K other requests (varied prompt lengths, greedy) go to that same worker
at the same moment, so the replay is scheduled inside a different batch than the original
was: exactly the situation in which a kernel that is not batch-invariant changes numbers.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import orjson

from detgate.contract.compare import compare_choices
from detgate.contract.record import Record
from gateway import protocol, responses
from gateway.errors import Conflict, GatewayError, NotFound, UpstreamFailed
from gateway.recorder import now
from gateway.router import Worker
from gateway.services import Services
from gateway.upstream import Answer

_FILLER = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while",
           "a", "determinism", "gateway", "records", "every", "token", "it", "sees"]


def load_body(record: Record, i: int) -> dict:
    """The i-th background request: its own prompt length, so batch shapes keep changing."""
    words = " ".join(_FILLER[(i + j) % len(_FILLER)] for j in range(3 + (i * 7) % 40))
    req = record.request
    max_tokens = req.get("max_tokens") or req.get("max_completion_tokens") or 16
    body = {"model": req["model"], "max_tokens": max_tokens, "temperature": 0}
    if record.endpoint == protocol.CHAT:
        body["messages"] = [{"role": "user", "content": f"load {i}: {words}"}]
    else:
        body["prompt"] = f"load {i}: {words}"
    return body


async def replay(svc: Services, tenant: str, record_id: str, load: int) -> dict:
    found = await svc.recorder.get(tenant, record_id)
    if found is None:
        raise NotFound(f"no record '{record_id}'", param="id")
    stored, pttl_ms = found
    record = Record.from_dict(stored)
    if record.status != "complete":
        raise Conflict(f"record '{record_id}' is {record.status}: nothing to compare",
                       code="record_not_complete")
    if "summary" in stored:
        raise Conflict(f"record '{record_id}' is stored as a summary "
                       f"({stored['summary']['reason']}): it cannot be replayed",
                       code="record_summarised")
    try:
        worker = svc.forwarder.choose(record.model, fingerprint=record.system_fingerprint)
        comparison = await _run(svc, record, worker, load)
    except GatewayError:
        svc.metrics.replays.labels("error").inc()
        raise
    comparison["id"] = record_id
    await svc.recorder.add_replay(tenant, record_id, comparison, pttl_ms)
    svc.metrics.observe_replay(comparison)
    return comparison


async def _run(svc: Services, record: Record, worker: Worker, load: int) -> dict:
    deadline = time.monotonic() + svc.settings.total_timeout_s

    async def send(body: dict) -> Answer:
        async with svc.forwarder.lease(record.model, deadline=deadline, pinned=worker) as lease:
            return await lease.send(record.endpoint, orjson.dumps(body))

    background = [asyncio.create_task(send(load_body(record, i))) for i in range(load)]
    if background:
        await asyncio.sleep(0)  # let the load reach the worker first
    target = asyncio.create_task(send(protocol.replay_body(record.request)))
    results = await asyncio.gather(target, *background, return_exceptions=True)
    reply = results[0]
    if isinstance(reply, BaseException):
        if isinstance(reply, GatewayError):
            raise reply
        raise UpstreamFailed(f"replay failed: {reply}")
    answer = orjson.loads(reply.body)
    choices = responses.record_choices(record.endpoint == protocol.CHAT, answer)
    cmp = compare_choices(record.choices, choices).as_dict()
    # The replay's own tokens are kept with its comparison, so both sides can be shown aligned.
    return {
        "id": record.id, "replay_id": "rpl-" + secrets.token_hex(12), **cmp,
        "original_fingerprint": record.system_fingerprint,
        "replay_fingerprint": answer.get("system_fingerprint") or worker.fingerprint,
        "worker": worker.name, "load": load, "created": now(),
        "replay_choices": [c.as_dict() for c in choices],
    }
