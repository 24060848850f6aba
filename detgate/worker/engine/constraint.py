"""Token masks: which tokens a sequence may take next (a grammar, min_tokens), as one bitmask row.

A request's `Constraint` is built once (the compiled grammar is shared by its n choices); each
sequence gets its own `ConstraintState`, which has seen exactly the sequence's own generated
tokens. The mask of a row is therefore a function of that sequence's tokens alone, never of
the batch. It is applied to the logits row before anything else reads them (sampling, the
chosen token's logprob, top-k, rank), as vLLM applies its grammar bitmask: a constrained
request's logprobs are those of the masked distribution, the one its tokens are drawn from.
Applying is elementwise: an allowed logit keeps its bits, a disallowed one becomes -inf, row
by row; so masking cannot make a row depend on its neighbours (tests/worker/test_structured*).

Bitmask layout (xgrammar's, llguidance's and vLLM's): int32 words [rows, ceil(V / 32)], bit j
of word i set = token 32 i + j allowed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

log = logging.getLogger(__name__)

_SHIFTS = torch.arange(32, dtype=torch.int32)


class Matcher(Protocol):
    """A grammar's state over one sequence (xgrammar's GrammarMatcher)."""

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> bool: ...
    def accept_token(self, token_id: int) -> bool: ...
    def is_terminated(self) -> bool: ...


class Grammar(Protocol):
    def matcher(self) -> Matcher: ...


def mask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


@dataclass(frozen=True, eq=False)
class Constraint:
    """What limits a request's tokens: a grammar over its generated text, and min_tokens (the
    stop tokens are banned until that many tokens are generated, as in vLLM)."""

    grammar: Grammar | None = None
    min_tokens: int = 0
    stop_ids: tuple[int, ...] = ()  # banned while fewer than min_tokens are generated

    def state(self) -> ConstraintState:
        return ConstraintState(self, self.grammar.matcher() if self.grammar else None)


@dataclass(slots=True)
class ConstraintState:
    constraint: Constraint
    matcher: Matcher | None
    num_accepted: int = 0
    rejected: bool = field(default=False)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the next token's mask into bitmask[row] (int32 [R, W], all ones on entry)."""
        if self.matcher is not None:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        c = self.constraint
        if self.num_accepted < c.min_tokens and c.stop_ids:
            words = bitmask[row].numpy().view(np.uint32)
            kept = words.copy()
            for t in c.stop_ids:
                words[t // 32] &= np.uint32(~(1 << (t % 32)) & 0xFFFFFFFF)
            # A grammar that allows only a stop token here wins over min_tokens: a row with
            # nothing allowed has no distribution to draw from.
            if not words.any():
                words[:] = kept

    def accept(self, token_id: int) -> None:
        self.num_accepted += 1
        if self.matcher is not None and not self.matcher.accept_token(token_id):
            # Cannot happen for a token drawn under this state's own mask.
            log.error("grammar rejected token %d", token_id)
            self.rejected = True

    @property
    def finished(self) -> bool:
        """The grammar has ended (its stop token accepted), or it broke."""
        return self.rejected or (self.matcher is not None and self.matcher.is_terminated())


def fill_masks(rows: Seq[tuple[ConstraintState, Seq[int]]], words: int) -> torch.Tensor:
    """Bitmask [len(rows), words] int32: row i is rows[i]'s state after it also accepts the
    tokens listed with it (teacher forcing: a scored continuation); a state with tokens to
    force is a fresh one and is advanced in place."""
    bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
    for i, (state, forced) in enumerate(rows):
        for t in forced:
            state.accept(t)
        state.fill(bitmask, i)
    return bitmask


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [R, V] (any float dtype, any device); rows [M] int64 logits rows; bitmask
    [M, W] int32 on the host. Sets logits[rows[i], t] = -inf where bit t of bitmask[i] is 0;
    every other element is left as it was (an elementwise select, so no row's bits depend on
    another's)."""
    vocab = logits.shape[1]
    allowed = ((bitmask.unsqueeze(-1) >> _SHIFTS) & 1).view(bitmask.shape[0], -1).bool()
    if allowed.shape[1] < vocab:  # padded vocabulary rows past the tokenizer's: never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    allowed = allowed[:, :vocab].to(logits.device, non_blocking=True)
    sub = logits[rows]
    logits[rows] = sub.masked_fill(~allowed, float("-inf"))
