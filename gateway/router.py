"""Which worker serves a request: least outstanding requests among healthy workers.

Health: an active check every `health_interval_s` (GET /health) plus passive ejection (a
worker that refuses a connection, times out or answers 5xx is marked down at once). A worker
coming (back) up has its model list and fingerprint learned again before it takes traffic,
since a restart may have changed either.

Fingerprint: the worker's own `system_fingerprint` (the built-in worker sends one), learned
by a one-token probe. A worker that sends none (vLLM) gets a derived one: a hash of what it
exposes (/v1/models: id, root, max_model_len; /version) plus operator labels. Only a worker
with its own fingerprint is a built-in worker, and only those offer the teacher-forced
/v1/score (vLLM's /score is a different API: cross-encoder pair scoring).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import orjson

from gateway.errors import Conflict, NotFound, NoWorker
from gateway.interrupts import EJECTED, Interrupts
from gateway.metrics import Metrics
from gateway.upstream import TimedOut, Unreachable, Upstream

log = logging.getLogger("detgate.gateway")

PROBE_PROMPT = "detgate fingerprint probe"


def worker_name(url: str) -> str:
    """The URL without user-info (`http://user:pw@host:9001` -> `http://host:9001`): what
    labels, logs, records and comparisons show. Only requests to the worker use `url`."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


@dataclass
class Worker:
    url: str
    name: str = ""
    up: bool = False
    inflight: int = 0
    models: list[str] = field(default_factory=list)
    fingerprint: str | None = None
    # True when the worker reports its own fingerprint (a built-in worker), False when
    # `fingerprint` is derived.
    own_fingerprint: bool = False
    labels: str = ""
    # Tasks waiting on this worker: interrupted (EJECTED) when it is ejected.
    attempts: set[asyncio.Task] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.name = self.name or worker_name(self.url)

    def redact(self, text: str) -> str:
        """`text` (an exception's message, say) without this worker's user-info."""
        userinfo = urlsplit(self.url).netloc.rpartition("@")[0]
        return text.replace(userinfo, "***") if userinfo else text


def derived_fingerprint(cards: list[dict], version: str | None, labels: str) -> str:
    """For workers without a fingerprint: everything they tell us that can change numbers."""
    parts = {
        "models": sorted(
            [[c.get("id"), c.get("root"), c.get("max_model_len")] for c in cards],
            key=lambda p: str(p)),
        "version": version,
        "labels": labels,
    }
    digest = hashlib.sha256(orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)).hexdigest()
    return f"fp_derived_{digest[:16]}"


