"""Continuous batching: which sequences run in the next step, and with how many tokens.

Each step mixes decodes (one token each) and prefill chunks under a token budget. Running
sequences go first, in admission order; waiting sequences are admitted while the budget,
max_num_seqs and the KV cache allow. When a decode needs a new block and none is free, the
newest running sequence is preempted: its blocks are freed and it goes back to the front of the
waiting queue, to be recomputed (its full blocks usually come straight back from the prefix
cache). In batch-invariant mode none of this changes any token's numbers.

A step's bookkeeping comes in two halves, so that the next step can be scheduled while this one
runs on the GPU (asynchronous scheduling): `advance` right after the step is launched (tokens
computed, blocks published, a PENDING slot for each token being sampled), `resolve` once its
sampled ids are on the host (PENDING replaced, stops checked). With asynchronous scheduling
`advance` of step n + 1 comes before `resolve` of step n, so:
- a sequence may hold two PENDING slots, and a block is published only once its token ids are
  all known (`resolve` publishes what waited);
- a sequence with nothing left to compute (its next token, or its last, is in flight) is not
  scheduled;
- a sequence that stops on the token in flight was already scheduled once more; that step's
  result for it is dropped;
- blocks freed while a step is in flight are safe to hand out: every later write to them is a
  later launch on the same stream.
Batch invariance makes the extra or delayed rows invisible in every other row's numbers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from detgate.worker.engine.block_manager import BlockManager
from detgate.worker.engine.sequence import PENDING, Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledSeq:
    """`num_tokens` tokens of `seq` starting at position `start` run in this step. Every
    field is fixed at scheduling time (a step's bookkeeping reads them once per sequence)."""

    seq: Sequence
    start: int
    num_tokens: int
    end: int = field(init=False)
    # The chunk reaches the sequence's last token, whose logits give the next token.
    completes_prefill: bool = field(init=False)
    samples: bool = field(init=False)  # it also draws that token (max_tokens > 0)

    def __post_init__(self) -> None:
        self.end = self.start + self.num_tokens
        self.completes_prefill = self.end == len(self.seq.token_ids)
        self.samples = self.completes_prefill and self.seq.params.max_tokens > 0


@dataclass
class Batch:
    entries: list[ScheduledSeq]
    num_preempted: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(e.num_tokens for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, prefill_chunk: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        budget = self.max_num_batched_tokens
        entries: list[ScheduledSeq] = []
        preempted = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if not seq.num_uncomputed_tokens or _mask_waits(seq):
                i += 1  # waits for the token of a step in flight
                continue
            while not self.block_manager.can_append(seq):
                victim = self.running[-1]  # the newest; never one already scheduled (index < i)
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            else:
                self.block_manager.append(seq)
                entries.append(self._entry(seq, budget))
                budget -= entries[-1].num_tokens
                i += 1
        # Admitting while preempting would only preempt again.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            if seq.params.single_pass and len(seq) > budget:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            entries.append(self._entry(seq, budget))
            budget -= entries[-1].num_tokens
        self.num_preemptions += preempted
        return Batch(entries, preempted)

    def postprocess(self, batch: Batch, sampled_token_ids: list[int]) -> list[ScheduledSeq]:
        """`advance` then `resolve`: a step's whole bookkeeping once its results are in."""
        self.advance(batch)
        return self.resolve(batch, sampled_token_ids)

    def advance(self, batch: Batch) -> None:
        """Record a launched step: its tokens are computed, and each sampling sequence that
        will go on gets a PENDING slot for the token being sampled, which the next step reads
        on the device. A sequence whose last token this is gets no slot: it waits for
        `resolve`, which finishes it."""
        for entry in batch.entries:
            seq = entry.seq
            seq.num_computed_tokens = entry.end
            self.block_manager.register_computed(seq)
            if entry.samples and seq.num_completion_tokens + 1 < seq.params.max_tokens:
                seq.token_ids.append(PENDING)

    def resolve(self, batch: Batch, sampled_token_ids: list[int]) -> list[ScheduledSeq]:
        """A step's sampled ids (one per sampling entry) are in: put them in place and check
        stops. Returns the entries that produced an output (a finished prefill), leaving out
        sequences aborted or stopped since the step was launched."""
        sampled = iter(sampled_token_ids)
        resolved = []
        for entry in batch.entries:
            token_id = next(sampled) if entry.samples else None
            seq = entry.seq
            if seq.is_finished or not entry.completes_prefill:
                continue
            resolved.append(entry)
            if token_id is None:
                self.finish(seq, "length")
                continue
            # The token's slot: PENDING unless it was this sequence's last (`advance`); the
            # step launched after this one may have added a PENDING of its own behind it.
            if len(seq.token_ids) > entry.end:
                seq.token_ids[entry.end] = token_id
                self.block_manager.register_computed(seq)  # a block that waited for it
            else:
                seq.token_ids.append(token_id)
            if seq.constraint is not None:
                seq.constraint.accept(token_id)
            reason = stop_reason(seq, token_id, entry.end + 1 - seq.num_prompt_tokens)
            if reason is not None:
                self.finish(seq, reason)
        return resolved

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` (stop, length or abort) wherever it is, and free its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _entry(self, seq: Sequence, budget: int) -> ScheduledSeq:
        remaining = seq.num_uncomputed_tokens
        n = remaining if seq.params.single_pass else min(remaining, self.prefill_chunk, budget)
        return ScheduledSeq(seq, seq.num_computed_tokens, n)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)


def _mask_waits(seq: Sequence) -> bool:
    """A constrained sequence's next mask needs the token a step in flight is sampling: it
    sits that step out (asynchronous scheduling), so that its mask always follows from its
    own known tokens."""
    return seq.constraint is not None and seq.token_ids[-1] == PENDING


def stop_reason(seq: Sequence, token_id: int, num_completion_tokens: int) -> str | None:
    """Why `seq` ends at `token_id`, its completion token number `num_completion_tokens`."""
    params = seq.params
    if token_id in params.stop_token_ids:
        return "stop"
    if seq.constraint is not None and seq.constraint.finished:
        return "stop"
    if not params.ignore_eos and token_id in seq.eos_token_ids:
        return "stop"
    if num_completion_tokens >= params.max_tokens:
        return "length"
    return None
