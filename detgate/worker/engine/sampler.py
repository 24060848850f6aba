"""Next-token choice and logprobs, from the logits of the rows that sample (in the model's
dtype; every use below widens them to fp32 first, which is exact).

Invariant: a sequence's token and logprobs depend only on its own logits row and its own
seeded generator, never on its batch neighbours. Greedy is an argmax (exact). Sampled rows are
processed one row at a time (the same shapes whatever the batch), with one torch.Generator per
request seeded from the request's seed. Logprobs come from the log_softmax of the raw logits
(before temperature, top-k, top-p), through the mode's log_softmax, which is row-invariant in
batch_invariant mode; sampled rows draw from the mode's softmax (the CPU kernels' in
batch_invariant mode: the same bits on every CPU).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

import torch

from detgate.worker.engine.sequence import Sequence


@dataclass
class LogprobTensors:
    """Logprobs of R rows, on the device: chosen [R], top values/ids [R, k], rank [R] or None."""

    chosen: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor
    rank: torch.Tensor | None


class Sampler:
    def __init__(self, log_softmax: Callable[[torch.Tensor], torch.Tensor],
                 softmax: Callable[[torch.Tensor], torch.Tensor], device: torch.device):
        self.log_softmax = log_softmax
        self.softmax = softmax
        self.device = device

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits: [S, V], row i for seqs[i] -> token ids [S] int64 (on the device)."""
        token_ids = logits.argmax(dim=-1)  # widening keeps order and ties: no copy needed
        for i, seq in enumerate(seqs):
            if not seq.params.greedy:
                token_ids[i] = self._sample_row(logits[i], seq)
        return token_ids

    def logprobs(self, logits: torch.Tensor, chosen: torch.Tensor, num_top: int,
                 with_rank: bool) -> LogprobTensors:
        """logits: [R, V]; chosen: [R] int64 -> the chosen tokens' logprobs, top-k, ranks."""
        logprobs = self.log_softmax(logits)  # [R, V] fp32, computed from the widened logits
        chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1)
        top = logprobs.topk(num_top, dim=-1) if num_top else None
        empty = logprobs.new_empty(len(chosen), 0)
        return LogprobTensors(
            chosen=chosen_lp,
            top_values=top.values if top is not None else empty,
            top_ids=top.indices if top is not None else empty.long(),
            rank=(logprobs > chosen_lp[:, None]).sum(dim=-1) + 1 if with_rank else None,
        )

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.generator is None:
            seed = seq.params.seed if seq.params.seed is not None else secrets.randbits(63)
            seq.generator = torch.Generator(device=self.device).manual_seed(seed & (2**64 - 1))
        return seq.generator

    def _sample_row(self, logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """logits: [V] -> a 0-dim token id drawn with the sequence's generator."""
        params = seq.params
        x = logits.float() / params.temperature
        if 0 < params.top_k < x.numel():
            kth = torch.topk(x, params.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = self.softmax(x)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True, stable=True)
            # Drop a token once the mass of the tokens ranked above it already reaches top_p.
            drop_sorted = (sorted_probs.cumsum(0) - sorted_probs) >= params.top_p
            # The most likely token always stays, however small top_p is (1e-300 is 0 in fp32,
            # which would otherwise drop every token and make the draw an argmax over zeros).
            drop_sorted[0] = False
            drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p (unnormalised is fine).
        noise = torch.empty_like(probs).exponential_(generator=self._generator(seq))
        return (probs / noise).argmax()
