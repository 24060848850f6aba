"""The engine: `step()` = schedule -> launch -> collect -> resolve (AsyncEngine, in
async_engine.py, runs it in a thread for all concurrent requests)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from detgate.worker.engine.block_manager import BlockManager
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.model_runner import Launch, ModelRunner, StepResult
from detgate.worker.engine.scheduler import Batch, ScheduledSeq, Scheduler
from detgate.worker.engine.sequence import SamplingParams, Sequence, TokenLogprob
from detgate.worker.errors import InvalidRequest


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
        self.vocab_size = model_config.vocab_size
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
        vocab = self.vocab_size
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

    def abort_all(self) -> list[RequestOutput]:
        outputs = [self.abort(request_id) for request_id in list(self._seqs)]
        self._in_flight = None
        return outputs

    def update_weights(self, commit: Callable[[], None]) -> None:
        """Between steps, with no sequence left: `commit` writes new weights into the model's
        parameters, and the prefix cache is dropped, since its blocks hold K/V computed with
        the old weights that a sequence on the new ones would otherwise find by its tokens.
        (A step of aborted sequences may still run on the device: it reads the parameters
        before the copy, which is queued after it on the same stream.)"""
        self._require_idle("update_weights()")
        commit()
        self.block_manager.reset_prefix_cache()

    def warm_up(self) -> dict:
        """Before serving: on CUDA, capture the usual step graphs and run a step's eager tail at
        every row count, on dummy inputs (ModelRunner.warm_up: what it spares the first
        requests, and why it changes no bit); on the CPU nothing. Returns what it did."""
        self._require_idle("warm_up()")
        return self.runner.warm_up()

    def reset_prefix_cache(self) -> None:
        """With no sequence left: forget every cached prefix, so that the next request computes
        its whole prompt (a benchmark's passes over the same prompts each start cold)."""
        self._require_idle("reset_prefix_cache()")
        self.block_manager.reset_prefix_cache()

    def _require_idle(self, what: str) -> None:
        if self._seqs or self._in_flight is not None:
            raise RuntimeError(f"{what} while sequences are in the engine")

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

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
