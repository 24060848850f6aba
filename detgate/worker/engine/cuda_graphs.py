"""Engine steps replayed from CUDA graphs: decode-only steps (DecodeGraphs, per batch size and
context width) and steps that mix prefill chunks and decodes (MixedGraphs, per bucket of
scheduled tokens and context width; its docstring gives its padding and invariance argument).

A decode step launches hundreds of small kernels (every layer's matmuls, norms, rotary,
attention); from Python their launch cost exceeds their run time. A graph per (batch size,
context width) replays them all with one launch. A decode-only batch of n sequences runs in the
graph of the smallest captured batch size b >= n whose width covers its longest sequence:

- rows n..b-1 are padding: token 0 at position 0, writing its K/V into the runner's padding
  block (a KV block the block manager never hands out) and attending to that one key;
- the block table is widened to the graph's width with the padding block; attention reads only
  the first seq_len positions of each row, so the extra columns are never read.

Why this keeps batch invariance: in batch_invariant mode every row's bits depend only on that
row (matmul, norms and attention are row-invariant), so padding rows and a wider block table
change nothing in the real rows; tests/worker/test_gpu_engine.py checks graph against eager
bitwise. In default mode the padded batch size is one more thing that moves the numbers.

Every graph reads its inputs from the same static buffers and shares one memory pool; graphs
are captured lazily on first use (or all at once by `capture_all`) and replayed one at a time.
"""

from __future__ import annotations

import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from detgate.worker.model.attention_metadata import AttentionMetadata
from detgate.worker.model.ops import KVCache

log = logging.getLogger(__name__)
T = TypeVar("T")

# Context widths, in tokens, that graphs are captured for; a longer context runs eagerly.
WIDTHS = (256, 512, 1024, 2048, 4096)
# Widths up to which a worker's warm-up (ModelRunner.warm_up) captures every graph before it
# serves: decode steps up to 1,024 tokens of context, mixed steps up to 256 (a mixed step's
# graphs are per token bucket, 64 of them at 8,192 tokens a step, so each width costs more).
WARM_DECODE_WIDTH, WARM_MIXED_WIDTH = 1024, 256


def graph_batch_sizes(max_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to max_seqs (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_seqs] + list(range(16, max_seqs, 16))
    return [*sizes, max_seqs]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly on the static buffers (capture off)
    out: torch.Tensor | None  # the captured run's output, [size, H]


class _StepGraphs(ABC):
    """What both kinds of graphs share: one graph per (size, context width), captured from the
    static buffers on first use (or all at once by `capture_all`) and replayed after the
    subclass has loaded a step into those buffers. A failed capture makes every later step of
    this kind run eagerly. Subclasses give `sizes`, `_run` (one forward from the buffers,
    returning the output) and `_load_dummy` (capture inputs outside a step)."""

    kind: str
    sizes: list[int]

    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], *, block_size: int,
                 max_model_len: int, padding_block: int, capture: bool, pool):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.padding_block = padding_block
        self.capture = capture
        self.widths = _widths(max_model_len, block_size)
        self.device = kv_caches[0][0].device
        self.pool = pool if pool is not None else (
            torch.cuda.graph_pool_handle() if capture else None)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.failed = False
        self.capture_seconds = 0.0

    def _buffer(self, size, dtype: torch.dtype, fill=0) -> torch.Tensor:
        return torch.full(size, fill, dtype=dtype, device=self.device)

    def _replay(self, size: int, width: int, rows: int) -> torch.Tensor | None:
        """The first `rows` of the output of the (size, width) graph, run on the buffers as
        loaded; captured first if new. None when the capture failed."""
        graph = self.graphs.get((size, width)) or self._try_capture(size, width)
        if graph is None:
            return None
        if graph.graph is None:
            return self._run(size, width)[:rows]
        graph.graph.replay()
        return graph.out[:rows]

    @torch.inference_mode()
    def capture_all(self, max_seq_len: int) -> int:
        """Capture every size at the widths up to the one covering max_seq_len, largest first
        (smaller graphs then reuse the pool's memory). Returns the number of graphs."""
        for width in widths_covering(self.widths, max_seq_len):
            for size in reversed(self.sizes):
                if (size, width) not in self.graphs and not self.failed \
                        and self._load_dummy(size, width):
                    self._try_capture(size, width)
        return len(self.graphs)

    @abstractmethod
    def _run(self, size: int, width: int) -> torch.Tensor:
        """One forward of the first `size` rows of the buffers at `width`; its output."""

    @abstractmethod
    def _load_dummy(self, size: int, width: int) -> bool:
        """Inputs for capturing (size, width) outside a step; False if it cannot be."""

    def _try_capture(self, size: int, width: int) -> _Graph | None:
        try:
            return self._capture(size, width)
        except RuntimeError:  # an op that cannot be captured: run eagerly from now on
            log.exception("CUDA graph capture failed (%s step, size %d, width %d); running "
                          "them eagerly", self.kind, size, width)
            self.failed = True
            return None

    def _capture(self, size: int, width: int) -> _Graph:
        start = time.perf_counter()
        # The warm-up run computes exactly what the replay will: the same inputs, and the real
        # rows' K/V rewritten with the same bits (padding rows touch only the padding block).
        graph, out = (capture_graph(lambda: self._run(size, width), self.pool) if self.capture
                      else (None, None))
        entry = self.graphs[(size, width)] = _Graph(graph, out)
        self.capture_seconds += time.perf_counter() - start
        return entry


