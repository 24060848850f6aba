"""Which worker serves a request: least outstanding requests among healthy workers with room.

Health: an active check every `health_interval_s` (GET /health). A worker is ejected only on
evidence that it is dead or hung: a refused connection, or a failed health check (which also
covers a worker that accepts requests but makes no progress: the built-in worker's /health
fails when its engine stalls, vLLM's when its engine died). Anything less certain (a broken
or stalled answer, a 5xx, a timeout) only `suspect`s the worker: its health check runs at
once and decides. A slow worker that still progresses is never ejected. A worker coming
(back) up has its model list, fingerprint, limits and capacity learned again before it
takes traffic, since a restart may have changed any of them.

Membership: the configured URLs, plus the workers that DNS discovery (gateway/discovery.py)
reports for each of its names. A worker that leaves is drained: out of `workers` at once, so
no new request chooses it, while the leases holding it keep it until they end; `sweep` forgets
it (and its metrics) once nothing is in flight on it. Choosing a worker reads `workers` only.

Capacity: a worker takes at most its advertised `max_num_seqs` sequences at once
(`default_capacity` when it advertises none, as vLLM); requests beyond wait in the
gateway's queue (gateway/admission.py).

Fingerprint: the worker's own `system_fingerprint` (the built-in worker sends one), learned
by a one-token probe. A worker that sends none (vLLM) gets a derived one: a hash of what it
exposes (/v1/models: id, root, max_model_len; /version) plus operator labels. Only a worker
with its own fingerprint is a built-in worker, and only those offer the teacher-forced
/v1/score (vLLM's /score is a different API: cross-encoder pair scoring) and `/abort_request`.

A built-in worker's fingerprint changes with a live weight update. Its /health names the
current one (FINGERPRINT_HEADER), so every health check follows it; an answer that carries
another fingerprint than the known one triggers a check at once. An answer is not taken as
the new fingerprint itself: one that began before the update may arrive after it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import orjson

from detgate.contract.constants import FINGERPRINT_HEADER
from detgate.gateway.admission import Admission, Fits
from detgate.gateway.errors import Conflict, NotFound, NoWorker
from detgate.gateway.interrupts import EJECTED, Interrupts, stopping
from detgate.gateway.metrics import Metrics
from detgate.gateway.upstream import TimedOut, Unreachable, Upstream
from detgate.gateway.worker_limits import ModelLimits

log = logging.getLogger("detgate.gateway")

PROBE_PROMPT = "detgate fingerprint probe"


def worker_name(url: str) -> str:
    """The URL without user-info (`http://user:pw@host:9001` -> `http://host:9001`): what
    labels, logs, records and comparisons show. Only requests to the worker use `url`."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