class Router:
    def __init__(self, urls: list[str], upstream: Upstream, metrics: Metrics,
                 interrupts: Interrupts, *, labels: dict[str, str],
                 probe_timeout_s: float) -> None:
        self.workers = [Worker(url) for url in urls]
        for w in self.workers:
            w.labels = labels.get(w.url, labels.get(w.name, labels.get("*", "")))
        self.upstream = upstream
        self.metrics = metrics
        self.interrupts = interrupts
        self.probe_timeout_s = probe_timeout_s
        self._turn = 0
        for w in self.workers:
            # Read at scrape time: no per-request cost on the hot path.
            metrics.worker_inflight.labels(w.name).set_function(lambda w=w: w.inflight)

    # -- choice -------------------------------------------------------------------------------

    def choose(self, model: str, *, exclude: Worker | None = None,
               fingerprint: str | None = None, builtin: bool = False) -> Worker:
        """Least outstanding requests; ties rotate so idle workers share the load.

        `builtin`: only built-in workers (those with their own fingerprint)."""
        candidates = [w for w in self.workers if w.up and w is not exclude
                      and (fingerprint is None or w.fingerprint == fingerprint)
                      and (not builtin or w.own_fingerprint)
                      and model in w.models]
        if not candidates:
            if fingerprint is not None:
                raise Conflict(f"no healthy {'built-in ' if builtin else ''}worker has "
                               f"fingerprint {fingerprint}")
            if builtin and any(w.up and model in w.models for w in self.workers):
                raise Conflict(f"no healthy built-in worker serves model '{model}': only "
                               "built-in workers offer the teacher-forced score",
                               code="no_score_worker")
            if not any(w.up for w in self.workers):
                raise NoWorker("no healthy worker")
            if exclude is None and not any(model in w.models for w in self.workers):
                raise NotFound(f"the model '{model}' does not exist", param="model",
                               code="model_not_found")
            raise NoWorker(f"no healthy worker serves model '{model}'")
        self._turn += 1
        n = len(candidates)
        best = min(range(n), key=lambda i: (candidates[i].inflight, (i - self._turn) % n))
        return candidates[best]

    def acquire(self, worker: Worker) -> None:
        worker.inflight += 1

    def release(self, worker: Worker) -> None:
        worker.inflight -= 1

    def eject(self, worker: Worker, reason: str) -> None:
        if worker.up:
            log.warning("worker %s ejected: %s", worker.name, worker.redact(reason))
        worker.up = False
        self.metrics.worker_up.labels(worker.name).set(0)
        # Requests waiting on it stop now: retried elsewhere, or failed with a record.
        for task in list(worker.attempts):
            self.interrupts.interrupt(task, EJECTED)

    def learn(self, worker: Worker, fingerprint: str | None) -> None:
        """Passive learning from answers: a worker's own fingerprint wins over a derived one."""
        if fingerprint and fingerprint != worker.fingerprint:
            worker.fingerprint = fingerprint
        if fingerprint:
            worker.own_fingerprint = True

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for w in self.workers:
            if w.up:
                seen.update(dict.fromkeys(w.models))
        return list(seen)

    def any_up(self) -> bool:
        return any(w.up for w in self.workers)

    # -- health -------------------------------------------------------------------------------

    async def watch(self, interval_s: float) -> None:
        """Background task: the active health checks."""
        while True:
            await asyncio.gather(*(self.check(w) for w in self.workers))
            await asyncio.sleep(interval_s)

    async def check(self, worker: Worker) -> None:
        try:
            health = await self.upstream.get(worker.url + "/health", self.probe_timeout_s)
            if health.status != 200:
                raise Unreachable(f"/health answered {health.status}")
            if not worker.up:
                await self._introduce(worker)
        except Exception as exc:  # whatever went wrong, the worker is not usable
            # (an odd /v1/models or probe answer included); the loop must survive it.
            self.eject(worker, f"{type(exc).__name__}: {exc}")
            return
        if not worker.up:
            log.warning("worker %s up: models %s, fingerprint %s", worker.name, worker.models,
                        worker.fingerprint)
        worker.up = True
        self.metrics.worker_up.labels(worker.name).set(1)

    async def _introduce(self, worker: Worker) -> None:
        """Learn models and fingerprint of a worker that is (again) healthy."""
        answer = await self.upstream.get(worker.url + "/v1/models", self.probe_timeout_s)
        if answer.status != 200:
            raise Unreachable(f"/v1/models answered {answer.status}")
        cards = [c for c in orjson.loads(answer.body).get("data", []) if isinstance(c, dict)]
        worker.models = [c["id"] for c in cards]
        if not worker.models:
            raise Unreachable("/v1/models lists no model")
        probe = orjson.dumps({"model": worker.models[0], "prompt": PROBE_PROMPT,
                              "max_tokens": 1, "temperature": 0})
        answer = await self.upstream.post(worker.url + "/v1/completions", probe,
                                          self.probe_timeout_s)
        if answer.status >= 500:
            raise Unreachable(f"probe answered {answer.status}")
        own = orjson.loads(answer.body).get("system_fingerprint") if answer.status == 200 else None
        worker.own_fingerprint = bool(own)
        worker.fingerprint = own or derived_fingerprint(
            cards, await self._version(worker), worker.labels)

    async def _version(self, worker: Worker) -> str | None:
        try:
            answer = await self.upstream.get(worker.url + "/version", self.probe_timeout_s)
            return orjson.loads(answer.body).get("version") if answer.status == 200 else None
        except (Unreachable, TimedOut, orjson.JSONDecodeError, AttributeError):
            return None