class DecodeGraphs(_StepGraphs):
    kind = "decode"

    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], *, max_seqs: int,
                 block_size: int, max_model_len: int, padding_block: int, capture: bool = True,
                 pool=None):
        super().__init__(model, kv_caches, block_size=block_size, max_model_len=max_model_len,
                         padding_block=padding_block, capture=capture, pool=pool)
        self.sizes = self.batch_sizes = graph_batch_sizes(max_seqs)
        n, buf = max_seqs, self._buffer
        self.input_ids = buf((n,), torch.int64)
        self.positions = buf((n,), torch.int64)
        self.slot_mapping = buf((n,), torch.int64, padding_block * block_size)
        self.seq_lens = buf((n,), torch.int32, 1)
        # Decode: sequence i's one query is token i.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=self.device)
        # One contiguous table per width, so each graph reads a contiguous [b, width] prefix.
        self.block_tables = {w: buf((n, w // block_size), torch.int32, padding_block)
                             for w in self.widths}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor | None:
        """hidden [n, H] of a decode-only batch (max_query_len == 1), or None when no graph
        fits (more sequences than the largest size, or a context wider than every width)."""
        n = input_ids.shape[0]
        if self.failed:
            return None
        b = next((s for s in self.batch_sizes if s >= n), None)
        width = next((w for w in self.widths if w >= meta.max_seq_len), None)
        if b is None or width is None or meta.max_query_len != 1:
            return None
        self._load(input_ids, positions, meta, n, b, width)
        return self._replay(b, width, n)

    # -- internals -------------------------------------------------------------------------

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              n: int, b: int, width: int) -> None:
        """Copy the real rows into the static buffers and make rows n..b-1 padding."""
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        table = self.block_tables[width]
        cols = meta.block_tables.shape[1]
        table[:n, :cols].copy_(meta.block_tables)
        table[:n, cols:].fill_(self.padding_block)
        self._reset_padding(b, width, start=n)

    def _load_dummy(self, b: int, width: int) -> bool:
        self._reset_padding(b, width)
        return True

    def _reset_padding(self, b: int, width: int, start: int = 0) -> None:
        if start >= b:
            return
        self.input_ids[start:b].fill_(0)
        self.positions[start:b].fill_(0)
        self.slot_mapping[start:b].fill_(self.padding_block * self.block_size)
        self.seq_lens[start:b].fill_(1)
        self.block_tables[width][start:b].fill_(self.padding_block)

    def _run(self, b: int, width: int) -> torch.Tensor:
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[:b + 1], seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[width][:b], slot_mapping=self.slot_mapping[:b],
            max_query_len=1, max_seq_len=width)
        return self.model(self.input_ids[:b], self.positions[:b], meta, self.kv_caches)


# -- steps that mix prefill chunks and decodes ---------------------------------------------

def token_buckets(max_tokens: int, step: int = 128) -> list[int]:
    """Scheduled-token counts that mixed-step graphs are captured for: 16, 32, 64, then every
    multiple of `step`, up to max_tokens (always included). A step of t tokens runs in the
    smallest bucket >= t, so it carries fewer than `step` padding tokens: at most one more
    row of matmul tiles. Its matmuls run at M = the bucket, whose tile choice is the one tuned
    for that size (kernels/matmul_triton.py TUNED_16BIT: above 256 rows its buckets end at
    multiples of 128), so a tune of the mixed steps times those sizes."""
    sizes = [t for t in (16, 32, 64, 128) if t < min(step, max_tokens)]
    sizes += list(range(step, max_tokens, step))
    return sorted({*sizes, max_tokens})


