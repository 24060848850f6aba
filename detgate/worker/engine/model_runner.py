"""Runs one scheduled batch through the model: inputs, KV cache, logits, sampling, logprobs.

A batch mixes prefill chunks and decodes; their tokens are concatenated (sequence by sequence,
in batch order) into one forward pass. Logits are computed only for the rows that need them:
each sampling sequence's last position, plus every position of a chunk whose prompt logprobs
were asked for. Step inputs go through preallocated buffers (pinned host staging on CUDA).
`launch` queues a step and the copy of its results to the host; `collect` waits for that step
alone (an event, not a stream sync), so that another step may be launched in between.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from detgate.worker.engine.config import CUDA_KV_MEMORY_FRACTION, DEFAULT_CPU_KV_MB, EngineConfig
from detgate.worker.engine.constraint import ConstraintState, apply_masks, fill_masks, mask_words
from detgate.worker.engine.cuda_graphs import (
    WARM_DECODE_WIDTH,
    WARM_MIXED_WIDTH,
    DecodeGraphs,
    MixedGraphs,
)
from detgate.worker.engine.sampler import Sampler
from detgate.worker.engine.scheduler import Batch
from detgate.worker.engine.sequence import PENDING, Sequence, TokenLogprob
from detgate.worker.model.attention_metadata import AttentionMetadata
from detgate.worker.model.ops import make_ops


@dataclass
class StepResult:
    sampled: list[TokenLogprob]  # one per sampling entry, in batch order
    prompt_logprobs: list[tuple[Sequence, list[TokenLogprob]]]  # new prompt logprobs per sequence
    wait_seconds: float = 0.0  # the host blocked on the device for the results (CUDA)


class InputBuffers:
    """Step inputs, preallocated at their largest size and sliced per step.

    On CUDA each input is staged in pinned host memory and copied to one device buffer behind
    the work already queued (stream order keeps a step from overwriting inputs the step before
    it still reads). The host staging alternates between two sets, one per step in flight: with
    asynchronous scheduling step n + 1 is prepared while step n runs, and step n's late inputs
    (logits rows, sampling rows) are copied only once its forward is done, so reusing one set
    would make every launch wait for the step before it."""

    STAGES = 2  # steps whose staging may be in use: the one running and the one being launched

    def __init__(self, device: torch.device, max_tokens: int, max_seqs: int, max_blocks: int):
        self.device = device
        sizes = {"input_ids": max_tokens, "positions": max_tokens, "slot_mapping": max_tokens,
                 "logits_indices": max_tokens, "targets": max_tokens, "sample_rows": max_seqs,
                 "query_start_loc": max_seqs + 1, "seq_lens": max_seqs,
                 "pending_index": max_seqs, "pending_rows": max_seqs,
                 "block_tables": max_seqs * max_blocks}
        self.pinned = device.type == "cuda"
        int32 = ("query_start_loc", "seq_lens", "block_tables")
        dtypes = {name: torch.int32 if name in int32 else torch.int64 for name in sizes}
        stages = self.STAGES if self.pinned else 1
        self.host: list[dict[str, torch.Tensor]] = [
            {name: torch.zeros(size, dtype=dtypes[name], pin_memory=self.pinned)
             for name, size in sizes.items()} for _ in range(stages)]
        self.dev: dict[str, torch.Tensor] = (
            {name: torch.zeros(size, dtype=dtypes[name], device=device)
             for name, size in sizes.items()} if self.pinned else self.host[0])
        # Per stage and input, the last copy out of that staging buffer: a stage comes round
        # again two launches later, by when its step has normally been collected; a prefill
        # chunk that neither samples nor scores is never waited for, so the event guards it.
        self.copied: list[dict[str, torch.cuda.Event]] = [{} for _ in range(stages)]
        self.stage = 0

    def next_step(self) -> None:
        """Called once per launch, before its first `put`."""
        self.stage = (self.stage + 1) % len(self.host)

    def put(self, name: str, values: np.ndarray) -> torch.Tensor:
        n = values.size
        host = self.host[self.stage][name][:n]
        copied = self.copied[self.stage]
        if name in copied:
            copied[name].synchronize()
        host.numpy()[:] = values.reshape(-1)
        if not self.pinned:
            return host.view(values.shape)
        dev = self.dev[name][:n]
        dev.copy_(host, non_blocking=True)
        copied.setdefault(name, torch.cuda.Event()).record()
        return dev.view(values.shape)


@dataclass
class Launch:
    """A step queued on the device: what `collect` needs to read its results."""

    sample_seqs: list[Sequence]  # one per sampled row, in batch order
    rows: _Rows
    sampled: torch.Tensor | None  # [S] int64 on the device: the next step's PENDING tokens
    results: _Results


@dataclass
class _Rows:
    """Which hidden rows get logits, and what each row is for."""

    logits_indices: list[int]  # token index in the batch, per logits row
    targets: list[int]  # the prompt token a prompt row scores (0 for sampling rows)
    sample_rows: list[int]  # logits row of each sampling entry
    prompt_rows: list[tuple[Sequence, int, int]]  # (seq, first logits row, count)
    num_top: int  # top alternatives to compute; -1 = no logprobs at all
    with_rank: bool
    # Rows under a mask: logits row, its sequence's state, tokens the state takes first.
    masked: list[tuple[int, ConstraintState, tuple[int, ...]]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, model_config) -> None:
        self.model = model
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        self.num_kv_blocks = self._num_kv_blocks(config)
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings,
                                 self.num_kv_blocks * self.block_size)
        self.kv_caches = self._allocate_kv_cache()
        # Decode steps and mixed prefill + decode steps replay CUDA graphs; their padding rows
        # write into the padding block.
        self.graphs = self.mixed_graphs = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = DecodeGraphs(
                model, self.kv_caches, max_seqs=config.max_num_seqs, block_size=self.block_size,
                max_model_len=self.max_model_len, padding_block=self.num_kv_blocks)
            self.mixed_graphs = MixedGraphs(
                model, self.kv_caches, max_seqs=config.max_num_seqs,
                max_tokens=config.max_num_batched_tokens, block_size=self.block_size,
                max_model_len=self.max_model_len, padding_block=self.num_kv_blocks,
                hidden_size=model_config.hidden_size, dtype=model_config.dtype,
                pool=self.graphs.pool)
        self.inputs = InputBuffers(self.device, config.max_num_batched_tokens, config.max_num_seqs,
                                   -(-self.max_model_len // self.block_size))
        ops = make_ops(config.mode)
        self.sampler = Sampler(ops.log_softmax, ops.softmax, self.device)
        self.mask_words = mask_words(model_config.vocab_size)
        # Token masks are computed on the host while the forward runs (see `launch`).
        self._masker = ThreadPoolExecutor(1, thread_name_prefix="token-masks")

    @torch.inference_mode()
    def warm_up(self, decode_width: int = WARM_DECODE_WIDTH,
                mixed_width: int = WARM_MIXED_WIDTH, logits: bool = True) -> dict:
        """CUDA, before serving: capture the decode graphs of every batch size at the context
        widths up to `decode_width` and the mixed-step graphs of every token bucket up to
        `mixed_width` (longer contexts are still captured on first use), then run the step's
        eager lm_head at every row count from 1 to max_num_seqs, and argmax and the logprobs
        once (their kernels take the row count as a grid size only: nothing to warm per count).
        Otherwise the first steps of a new shape pay for it inside a request: a graph capture
        (an eager run, then the capture), a kernel compile, or for an lm_head of 129 rows and
        more in batch_invariant mode a cuBLASLt heuristic query and, for an algorithm met for
        the first time, its bit check (kernels/cublaslt.py). Everything here runs on dummy
        inputs whose K/V go to the padding block: no sequence's state, and no bit of any later
        step, depends on it (which path serves a matmul never changes its bits). CPU: nothing
        to do. `logits=False` leaves out the eager tail (a benchmark's control)."""
        if self.device.type != "cuda":
            return {}
        info = {}
        for kind, graphs, width in (("decode", self.graphs, decode_width),
                                    ("mixed", self.mixed_graphs, mixed_width)):
            start = time.perf_counter()
            info[f"{kind}_graphs"] = graphs.capture_all(width) if graphs else 0
            info[f"{kind}_capture_seconds"] = round(time.perf_counter() - start, 1)
        if not logits:
            return info
        tail = time.perf_counter()
        mc = self.model_config
        rows = self.max_num_seqs
        hidden = torch.zeros(rows, mc.hidden_size, dtype=mc.dtype, device=self.device)
        for r in range(1, rows + 1):
            out = self.model.compute_logits(hidden[:r])
        self.sampler.logprobs(out, out.argmax(dim=-1), num_top=1, with_rank=True)
        torch.cuda.synchronize(self.device)
        info["logits_rows"] = rows
        info["logits_seconds"] = round(time.perf_counter() - tail, 1)
        return info

    @torch.inference_mode()
    def launch(self, batch: Batch, previous: Launch | None) -> Launch:
        """Queue a step's GPU work and the copy of its results to the host, without waiting.
        `previous`: the step still in flight, whose sampled ids are this step's PENDING
        input tokens (read on the device)."""
        self.inputs.next_step()
        input_ids, positions, meta = self._prepare_inputs(batch, previous)
        rows = self._plan_rows(batch)
        # A mask depends only on its sequence's known tokens: computing it beside the
        # forward changes nothing but the time it takes.
        masks = self._fill_masks(rows)
        hidden = self._forward(input_ids, positions, meta)  # [T, H]
        sample_seqs = [e.seq for e in batch.entries if e.samples]
        if not rows.logits_indices:  # only prefill chunks that neither sample nor score
            return Launch(sample_seqs, rows, None, _Results([]))
        logits_indices = self.inputs.put("logits_indices", np.array(rows.logits_indices, np.int64))
        logits = self.model.compute_logits(hidden[logits_indices])  # [R, V] model dtype
        if masks is not None:
            masked_rows = torch.tensor([r for r, _, _ in rows.masked], device=self.device)
            apply_masks(logits, masked_rows, masks.result())
        sample_rows = self.inputs.put("sample_rows", np.array(rows.sample_rows, np.int64))
        sampled = self.sampler.sample(logits[sample_rows], sample_seqs)  # [S] int64
        if rows.num_top < 0:
            return Launch(sample_seqs, rows, sampled, _Results([sampled]))
        chosen = self.inputs.put("targets", np.array(rows.targets, np.int64)).clone()
        chosen[sample_rows] = sampled
        lp = self.sampler.logprobs(logits, chosen, rows.num_top, rows.with_rank)
        results = [sampled, lp.chosen, lp.top_values, lp.top_ids]
        return Launch(sample_seqs, rows, sampled,
                      _Results(results + ([lp.rank] if rows.with_rank else [])))

    def collect(self, launch: Launch) -> StepResult:
        """Wait for a launched step's results and unpack them."""
        start = time.perf_counter()
        tensors = launch.results.wait()
        waited = time.perf_counter() - start
        host = [h.tolist() for h in tensors]
        if not host:
            result = StepResult([], [])
        elif launch.rows.num_top < 0:
            result = StepResult([TokenLogprob(t) for t in host[0]], [])
        else:
            result = self._unpack(launch.sample_seqs, launch.rows, host)
        result.wait_seconds = waited
        return result

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        graphs = self.graphs if meta.max_query_len == 1 else self.mixed_graphs
        if graphs is not None:
            hidden = graphs.forward(input_ids, positions, meta)
            if hidden is not None:
                return hidden
        return self.model(input_ids, positions, meta, self.kv_caches)

    def _fill_masks(self, rows: _Rows) -> Future | None:
        if not rows.masked:
            return None
        return self._masker.submit(fill_masks, [(st, forced) for _, st, forced in rows.masked],
                                   self.mask_words)

    # -- inputs ----------------------------------------------------------------------------

    def _prepare_inputs(self, batch: Batch, previous: Launch | None
                        ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        # Per sequence only its start, count, table and token slice are read in Python; every
        # per-token input is one numpy expression: a decode step of hundreds of sequences must
        # cost well under the GPU's step time on the host.
        bs, entries = self.block_size, batch.entries
        b = len(entries)
        starts = np.fromiter((e.start for e in entries), np.int64, b)
        counts = np.fromiter((e.num_tokens for e in entries), np.int64, b)
        ends = starts + counts
        block_tables = [e.seq.block_table for e in entries]
        lens = np.fromiter(map(len, block_tables), np.int64, b)
        tables = np.full((b, int(lens.max())), -1, dtype=np.int32)
        # Row-major boolean assignment: row i's first lens[i] slots, in the chain's order.
        tables[np.arange(tables.shape[1]) < lens[:, None]] = np.fromiter(
            itertools.chain.from_iterable(block_tables), np.int32, int(lens.sum()))
        qsl = np.zeros(b + 1, np.int64)
        np.cumsum(counts, out=qsl[1:])
        seq_of = np.repeat(np.arange(b), counts)  # each token's sequence
        positions = np.arange(int(qsl[-1]), dtype=np.int64) - qsl[seq_of] + starts[seq_of]
        slots = tables[seq_of, positions // bs].astype(np.int64) * bs + positions % bs
        ids = np.fromiter(itertools.chain.from_iterable(
            e.seq.token_ids[e.start:e.end] for e in entries), np.int64, int(qsl[-1]))
        put = self.inputs.put
        meta = AttentionMetadata(
            query_start_loc=put("query_start_loc", qsl.astype(np.int32)),
            seq_lens=put("seq_lens", ends.astype(np.int32)),
            block_tables=put("block_tables", tables),
            slot_mapping=put("slot_mapping", slots),
            max_query_len=int(counts.max()),
            max_seq_len=int(ends.max()),
        )
        input_ids = put("input_ids", ids)
        pending = np.flatnonzero(ids == PENDING)
        if pending.size:  # tokens the previous step is sampling: copied on the device
            assert previous is not None and previous.sampled is not None, "PENDING without a step"
            row_of = {seq: r for r, seq in enumerate(previous.sample_seqs)}
            rows = np.fromiter((row_of[entries[i].seq] for i in seq_of[pending]), np.int64,
                               pending.size)
            input_ids[put("pending_index", pending)] = previous.sampled[put("pending_rows", rows)]
        return input_ids, put("positions", positions), meta

    def _plan_rows(self, batch: Batch) -> _Rows:
        rows = _Rows([], [], [], [], num_top=-1, with_rank=False)
        offset = 0  # token index of the entry's first token in the batch
        for e in batch.entries:
            seq, params = e.seq, e.seq.params
            if params.prompt_logprobs is not None:
                # Position p scores prompt token p + 1; skip positions scored before a preemption.
                first = max(e.start, len(seq.prompt_logprobs))
                last = min(e.end, seq.num_prompt_tokens - 1)
                if first < last:
                    rows.prompt_rows.append((seq, len(rows.logits_indices), last - first))
                    base = offset - e.start
                    rows.logits_indices.extend(range(base + first, base + last))
                    rows.targets.extend(seq.token_ids[first + 1:last + 1])
                    rows.num_top = max(rows.num_top, params.prompt_logprobs)
                    rows.with_rank = True
                    if params.constraint is not None:
                        self._plan_scored_masks(rows, seq, first, last)
            if e.samples:
                if seq.constraint is not None:
                    rows.masked.append((len(rows.logits_indices), seq.constraint, ()))
                rows.sample_rows.append(len(rows.logits_indices))
                rows.logits_indices.append(offset + e.num_tokens - 1)
                rows.targets.append(0)
                if params.logprobs is not None:
                    rows.num_top = max(rows.num_top, params.logprobs)
            offset += e.num_tokens
        return rows

    @staticmethod
    def _plan_scored_masks(rows: _Rows, seq: Sequence, first: int, last: int) -> None:
        """A scored sequence (one pass, the /v1/score path) under a constraint: each prompt
        token from `score_start` on is scored under the mask it would have been generated
        under, teacher-forced through one fresh state (logits rows first..last-1 are the
        last `last - first` rows planned)."""
        start = seq.params.score_start
        state = seq.params.constraint.state()
        base = len(rows.logits_indices) - (last - first)
        for p in range(max(first, start - 1), last):  # position p scores token p + 1
            forced = () if p + 1 == start else (seq.token_ids[p],)
            rows.masked.append((base + p - first, state, forced))

    def _unpack(self, sample_seqs: list[Sequence], rows: _Rows, host: list[list]) -> StepResult:
        token_ids, chosen, top_values, top_ids = host[:4]
        rank = host[4] if rows.with_rank else None

        def entry(r: int, token_id: int, k: int, with_rank: bool) -> TokenLogprob:
            top = list(zip(top_ids[r][:k], top_values[r][:k], strict=True)) if k else []
            return TokenLogprob(token_id, chosen[r], top, rank[r] if with_rank else None)

        sampled = []
        for seq, r, token_id in zip(sample_seqs, rows.sample_rows, token_ids, strict=True):
            k = seq.params.logprobs
            sampled.append(TokenLogprob(token_id) if k is None else entry(r, token_id, k, False))
        prompt = [(seq, [entry(r, rows.targets[r], seq.params.prompt_logprobs, True)
                         for r in range(first, first + n)])
                  for seq, first, n in rows.prompt_rows]
        return StepResult(sampled, prompt)

    # -- KV cache --------------------------------------------------------------------------

    def _block_bytes(self) -> int:
        mc = self.model_config
        itemsize = torch.empty((), dtype=mc.dtype).element_size()
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * itemsize

    def _num_kv_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        if config.kv_cache_mb is not None:
            return max(1, config.kv_cache_mb * 2**20 // self._block_bytes())
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * CUDA_KV_MEMORY_FRACTION) // self._block_bytes()
        max_len = config.max_model_len or self.model_config.max_position_embeddings
        wanted = config.max_num_seqs * -(-max_len // self.block_size)
        return max(1, min(wanted, DEFAULT_CPU_KV_MB * 2**20 // self._block_bytes()))

    def _allocate_kv_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mc = self.model_config
        # One allocation; layer l's (k_cache, v_cache) are views [num_blocks, block_size, Hkv, D].
        # Block num_kv_blocks is the padding block: the block manager never hands it out; padded
        # decode rows (CUDA graphs) write and read there.
        cache = torch.zeros(mc.num_layers, 2, self.num_kv_blocks + 1, self.block_size,
                            mc.num_kv_heads, mc.head_dim, dtype=mc.dtype, device=self.device)
        return [(cache[i, 0], cache[i, 1]) for i in range(mc.num_layers)]


class _Results:
    """A step's result tensors on their way to the host: on CUDA copied into pinned memory
    behind the step's work, with an event to wait on that step alone (a stream sync would
    also wait for the step launched after it)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.event = None
        if not tensors or tensors[0].device.type == "cpu":
            self.host = tensors
            return
        self.host = [_pinned_copy(t) for t in tensors]
        self.event = torch.cuda.Event()
        self.event.record()

    def wait(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.host


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` copied to the host behind the work queued so far (an empty one needs no copy: the
    top-k of a step that asks for no alternatives)."""
    if not t.numel():
        return torch.empty(t.shape, dtype=t.dtype)
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
