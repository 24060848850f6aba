"""AttentionMetadata: where each sequence's queries sit in a batch and where its K/V live."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """One forward step over B sequences whose T new tokens are concatenated.

    Sequence i owns tokens query_start_loc[i]:query_start_loc[i+1]; they are its LAST positions,
    so its query j sits at position seq_lens[i] - qlen_i + j. All tensors live on the model's
    device.
    """

    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32: cached + new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 or -1
    # [T] int64: block_id * block_size + offset, all >= 0 (padding rows get a padding block)
    slot_mapping: torch.Tensor
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