class MixedGraphs(_StepGraphs):
    """Whole-model graphs for steps that mix prefill chunks and decodes, one per (bucket of
    scheduled tokens, context width).

    A step of n sequences and t tokens runs in the graph of the smallest token bucket T >= t
    (token_buckets) whose width covers its longest sequence. The graph always has S =
    max_seqs + 1 sequences, so the number of sequences is no part of its key:

    - sequences 0..n-1 are the step's own (their tokens 0..t-1, their seq_lens and block
      tables, widened with the padding block, exactly as the eager step has them);
    - sequences n..S-2 are empty: no query, seq_len 0; the attention kernels give an empty
      sequence's programs nothing to do (their first query is past its length) and no token;
    - sequence S-1 is the padding sequence: it owns the P = T - t padding tokens (token 0,
      positions 0..P-1), its K/V go to the padding block (a KV block the block manager never
      hands out) and its block table row is all padding block, so it reads nothing else. The
      padding tokens attend causally among themselves (P < the bucket step, 128 tokens at
      most, so their cost is small), giving finite values in rows that are then dropped.

    The hidden states are copied, inside the graph, into one output buffer shared by every
    mixed graph, so a graph holds no output memory of its own; logits and sampling run eagerly
    after the replay, as before.

    Why the real rows' bits do not change (batch_invariant mode): every reducing op there is
    row-invariant. The matmul's result for a row depends only on that row and the weights: its
    tile choice may follow M (here the bucket T instead of t), but the reduction over K is one
    fixed order per output element whatever the tile (kernels/matmul_triton.py); RMSNorm is
    one program per row (kernels/rmsnorm_triton.py); log_softmax runs eagerly on the real rows
    only; the pointwise ops (rotary, silu, residual adds, embedding gathers) touch one element
    at a time.
    Paged attention reduces a query over its own sequence's keys in one order set by its
    position alone, whatever the other queries and sequences of the call, and whichever of its
    two launch shapes runs (kernels/attention_triton.py); the padding and empty sequences
    read and write only the padding block, which no real sequence reads (a real row reads only
    its first seq_len positions through its own table). So padding tokens, empty sequences, a
    larger M and a wider block table leave every real row's bits as in the eager step:
    tests/worker/test_cuda_graphs.py checks this on the CPU through the same static-buffer path
    run eagerly (capture=False), tests/worker/test_gpu_engine.py checks captured against eager
    on CUDA, bitwise. In default mode cuBLAS may pick another reduction for another M, so
    there the padding is one more thing that moves the numbers.
    """

    kind = "mixed"

    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], *, max_seqs: int,
                 max_tokens: int, block_size: int, max_model_len: int, padding_block: int,
                 hidden_size: int, dtype: torch.dtype, capture: bool = True, pool=None):
        super().__init__(model, kv_caches, block_size=block_size, max_model_len=max_model_len,
                         padding_block=padding_block, capture=capture, pool=pool)
        # Padding tokens must fit the padding sequence's table row: fewer than a width.
        self.sizes = self.buckets = token_buckets(max_tokens, step=min(128, self.widths[0]))
        self.num_seqs = max_seqs + 1  # the last one is the padding sequence
        s, n, buf = self.num_seqs, max_tokens, self._buffer
        self.input_ids = buf((n,), torch.int64)
        self.positions = buf((n,), torch.int64)
        self.slot_mapping = buf((n,), torch.int64, padding_block * block_size)
        self.query_start_loc = buf((s + 1,), torch.int32)
        self.seq_lens = buf((s,), torch.int32)
        self.block_tables = {w: buf((s, w // block_size), torch.int32, padding_block)
                             for w in self.widths}
        # Padding token j: position j, slot j % block_size of the padding block.
        self.pad_positions = torch.arange(n, dtype=torch.int64, device=self.device)
        self.pad_slots = padding_block * block_size + self.pad_positions % block_size
        self.out = torch.empty((n, hidden_size), dtype=dtype, device=self.device)

    def bucket(self, num_tokens: int, num_seqs: int, max_seq_len: int) -> tuple[int, int] | None:
        """(token bucket, width) a step runs in, or None: it runs eagerly."""
        if self.failed or num_seqs > self.num_seqs - 1:
            return None
        width = next((w for w in self.widths if w >= max_seq_len), None)
        tokens = next((t for t in self.buckets if t >= num_tokens), None)
        if width is None or tokens is None or tokens - num_tokens > width:
            return None
        return tokens, width

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor | None:
        """hidden [t, H] of the step, or None when no graph fits (run it eagerly)."""
        t, n = input_ids.shape[0], meta.num_seqs
        key = self.bucket(t, n, meta.max_seq_len)
        if key is None:
            return None
        tokens, width = key
        self._load(input_ids, positions, meta, tokens, width)
        return self._replay(tokens, width, t)

    # -- internals -------------------------------------------------------------------------

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              tokens: int, width: int) -> None:
        """The step's rows into the static buffers; the rest made empty and padding."""
        t, n = input_ids.shape[0], meta.num_seqs
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.query_start_loc[:n + 1].copy_(meta.query_start_loc)
        self.seq_lens[:n].copy_(meta.seq_lens)
        table = self.block_tables[width]
        # A prefill chunk's table holds blocks for its whole prompt: only the first
        # width / block_size can be read (seq_len <= width).
        cols = min(meta.block_tables.shape[1], table.shape[1])
        table[:n, :cols].copy_(meta.block_tables[:, :cols])
        table[:n, cols:].fill_(self.padding_block)
        table[n:].fill_(self.padding_block)
        self._pad(t, n, tokens)

    def _pad(self, t: int, n: int, tokens: int) -> None:
        """Tokens t..tokens-1 to the padding sequence S-1; sequences n..S-2 empty."""
        s, p = self.num_seqs, tokens - t
        self.input_ids[t:tokens].fill_(0)
        self.positions[t:tokens].copy_(self.pad_positions[:p])
        self.slot_mapping[t:tokens].copy_(self.pad_slots[:p])
        self.query_start_loc[n + 1:s].fill_(t)
        self.query_start_loc[s:].fill_(tokens)
        self.seq_lens[n:s - 1].fill_(0)
        self.seq_lens[s - 1:].fill_(p)

    def _load_dummy(self, tokens: int, width: int) -> bool:
        """Inputs for capturing outside a step: the tokens cut into sequences of at most
        `width` tokens, all reading and writing only the padding block."""
        n = -(-tokens // width)
        if n > self.num_seqs - 1:
            return False
        per = -(-tokens // n)
        lens = [x for x in (min(per, tokens - i * per) for i in range(n)) if x > 0]
        t, n = sum(lens), len(lens)
        self.input_ids[:t].fill_(0)
        self.positions[:t].copy_(torch.cat([self.pad_positions[:x] for x in lens]))
        self.slot_mapping[:t].copy_(torch.cat([self.pad_slots[:x] for x in lens]))
        qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
        self.query_start_loc[:n + 1].copy_(qsl)
        self.seq_lens[:n].copy_(torch.tensor(lens, dtype=torch.int32))
        self.block_tables[width].fill_(self.padding_block)
        self._pad(t, n, tokens)
        return True

    def _run(self, tokens: int, width: int) -> torch.Tensor:
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            block_tables=self.block_tables[width], slot_mapping=self.slot_mapping[:tokens],
            max_query_len=tokens, max_seq_len=width)
        hidden = self.model(self.input_ids[:tokens], self.positions[:tokens], meta,
                            self.kv_caches)
        return self.out[:tokens].copy_(hidden)


def capture_graph(run: Callable[[], T], pool) -> tuple[torch.cuda.CUDAGraph, T]:
    """`run` captured into a graph in `pool`, and what the captured run returned. One eager
    run on a side stream first, so that Triton compiles and cuBLAS picks its kernels outside
    the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return graph, out


def widths_covering(widths: list[int], max_seq_len: int) -> list[int]:
    """The widths below max_seq_len and the first one that covers it."""
    return [w for w in widths if w < max_seq_len] + [w for w in widths if w >= max_seq_len][:1]


def _widths(max_model_len: int, block_size: int) -> list[int]:
    widths = [w for w in WIDTHS if w < max_model_len] + [min(WIDTHS[-1], max_model_len)]
    return sorted({-(-w // block_size) * block_size for w in widths})