@dataclass(eq=False)
class Worker:
    url: str
    name: str = ""
    up: bool = False
    inflight: int = 0  # requests
    seqs: int = 0  # sequences of those requests (n choices each), against `capacity`
    capacity: int = 1
    models: list[str] = field(default_factory=list)
    # What each model's card advertises (max_model_len, vocab_size, ...).
    limits: dict[str, ModelLimits] = field(default_factory=dict)
    fingerprint: str | None = None
    # True when the worker reports its own fingerprint (a built-in worker), False when
    # `fingerprint` is derived.
    own_fingerprint: bool = False
    labels: str = ""
    # What its model card says of its machine (built-in workers): copied into its records.
    machine: dict | None = None
    # Tasks waiting on this worker: interrupted (EJECTED) when it is ejected.
    attempts: set[asyncio.Task] = field(default_factory=set)
    checking: asyncio.Task | None = None  # a health check in progress
    # The DNS entry that found it (DETGATE_WORKERS' `dns+...` text); None when configured.
    source: str | None = None
    gone: bool = False  # drained and forgotten: its metrics are removed

    def __post_init__(self) -> None:
        self.name = self.name or worker_name(self.url)

    def need(self, weight: int) -> int:
        """The sequences a request of `weight` takes here (never more than the whole)."""
        return min(weight, self.capacity)

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
                 interrupts: Interrupts, admission: Admission, *, labels: dict[str, str],
                 probe_timeout_s: float, default_capacity: int) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.interrupts = interrupts
        self.admission = admission
        self.probe_timeout_s = probe_timeout_s
        self.default_capacity = default_capacity
        self._limits: dict[str, ModelLimits] = {}
        self._turn = 0
        self.labels = labels
        self.workers: list[Worker] = []
        # Left the configuration (gone from DNS) with requests still in flight.
        self.draining: list[Worker] = []
        for url in urls:
            self._join(Worker(url, capacity=default_capacity))

    # -- membership ---------------------------------------------------------------------------

    def _join(self, worker: Worker) -> None:
        keys = (worker.url, worker.name, worker.source, worker_name(worker.source or ""), "*")
        worker.labels = next((self.labels[k] for k in keys if k in self.labels), "")
        self.workers.append(worker)
        self.metrics.worker_up.labels(worker.name).set(1 if worker.up else 0)
        # Read at scrape time: no per-request cost on the hot path.
        self.metrics.worker_inflight.labels(worker.name).set_function(lambda: worker.inflight)
        self.metrics.worker_capacity.labels(worker.name).set_function(lambda: worker.capacity)

    def update(self, source: str, urls: set[str]) -> list[Worker]:
        """Make `urls` the workers found through `source`: the others of that source drain,
        new ones join (down until a health check introduces them). Returns those that joined;
        a draining worker that is back resumes as it was."""
        leaving = [w for w in self.workers if w.source == source and w.url not in urls]
        for w in leaving:
            log.warning("worker %s left %s: draining (%d in flight)", w.name,
                        worker_name(source), w.inflight)
        self.workers = [w for w in self.workers if w not in leaving]
        self.draining += leaving
        joined = []
        for url in sorted(urls - {w.url for w in self.workers}):
            back = next((w for w in self.draining if w.url == url), None)
            if back is not None:
                self.draining.remove(back)
                self.workers.append(back)
            else:
                joined.append(Worker(url, source=source, capacity=self.default_capacity))
                self._join(joined[-1])
        if leaving:
            self._learn_limits()
        return joined

    def sweep(self) -> None:
        """Forget drained workers with nothing in flight."""
        done = [w for w in self.draining if w.inflight == 0]
        self.draining = [w for w in self.draining if w.inflight > 0]
        for w in done:
            w.gone = True
            self.metrics.forget_worker(w.name)

    def _show_up(self, worker: Worker, up: bool) -> None:
        worker.up = up
        if not worker.gone:  # a health check may end after the worker was forgotten
            self.metrics.worker_up.labels(worker.name).set(1 if up else 0)

    # -- choice -------------------------------------------------------------------------------

    def candidates(self, model: str, *, exclude: Worker | None = None,
                   fingerprint: str | None = None, builtin: bool = False) -> list[Worker]:
        """The healthy workers that may serve the request (room or not); the error that says
        why when there are none. `builtin`: only built-in workers (own fingerprint)."""
        candidates = [w for w in self.workers if w.up and w is not exclude
                      and (fingerprint is None or w.fingerprint == fingerprint)
                      and (not builtin or w.own_fingerprint)
                      and model in w.models]
        if candidates:
            return candidates
        if fingerprint is not None:
            now = sorted({w.fingerprint for w in self.workers
                          if w.up and model in w.models and w.fingerprint})
            raise Conflict(f"no healthy {'built-in ' if builtin else ''}worker has "
                           f"fingerprint {fingerprint} (the weights and numerics asked "
                           f"for); the workers serving '{model}' now have: "
                           f"{', '.join(now) or 'none'}")
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

    def choose(self, model: str, *, fingerprint: str | None = None) -> Worker:
        """A worker for leases pinned to it (a replay and its load), room or not."""
        return self._least_loaded(self.candidates(model, fingerprint=fingerprint))

    def _least_loaded(self, workers: list[Worker]) -> Worker:
        """Lowest share of capacity in use; ties rotate so idle workers share the load."""
        self._turn += 1
        n = len(workers)
        best = min(range(n), key=lambda i: (workers[i].seqs / workers[i].capacity,
                                            (i - self._turn) % n))
        return workers[best]

    async def take(self, model: str, weight: int, *, deadline: float,
                   pinned: Worker | None = None, exclude: Worker | None = None,
                   fingerprint: str | None = None, builtin: bool = False) -> Worker:
        """A worker with room for `weight` sequences, its slot held (give it back with
        `release`): at once, or after waiting in the queue until `deadline` at the latest
        (monotonic; Overloaded when the queue is full or the wait too long)."""
        if pinned is not None:
            if not pinned.up:
                raise NoWorker("the worker of this replay is no longer healthy")
            candidates = [pinned]
        else:
            candidates = self.candidates(model, exclude=exclude, fingerprint=fingerprint,
                                         builtin=builtin)

        room = [w for w in candidates if w.seqs + w.need(weight) <= w.capacity
                and not self.admission.wanted(w)]
        if room:
            worker = self._least_loaded(room)
            self.acquire(worker, weight)
            return worker

        def fits(w: Worker) -> bool:
            return w.up and (w is pinned if pinned is not None else (
                w is not exclude and model in w.models
                and (fingerprint is None or w.fingerprint == fingerprint)
                and (not builtin or w.own_fingerprint)))

        waiter = Fits(fits, weight)
        try:
            return await self.admission.wait(waiter, self._queue_limit(), deadline)
        except BaseException:
            if waiter.handed is not None:  # handed a slot as the wait ended otherwise
                self.release(waiter.handed, weight)
            raise

    def _queue_limit(self) -> int:
        return self.admission.limit(sum(w.capacity for w in self.workers if w.up))

    def acquire(self, worker: Worker, weight: int) -> None:
        worker.inflight += 1
        worker.seqs += worker.need(weight)

    def release(self, worker: Worker, weight: int) -> None:
        worker.inflight -= 1
        worker.seqs -= worker.need(weight)
        if worker.up:
            self.admission.hand_off(worker, self.acquire)

    def eject(self, worker: Worker, reason: str) -> None:
        if worker.up:
            log.warning("worker %s ejected: %s", worker.name, worker.redact(reason))
        self._show_up(worker, False)
        # Requests waiting on it stop now: retried elsewhere, or failed with a record; those
        # waiting for a slot that no healthy worker can give fail at once.
        for task in list(worker.attempts):
            self.interrupts.interrupt(task, EJECTED)
        self.admission.fail_stranded(self.workers,
                                     NoWorker("no healthy worker serves this request"))

    def suspect(self, worker: Worker) -> None:
        """An answer failed in a way that may or may not mean the worker is gone: check its
        health now instead of at the next interval."""
        if worker.up and worker.checking is None:
            worker.checking = asyncio.create_task(self.check(worker))

    def learn(self, worker: Worker, fingerprint: str | None) -> None:
        """Passive learning from answers: a worker's own fingerprint wins over a derived one;
        another own fingerprint than the known one has the worker checked now."""
        if not fingerprint or fingerprint == worker.fingerprint:
            return
        if not worker.own_fingerprint:
            worker.fingerprint, worker.own_fingerprint = fingerprint, True
        else:
            self.suspect(worker)

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for w in self.workers:
            if w.up:
                seen.update(dict.fromkeys(w.models))
        return list(seen)

    def limits(self, model: str) -> ModelLimits | None:
        """What every worker known to serve `model` accepts (None: no worker known yet)."""
        return self._limits.get(model)

    def any_up(self) -> bool:
        return any(w.up for w in self.workers)

    # -- health -------------------------------------------------------------------------------

    async def watch(self, interval_s: float) -> None:
        """Background task: the active health checks."""
        while not stopping():
            # Draining workers too: a hung one is ejected, interrupting what it holds.
            watched = self.workers + self.draining
            for w in watched:
                if w.checking is None:
                    w.checking = asyncio.create_task(self.check(w))
            await asyncio.gather(*(w.checking for w in watched if w.checking),
                                 return_exceptions=True)
            await asyncio.sleep(interval_s)

    async def check(self, worker: Worker) -> None:
        try:
            health = await self.upstream.get(worker.url + "/health", self.probe_timeout_s)
            if health.status != 200:
                raise Unreachable(f"/health answered {health.status}")
            if not worker.up:
                await self._introduce(worker)
            else:
                self._follow(worker, health.headers.get(FINGERPRINT_HEADER))
        except Exception as exc:  # whatever went wrong, the worker is not usable
            # (an odd /v1/models or probe answer included); the loop must survive it.
            self.eject(worker, f"{type(exc).__name__}: {exc}")
            return
        finally:
            if worker.checking is asyncio.current_task():
                worker.checking = None
        if not worker.up:
            log.warning("worker %s up: models %s, fingerprint %s, capacity %d", worker.name,
                        worker.models, worker.fingerprint, worker.capacity)
            self._show_up(worker, True)
            self.admission.hand_off(worker, self.acquire)

    def _follow(self, worker: Worker, fingerprint: str | None) -> None:
        """A built-in worker's fingerprint as its /health names it now (a weight update)."""
        if fingerprint and worker.own_fingerprint and fingerprint != worker.fingerprint:
            log.warning("worker %s fingerprint %s -> %s", worker.name, worker.fingerprint,
                        fingerprint)
            worker.fingerprint = fingerprint

    async def _introduce(self, worker: Worker) -> None:
        """Learn models, limits, capacity and fingerprint of a worker that is (again)
        healthy."""
        answer = await self.upstream.get(worker.url + "/v1/models", self.probe_timeout_s)
        if answer.status != 200:
            raise Unreachable(f"/v1/models answered {answer.status}")
        cards = [c for c in orjson.loads(answer.body).get("data", []) if isinstance(c, dict)]
        worker.models = [c["id"] for c in cards]
        if not worker.models:
            raise Unreachable("/v1/models lists no model")
        worker.limits = {c["id"]: ModelLimits.from_card(c) for c in cards}
        machine = cards[0].get("machine")
        worker.machine = machine if isinstance(machine, dict) else None
        seqs = cards[0].get("max_num_seqs")
        worker.capacity = seqs if isinstance(seqs, int) and seqs > 0 else self.default_capacity
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
        self._learn_limits()

    def _learn_limits(self) -> None:
        """Per model, the tightest limits of the workers serving it (a request may be retried
        on any of them); computed when a worker is introduced, never per request."""
        table: dict[str, ModelLimits] = {}
        for w in self.workers:
            for model, lim in w.limits.items():
                table[model] = table[model].tightest(lim) if model in table else lim
        self._limits = table

    async def _version(self, worker: Worker) -> str | None:
        try:
            answer = await self.upstream.get(worker.url + "/version", self.probe_timeout_s)
            return orjson.loads(answer.body).get("version") if answer.status == 200 else None
        except (Unreachable, TimedOut, orjson.JSONDecodeError, AttributeError):
            return None
