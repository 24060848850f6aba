"""A training batch as the trainer computes it: sequences packed end to end, each from position 0.

Both layouts the API takes become one `Packed` batch: right-padded `[B, T]` ids with an
attention mask (each row's ones first, then only zeros), and varlen ids `[N]` with cumulative
lengths `cu_seqlens [B + 1]` (0 first, N last). Padding is dropped, so a padded and a packed
batch of the same sequences are the same computation row for row.

`attention_inputs` lays the batch's K/V out as the engine's paged cache does (each sequence in
blocks of its own, its positions in order), for the worker's attention code to read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from detgate.worker.model.attention_metadata import AttentionMetadata

# Slots per block of the training batch's cache. Any valid block size gives the same bits: both
# attention kernels read a sequence's keys by position through its block table (see
# kernels/attention.py), so the size only decides where the rows are stored.
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Packed:
    """B sequences concatenated: sequence i is input_ids[cu_seqlens[i]:cu_seqlens[i + 1]]."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64: each token's position in its sequence
    seq_of: torch.Tensor  # [N] int64: each token's sequence
    lens: tuple[int, ...]  # [B] sequence lengths, each >= 1
    # attention_inputs, made once per (Hkv, D, dtype)
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def cu_seqlens(self) -> list[int]:
        out = [0]
        for n in self.lens:
            out.append(out[-1] + n)
        return out

    def targets(self, start: list[int] | None = None) -> torch.Tensor:
        """Indices into input_ids of the tokens to score: positions max(1, start[i]) .. end of
        each sequence (position 0 has no context to be predicted from)."""
        cu = self.cu_seqlens
        first = [1] * len(self.lens) if start is None else [max(1, s) for s in start]
        return torch.cat([torch.arange(cu[i] + f, cu[i + 1], dtype=torch.int64)
                          for i, f in enumerate(first)]).to(self.input_ids.device)

    def attention_inputs(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype
                         ) -> tuple[AttentionMetadata, tuple[torch.Tensor, torch.Tensor]]:
        """The batch as one engine step that prefills every sequence whole, and a cache
        [blocks, BLOCK_SIZE, Hkv, D] for it. One cache serves every layer and every forward of
        the batch: a layer's attention stores all the batch's K/V before it reads any (no key
        is read that this layer did not write), and the backward pass never reads it."""
        key = (num_kv_heads, head_dim, dtype)
        if key not in self._memo:
            self._memo[key] = self._attention_inputs(num_kv_heads, head_dim, dtype)
        return self._memo[key]

    def _attention_inputs(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype
                          ) -> tuple[AttentionMetadata, tuple[torch.Tensor, torch.Tensor]]:
        device = self.input_ids.device
        blocks = [-(-n // BLOCK_SIZE) for n in self.lens]
        first_block = torch.tensor([0, *blocks[:-1]], dtype=torch.int64).cumsum(0)
        width = max(blocks)
        tables = first_block[:, None] + torch.arange(width)[None, :]
        tables = torch.where(torch.arange(width)[None, :] < torch.tensor(blocks)[:, None],
                             tables, -1)
        lens = torch.tensor(self.lens, dtype=torch.int32)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(self.cu_seqlens, dtype=torch.int32, device=device),
            seq_lens=lens.to(device),
            block_tables=tables.to(device=device, dtype=torch.int32),
            # every slot >= 0: the engine's contract (no padding rows here)
            slot_mapping=first_block.to(device)[self.seq_of] * BLOCK_SIZE + self.positions,
            max_query_len=max(self.lens),
            max_seq_len=max(self.lens),
        )
        # Zeros, not empty: a Triton tile loads key rows past a query's position (masked out
        # of its scores, but 0 * NaN in the value sum would not be 0).
        shape = (sum(blocks), BLOCK_SIZE, num_kv_heads, head_dim)
        cache = (torch.zeros(shape, dtype=dtype, device=device),
                 torch.zeros(shape, dtype=dtype, device=device))
        return meta, cache


def pack(input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
         cu_seqlens: torch.Tensor | list[int] | None = None, device: torch.device,
         vocab_size: int, max_len: int) -> Packed:
    """The Packed batch of right-padded ids [B, T] + mask [B, T], or of ids [N] + cu_seqlens."""
    if (attention_mask is None) == (cu_seqlens is None):
        raise ValueError("give exactly one of attention_mask ([B, T] ids) and cu_seqlens "
                         "([N] ids)")
    ids = torch.as_tensor(input_ids)
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be integer token ids, got {ids.dtype}")
    if attention_mask is not None:
        ids, lens = _unpad(ids, torch.as_tensor(attention_mask))
    else:
        lens = _lengths(ids, cu_seqlens)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"token ids must lie in [0, {vocab_size})")
    if max(lens) > max_len:
        raise ValueError(f"a sequence of {max(lens)} tokens is longer than the model's "
                         f"{max_len} positions")
    counts = torch.tensor(lens)
    seq_of = torch.repeat_interleave(torch.arange(len(lens)), counts)
    starts = torch.cumsum(counts, 0) - counts
    positions = torch.arange(int(counts.sum())) - starts[seq_of]
    return Packed(ids.to(device=device, dtype=torch.int64), positions.to(device),
                  seq_of.to(device), tuple(lens))


def _unpad(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    if ids.dim() != 2 or mask.shape != ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} must have the shape of the "
                         f"[B, T] input_ids {tuple(ids.shape)}")
    mask = mask.to(device="cpu", dtype=torch.int64)
    if ((mask != 0) & (mask != 1)).any():
        raise ValueError("attention_mask must hold only 0 and 1")
    lens = mask.sum(1)
    expected = torch.arange(mask.shape[1])[None, :] < lens[:, None]
    if not torch.equal(mask.bool(), expected):
        raise ValueError("attention_mask must be right-padded: each row's ones, then zeros")
    if (lens == 0).any():
        raise ValueError("every sequence needs at least one token (a row of the mask is 0)")
    return ids.to("cpu")[expected], lens.tolist()


def _lengths(ids: torch.Tensor, cu_seqlens: torch.Tensor | list[int]) -> list[int]:
    if ids.dim() != 1:
        raise ValueError(f"with cu_seqlens, input_ids must be [N], got {tuple(ids.shape)}")
    cu = [int(c) for c in torch.as_tensor(cu_seqlens).reshape(-1).tolist()]
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != ids.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to N = {ids.shape[0]}, got {cu[:1]}.."
                         f"{cu[-1:]} ({len(cu)} entries)")
    lens = [b - a for a, b in zip(cu, cu[1:], strict=False)]
    if min(lens) < 1:
        raise ValueError("cu_seqlens must increase strictly: every sequence needs a token")
    return lens
