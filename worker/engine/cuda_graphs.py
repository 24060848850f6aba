"""Decode steps replayed from CUDA graphs, captured at a fixed set of batch sizes.

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

import logging
from dataclasses import dataclass

import torch

from worker.engine.attention_metadata import AttentionMetadata
from worker.model.ops import KVCache

log = logging.getLogger(__name__)

# Context widths, in tokens, that graphs are captured for; a longer context runs eagerly.
WIDTHS = (256, 512, 1024, 2048, 4096)


def graph_batch_sizes(max_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to max_seqs (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_seqs] + list(range(16, max_seqs, 16))
    return [*sizes, max_seqs]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly on the static buffers (CPU)
    hidden: torch.Tensor | None  # [b, H], the captured output


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list[KVCache], *, max_seqs: int,
                 block_size: int, max_model_len: int, padding_block: int, capture: bool = True):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.padding_block = padding_block
        self.capture = capture
        self.batch_sizes = graph_batch_sizes(max_seqs)
        self.widths = [w for w in WIDTHS if w < max_model_len] + [min(WIDTHS[-1], max_model_len)]
        self.widths = sorted({-(-w // block_size) * block_size for w in self.widths})
        device = kv_caches[0][0].device
        n = max_seqs

        def buf(size, dtype, fill=0):
            return torch.full(size, fill, dtype=dtype, device=device)

        self.input_ids = buf((n,), torch.int64)
        self.positions = buf((n,), torch.int64)
        self.slot_mapping = buf((n,), torch.int64, padding_block * block_size)
        self.seq_lens = buf((n,), torch.int32, 1)
        # Decode: sequence i's one query is token i.
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        # One contiguous table per width, so each graph reads a contiguous [b, width] prefix.
        self.block_tables = {w: buf((n, w // block_size), torch.int32, padding_block)
                             for w in self.widths}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.failed = False  # a capture failed: every step runs eagerly

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
        graph = self.graphs.get((b, width)) or self._try_capture(b, width)
        if graph is None:
            return None
        if graph.graph is None:
            return self._run(b, width)[:n]
        graph.graph.replay()
        return graph.hidden[:n]

    @torch.inference_mode()
    def capture_all(self, max_seq_len: int) -> int:
        """Capture every batch size at the widths up to the one covering max_seq_len, largest
        first (smaller graphs then reuse the pool's memory). Returns the number of graphs."""
        widths = [w for w in self.widths if w < max_seq_len]
        widths += [w for w in self.widths if w >= max_seq_len][:1]
        for width in widths:
            for b in reversed(self.batch_sizes):
                if (b, width) not in self.graphs and not self.failed:
                    self._reset_padding(b, width)
                    self._try_capture(b, width)
        return len(self.graphs)

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

    def _try_capture(self, b: int, width: int) -> _Graph | None:
        try:
            return self._capture(b, width)
        except RuntimeError:  # an op that cannot be captured: run eagerly from now on
            log.exception("CUDA graph capture failed (batch %d, width %d); running eagerly",
                          b, width)
            self.failed = True
            return None

    def _capture(self, b: int, width: int) -> _Graph:
        if not self.capture:
            graph = self.graphs[(b, width)] = _Graph(None, None)
            return graph
        # One eager run on a side stream first: Triton compiles and cuBLAS picks its kernels
        # outside the capture. Padding rows only touch the padding block, and the real rows
        # already loaded are recomputed identically (their K/V rewritten with the same bits).
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._run(b, width)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self._run(b, width)
        entry = self.graphs[(b, width)] = _Graph(graph, hidden)
        return entry
