"""The engine: `step()` = schedule -> launch -> collect -> resolve, and AsyncEngine, which runs
one engine loop in a thread for all concurrent requests (continuous batching) and streams each
request's outputs back to its asyncio task."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from worker.engine.block_manager import BlockManager
from worker.engine.config import EngineConfig
from worker.engine.model_runner import Launch, ModelRunner, StepResult
from worker.engine.scheduler import Batch, ScheduledSeq, Scheduler
from worker.engine.sequence import SamplingParams, Sequence, TokenLogprob
from worker.errors import EngineDead, InvalidRequest

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_tokens: list[TokenLogprob]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprob] | None = None  # once, when the whole prompt is scored


@dataclass
class StepStats:
    num_seqs: int
    num_tokens: int
    num_generated: int
    num_preempted: int
    seconds: float
    # Of `seconds`, the time the host blocked on the device for the step's results (CUDA; on
    # the CPU the work is done inside the launch): the rest is host work the GPU waited for,
    # unless a step launched ahead (asynchronous scheduling) kept it busy.
    wait_seconds: float = 0.0


@dataclass
class _InFlight:
    batch: Batch
    launch: Launch | None  # None: nothing to run (only preemptions)


class Engine:
    def __init__(self, config: EngineConfig, model, model_config) -> None:
        self.config = config
        self.runner = ModelRunner(config, model, model_config)
        self.max_model_len = self.runner.max_model_len
        self.eos_token_ids = tuple(model_config.eos_token_ids)
        self.block_manager = BlockManager(self.runner.num_kv_blocks, config.block_size,
                                          config.enable_prefix_cache)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   prefill_chunk=config.prefill_chunk)
        self._seqs: dict[str, Sequence] = {}
        self.async_scheduling = config.overlaps_steps
        self._in_flight: _InFlight | None = None  # launched, its results not yet collected

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest if the request can never run. Pure: safe from any thread."""
        if not token_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context length of {self.max_model_len} tokens", param="max_tokens",
                code="context_length_exceeded")
        if params.single_pass and len(token_ids) > self.config.max_num_batched_tokens:
            limit = self.config.max_num_batched_tokens
            raise InvalidRequest(f"at most {limit} tokens can be scored", param="token_ids")
        vocab = self.runner.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise InvalidRequest(f"token ids must be in [0, {vocab})", param="prompt")

    def add(self, request_id: str, token_ids: list[int], params: SamplingParams, *,
            validated: bool = False) -> None:
        """Queue a sequence; `validated`: the caller has run `validate` on it already."""
        if not validated:
            self.validate(token_ids, params)
        seq = Sequence(request_id, list(token_ids), params, self.eos_token_ids)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        return self._output(seq, [])

    def abort_all(self) -> None:
        for request_id in list(self._seqs):
            self.abort(request_id)
        self._in_flight = None

    def has_work(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_work()

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        """Run one step and return its outputs. With asynchronous scheduling the next step is
        scheduled and launched before this one's results are waited for, so the host's work
        for step n + 1 (and for step n's outputs) overlaps step n's on the GPU."""
        start = time.perf_counter()
        current = self._in_flight or self._launch(self.scheduler.schedule(), None)
        self._in_flight = None
        if self.async_scheduling:
            upcoming = self.scheduler.schedule()
            if upcoming.entries or upcoming.num_preempted:
                self._in_flight = self._launch(upcoming, current.launch)
        result = self.runner.collect(current.launch) if current.launch else StepResult([], [])
        for seq, logprobs in result.prompt_logprobs:
            seq.prompt_logprobs.extend(logprobs)
        resolved = self.scheduler.resolve(current.batch, [t.token_id for t in result.sampled])
        outputs = self._outputs(current.batch, resolved, result)
        return outputs, self._stats(current.batch, result, time.perf_counter() - start)

    def _launch(self, batch: Batch, previous: Launch | None) -> _InFlight:
        launch = self.runner.launch(batch, previous) if batch.entries else None
        self.scheduler.advance(batch)
        return _InFlight(batch, launch)

    def _outputs(self, batch: Batch, resolved: list[ScheduledSeq],
                 result: StepResult) -> list[RequestOutput]:
        tokens = dict(zip((e.seq for e in batch.entries if e.samples), result.sampled,
                          strict=True))
        outputs = []
        for entry in resolved:
            seq = entry.seq
            # The prompt's logprobs go out with the first token (or alone when nothing is
            # generated): the step that computed the prompt's last token.
            first = entry.end == seq.num_prompt_tokens
            outputs.append(self._output(seq, [tokens[seq]] if entry.samples else [], first))
            if seq.is_finished:
                del self._seqs[seq.request_id]
        return outputs

    def _output(self, seq: Sequence, new_tokens: list[TokenLogprob],
                first: bool = False) -> RequestOutput:
        with_prompt = seq.params.prompt_logprobs is not None and first
        return RequestOutput(seq.request_id, new_tokens, seq.is_finished, seq.finish_reason,
                             seq.num_prompt_tokens, seq.num_cached_tokens,
                             list(seq.prompt_logprobs) if with_prompt else None)

    def _stats(self, batch: Batch, result: StepResult, seconds: float) -> StepStats:
        return StepStats(num_seqs=len(batch), num_tokens=batch.num_tokens,
                         num_generated=len(result.sampled), num_preempted=batch.num_preempted,
                         seconds=seconds, wait_seconds=result.wait_seconds)


class AsyncEngine:
    """One engine loop in a thread serving every request; asyncio callers stream its outputs.

    Only the loop thread touches the Engine: requests and aborts reach it through an inbox, and
    outputs come back to the event loop with call_soon_threadsafe, one call per step.
    """

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

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest if the request can never run (Engine.validate)."""
        self.engine.validate(token_ids, params)

    async def generate(self, request_id: str, token_ids: list[int], params: SamplingParams, *,
                       validated: bool = False) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they are produced; leaving early aborts the request.
        `validated`: the caller has run `validate` on it already (it is checked once, here or
        there, always before it reaches the loop thread)."""
        if not validated:
            self.engine.validate(token_ids, params)
        if self._dead is not None:
            raise EngineDead(self._dead)
        outputs: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = outputs
        self._inbox.put(("add", request_id, token_ids, params))
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, Exception):
                    raise out
                finished = out.finished
                yield out
        finally:
            del self._queues[request_id]
            if not finished:
                self._inbox.put(("abort", request_id))

    # -- the loop thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if not self._drain_inbox(block=not self.engine.has_work()):
                    return
                if not self.engine.has_work():
                    continue
                outputs, stats = self.engine.step()
            except Exception as exc:  # a failed step: fail what is in flight, keep serving
                log.exception("engine step failed")
                self.engine.abort_all()
                self._deliver_error(EngineDead(f"engine step failed: {exc}"))
                continue
            self._loop.call_soon_threadsafe(self._deliver, outputs)
            if self.on_step is not None:
                self.on_step(stats)
            for out in outputs:
                if out.finished:
                    self._finished(out)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds and aborts; False once asked to stop."""
        while True:
            try:
                message = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if message[0] == "stop":
                self._dead = "the engine is shut down"
                self._deliver_error(EngineDead(self._dead))
                return False
            if message[0] == "add":
                self.engine.add(*message[1:], validated=True)
            else:
                out = self.engine.abort(message[1])
                if out is not None:
                    self._finished(out)

    def _finished(self, out: RequestOutput) -> None:
        if self.on_finish is not None:
            self.on_finish(out.finish_reason)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._queues.get(out.request_id)
            if target is not None:
                target.put_nowait(out)

    def _deliver_error(self, error: Exception) -> None:
        def fail_all() -> None:
            for target in self._queues.values():
                target.put_nowait(error)
        self._loop.call_soon_threadsafe(fail_all)
