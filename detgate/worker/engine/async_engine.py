"""AsyncEngine: one engine loop in a thread serving every concurrent request (continuous
batching), streaming each request's outputs back to its asyncio task, and applying weight
updates between steps.

Only the loop thread touches the Engine: submissions, aborts and updates reach it through one
inbox, in the order the event loop made them, and outputs come back to the event loop with
call_soon_threadsafe, one call per step. That order is what makes an update atomic: a sequence
submitted before an update (`update_weights`) runs entirely on the old weights, or is aborted
with WeightsUpdated; one submitted after it waits until the new weights are in, and then runs
entirely on them. No sequence straddles an update, and the prefix cache is dropped with it
(Engine.update_weights). A caller that reads the weights' fingerprint and submits without an
await in between therefore knows which weights its sequences run on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from detgate.worker.engine.engine import Engine, RequestOutput, StepStats
from detgate.worker.engine.sequence import SamplingParams
from detgate.worker.errors import EngineDead, WeightsUpdated

log = logging.getLogger(__name__)


@dataclass
class UpdateOutcome:
    """What an update did to the sequences submitted before it."""

    finished: int  # ran to their end on the old weights first
    aborted: int  # ended at once (`abort`)
    drain_s: float  # from the update's turn in the inbox to the commit
    commit_s: float  # the copy into the parameters


@dataclass
class _Update:
    commit: Callable[[], None]
    future: asyncio.Future
    started: float
    before: int  # sequences in the engine when its turn came
    aborted: int = 0
    held: list[tuple] = field(default_factory=list)  # inbox messages that came after it


class AsyncEngine:
    def __init__(self, engine: Engine, on_step: Callable[[StepStats], None] | None = None,
                 on_finish: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step
        self.on_finish = on_finish
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: str | None = None
        self._update: _Update | None = None  # loop thread only
        self._step_started: float | None = None  # monotonic; None between steps

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._inbox.put(("stop",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def dead(self) -> str | None:
        """Why the engine serves nothing any more (None while it serves)."""
        return self._dead

    def problem(self, stall_s: float) -> str | None:
        """Why the engine cannot serve now (its loop stopped, or one step has taken longer
        than `stall_s`: hung, not slow), or None. Safe from any thread."""
        if self._dead is not None:
            return self._dead
        if self._thread is None or not self._thread.is_alive():
            return "the engine loop is not running"
        started = self._step_started
        if started is not None and time.monotonic() - started > stall_s:
            return f"an engine step has run for more than {stall_s:g}s"
        return None

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest if the request can never run (Engine.validate)."""
        self.engine.validate(token_ids, params)

    def generate(self, request_id: str, token_ids: list[int], params: SamplingParams, *,
                 validated: bool = False) -> Outputs:
        """Submit one sequence now; iterate the result for its outputs as they are produced.
        Closing it before the end (or leaving an `async for` through `aclosing`) aborts the
        sequence. `validated`: the caller has run `validate` on it already (it is checked
        once, here or there, always before it reaches the loop thread)."""
        if not validated:
            self.engine.validate(token_ids, params)
        if self._dead is not None:
            raise EngineDead(self._dead)
        outputs: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = outputs
        self._inbox.put(("add", request_id, token_ids, params))
        return Outputs(self, request_id, outputs)

    def update_weights(self, commit: Callable[[], None], *, abort: bool) -> asyncio.Future:
        """Queue a weight update behind every submission made so far; the future gives its
        UpdateOutcome. The sequences submitted before it finish first (with `abort`: end now,
        with WeightsUpdated); then `commit` writes the new weights, in the loop thread; then
        the sequences submitted after it run. A failing commit leaves the weights half
        written: the engine then stops serving (EngineDead)."""
        if self._dead is not None:
            raise EngineDead(self._dead)
        future = self._loop.create_future()
        self._inbox.put(("update", commit, abort, future))
        return future

    def _close(self, request_id: str, finished: bool) -> None:
        self._queues.pop(request_id, None)
        if not finished:
            self._inbox.put(("abort", request_id))

    # -- the loop thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                idle = not self.engine.has_work() and self._update is None
                if not self._drain_inbox(block=idle):
                    return
                if self._update is not None and not self.engine.has_work():
                    if not self._apply_update():
                        return
                    continue
                if not self.engine.has_work():
                    continue
                self._step_started = time.monotonic()
                outputs, stats = self.engine.step()
            except Exception as exc:  # a failed step: fail what is in flight, keep serving
                log.exception("engine step failed")
                self.engine.abort_all()
                self._deliver_error(EngineDead(f"engine step failed: {exc}"))
                continue
            finally:
                self._step_started = None
            self._loop.call_soon_threadsafe(self._deliver, outputs)
            if self.on_step is not None:
                self.on_step(stats)
            for out in outputs:
                if out.finished:
                    self._finished(out)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued messages; False once asked to stop."""
        while True:
            try:
                message = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if message[0] == "stop":
                self._dead = "the engine is shut down"
                self._deliver_error(EngineDead(self._dead))
                if self._update is not None:
                    self._resolve(self._update.future, EngineDead(self._dead))
                return False
            self._handle(message)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if self._update is not None and kind != "abort":
            self._update.held.append(message)  # after the update: on the new weights
        elif kind == "add":
            self.engine.add(*message[1:], validated=True)
        elif kind == "abort":
            self._abort(message[1])
        else:
            _, commit, abort, future = message
            update = _Update(commit, future, time.perf_counter(), self.engine.num_sequences)
            self._update = update
            if abort:
                aborted = [out for out in self.engine.abort_all() if out is not None]
                update.aborted = len(aborted)
                self._deliver_error(WeightsUpdated(), [out.request_id for out in aborted])
                for out in aborted:
                    self._finished(out)

    def _abort(self, request_id: str) -> None:
        if self._update is not None:  # not submitted to the engine yet: drop it there
            held = self._update.held
            held[:] = [m for m in held if not (m[0] == "add" and m[1] == request_id)]
        out = self.engine.abort(request_id)
        if out is not None:
            self._finished(out)

    def _apply_update(self) -> bool:
        """Commit the pending update, then let what came after it in; False if it failed."""
        update, self._update = self._update, None
        start = time.perf_counter()
        try:
            self.engine.update_weights(update.commit)
        except Exception as exc:
            log.exception("weight update failed while writing the weights")
            self._dead = f"a weight update failed while writing the weights ({exc})"
            self._deliver_error(EngineDead(self._dead))
            self._resolve(update.future, EngineDead(self._dead))
            return False
        done = time.perf_counter()
        self._resolve(update.future, UpdateOutcome(
            finished=update.before - update.aborted, aborted=update.aborted,
            drain_s=start - update.started, commit_s=done - start))
        for message in update.held:
            self._handle(message)
        return True

    def _finished(self, out: RequestOutput) -> None:
        if self.on_finish is not None:
            self.on_finish(out.finish_reason)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._queues.get(out.request_id)
            if target is not None:
                target.put_nowait(out)

    def _deliver_error(self, error: Exception, request_ids: list[str] | None = None) -> None:
        """`error` to the given requests' streams (None: to every stream)."""
        def fail() -> None:
            ids = list(self._queues) if request_ids is None else request_ids
            for request_id in ids:
                target = self._queues.get(request_id)
                if target is not None:
                    target.put_nowait(error)
        self._loop.call_soon_threadsafe(fail)

    def _resolve(self, future: asyncio.Future, result: object) -> None:
        def resolve() -> None:
            if future.done():
                return
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        self._loop.call_soon_threadsafe(resolve)


class Outputs:
    """One submitted sequence's outputs, as an async iterator; closing it before its last
    output aborts the sequence, whether iteration started or not."""

    def __init__(self, engine: AsyncEngine, request_id: str, outputs: asyncio.Queue) -> None:
        self._engine = engine
        self._request_id = request_id
        self._outputs = outputs
        self._finished = False
        self._closed = False

    def __aiter__(self) -> Outputs:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        out = await self._outputs.get()
        if isinstance(out, Exception):
            self.close()
            raise out
        if out.finished:
            self._finished = True
            self.close()
        return out

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine._close(self._request_id, self._finished)
