"""`POST /v1/drift`: which of the caller's records still reproduce on other workers (after an
upgrade of kernels, engine, torch or weights: a new fingerprint). `GET /v1/drift`: the
caller's last report.

A run finds the tenant's complete, replayable records made on `from_fingerprint` among its
newest `max_drift_scan`, takes a `sample` of them (a seeded draw; all when none is given, at
most `max_drift_records`), replays each once, without load, on a worker of `to_fingerprint`
through the replay path (`replay.rerun`: the recorded body, the contract's comparison), at
most `concurrency` at a time, and pools the comparisons per endpoint and per tenant
(detgate.contract.drift).

Limits: every drift replay is admitted against the tenant's rates and charged its tokens,
as a request is; a refusal pauses that replay for its Retry-After, within `drift_timeout_s`
(the replays left then are reported as `deadline` errors). Drift replays are not stored on
the records and do not count as `/replay`s (a replay on another fingerprint is expected to
differ: it must not fire the divergence alert); the report, one per tenant, replaces the last
one in Redis (bounded by `max_drift_records` rows) and in the `detgate_drift_*` metrics.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from dataclasses import dataclass

import orjson
from redis.exceptions import RedisError

from detgate.contract import drift
from detgate.contract.record import Record
from detgate.gateway.errors import Conflict, GatewayError, RateLimited, RecorderUnavailable
from detgate.gateway.protocol import DriftBody
from detgate.gateway.recorder import now
from detgate.gateway.replay import replayable, rerun
from detgate.gateway.services import Services

log = logging.getLogger("detgate.gateway")

PAGE = 1000  # records per listing page while scanning


@dataclass
class Selection:
    examined: int
    matched: int
    records: list[Record]


async def run(svc: Services, tenant: str, body: DriftBody) -> dict:
    if not any(w.up and w.fingerprint == body.to_fingerprint for w in svc.router.workers):
        raise Conflict(f"no healthy worker has fingerprint {body.to_fingerprint}",
                       param="to_fingerprint")
    t0 = time.monotonic()
    chosen = await select(svc, tenant, body)
    rows = await replay_all(svc, tenant, chosen.records, body, t0 + svc.settings.drift_timeout_s)
    report = {
        "object": "drift", "id": "drift-" + secrets.token_hex(12), "created": now(),
        "tenant": tenant, "from_fingerprint": body.from_fingerprint,
        "to_fingerprint": body.to_fingerprint, "endpoint": body.endpoint,
        "sample": body.sample, "seed": body.seed, "examined": chosen.examined,
        "matched": chosen.matched, "selected": len(chosen.records),
        "duration_s": round(time.monotonic() - t0, 3),
        **drift.summaries(rows), "records": rows,
    }
    svc.metrics.observe_drift(svc.limits.state(tenant).label, report)
    await _store(svc, tenant, report)
    return report


async def select(svc: Services, tenant: str, body: DriftBody) -> Selection:
    examined = 0

    def keep(stored: dict) -> bool:
        nonlocal examined
        examined += 1
        if stored.get("system_fingerprint") != body.from_fingerprint:
            return False
        if body.endpoint is not None and stored["endpoint"] != body.endpoint:
            return False
        try:
            replayable(stored["id"], stored)
        except Conflict:
            return False
        return True

    found: list[dict] = []
    after = None
    while examined < svc.settings.max_drift_scan:
        page = await svc.recorder.list(tenant, PAGE, after=after, keep=keep)
        if page is None:  # the cursor expired meanwhile: what was found is the sample frame
            break
        found += page.data
        if not page.has_more or page.last_id is None:
            break
        after = page.last_id
    limit = min(body.sample or svc.settings.max_drift_records, svc.settings.max_drift_records)
    picked = (random.Random(body.seed).sample(found, limit) if body.sample and
              limit < len(found) else found[:limit])
    return Selection(examined, len(found), [Record.from_dict(r) for r in picked])


async def replay_all(svc: Services, tenant: str, records: list[Record], body: DriftBody,
                     deadline: float) -> list[dict]:
    rows: list[dict] = [{}] * len(records)
    todo = iter(enumerate(records))

    async def replayer() -> None:
        # One iterator shared by the replayers: each record is taken exactly once.
        for i, record in todo:
            rows[i] = await replay_one(svc, tenant, record, body.to_fingerprint, deadline)

    await asyncio.gather(*(replayer() for _ in range(min(body.concurrency, len(records)))))
    return rows


async def replay_one(svc: Services, tenant: str, record: Record, fingerprint: str,
                     deadline: float) -> dict:
    """One record's row: admitted like a request, replayed, compared, charged."""
    while True:
        try:
            await svc.admit(tenant, stores=False)
            break
        except RateLimited as exc:
            wait = float(exc.headers.get("Retry-After", 1))
            if time.monotonic() + wait > deadline:
                return drift.row(record.id, tenant, record.endpoint, error="deadline")
            await asyncio.sleep(wait)
    try:
        comparison = await rerun(svc, tenant, record, fingerprint, 0)
    except GatewayError as exc:
        return drift.row(record.id, tenant, record.endpoint, error=exc.code or exc.type)
    return drift.row(record.id, tenant, record.endpoint, comparison)


async def last(svc: Services, tenant: str) -> dict | None:
    try:
        raw = await svc.recorder.store.call("GET", svc.recorder.keys.drift(tenant))
    except (RedisError, OSError) as exc:
        raise _unavailable() from exc
    return None if raw is None else orjson.loads(raw)


async def _store(svc: Services, tenant: str, report: dict) -> None:
    """Keep the report for `GET /v1/drift`; the caller has it in the answer either way."""
    try:
        await svc.recorder.store.call("SET", svc.recorder.keys.drift(tenant),
                                      orjson.dumps(report), "EX", svc.settings.record_ttl_s)
    except (RedisError, OSError) as exc:
        log.warning("drift report %s not stored: %s", report["id"], type(exc).__name__)


def _unavailable() -> RecorderUnavailable:
    return RecorderUnavailable("the request store is unavailable; retry shortly")
