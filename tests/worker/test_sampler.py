"""Sampler: greedy, seeded sampling independent of batch neighbours, filters, logprobs."""

from __future__ import annotations

import torch

from detgate.kernels.bits import same_bits
from detgate.worker.engine.sampler import Sampler
from detgate.worker.engine.sequence import SamplingParams, Sequence
from detgate.worker.model.ops import make_ops

V = 1000


def sampler(mode="default") -> Sampler:
    ops = make_ops(mode)
    return Sampler(ops.log_softmax, ops.softmax, torch.device("cpu"))


def seq(rid="r", **params) -> Sequence:
    return Sequence(rid, [1, 2, 3], SamplingParams(**params))


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def draw(s: Sampler, x: torch.Tensor, seqs: list[Sequence], steps: int) -> list[list[int]]:
    return [s.sample(x, seqs).tolist() for _ in range(steps)]


def test_greedy_is_argmax():
    x = logits(4)
    assert sampler().sample(x, [seq() for _ in range(4)]).tolist() == x.argmax(-1).tolist()


def test_seeded_sampling_repeats_and_ignores_batch_neighbours():
    x = logits(5)
    alone = [row[0] for row in draw(sampler(), x[2:3], [seq(temperature=1.0, seed=42)], 20)]
    neighbours = [seq(str(i), temperature=0.7, seed=i) for i in range(4)]
    batch = [seq("n", temperature=1.0, seed=42)]
    in_batch = [row[2] for row in draw(sampler(), x, neighbours[:2] + batch + neighbours[2:], 20)]
    assert alone == in_batch
    assert len(set(alone)) > 1  # it really samples


def test_different_seeds_differ():
    x = logits(1)
    a = draw(sampler(), x, [seq(temperature=1.0, seed=1)], 20)
    b = draw(sampler(), x, [seq(temperature=1.0, seed=2)], 20)
    assert a != b


def test_top_k_1_and_tiny_top_p_are_greedy():
    x = logits(3)
    argmax = x.argmax(-1).tolist()
    for params in ({"top_k": 1}, {"top_p": 1e-6}):
        seqs = [seq(str(i), temperature=1.0, seed=i, **params) for i in range(3)]
        assert all(row == argmax for row in draw(sampler(), x, seqs, 10))


def test_top_k_keeps_samples_within_the_k_best():
    x = logits(1)
    best = set(x[0].topk(5).indices.tolist())
    picks = {row[0] for row in draw(sampler(), x, [seq(temperature=5.0, seed=3, top_k=5)], 50)}
    assert picks <= best and len(picks) > 1


def test_logprobs_chosen_top_and_rank():
    x = logits(3)
    chosen = torch.tensor([5, x[1].argmax().item(), 7])
    lp = sampler().logprobs(x, chosen, 4, with_rank=True)
    ref = torch.log_softmax(x, -1)
    torch.testing.assert_close(lp.chosen, ref.gather(1, chosen[:, None]).squeeze(1))
    assert lp.top_ids.tolist() == ref.topk(4).indices.tolist()
    assert lp.top_values.dtype == torch.float32
    assert lp.rank.tolist() == [int((ref[i] > ref[i, chosen[i]]).sum()) + 1 for i in range(3)]
    assert lp.rank[1] == 1


def test_batch_invariant_logprobs_do_not_depend_on_the_batch():
    x = logits(32, seed=5)
    chosen = x.argmax(-1)
    s = sampler("batch_invariant")
    full = s.logprobs(x, chosen, 5, with_rank=False)
    for m in (1, 2, 3, 7, 17):
        part = s.logprobs(x[:m], chosen[:m], 5, with_rank=False)
        assert same_bits(part.chosen, full.chosen[:m])
        assert same_bits(part.top_values, full.top_values[:m])


def test_no_top_logprobs_when_k_is_zero():
    x = logits(2)
    lp = sampler().logprobs(x, x.argmax(-1), 0, with_rank=False)
    assert lp.top_ids.shape == (2, 0) and lp.rank is None


def test_bf16_logits_choose_as_their_fp32_copy_does():
    # A bf16 model's compute_logits hands its logits over unwidened: greedy and seeded draws
    # must pick what the fp32 copy picks, and the CPU kernels widen before they reduce.
    x = logits(6, seed=9).bfloat16()

    def seqs() -> list[Sequence]:
        return [seq(str(i), temperature=0.8, seed=i, top_k=50 * i, top_p=0.9) if i % 2
                else seq(str(i)) for i in range(6)]

    assert draw(sampler(), x, seqs(), 10) == draw(sampler(), x.float(), seqs(), 10)
    s = sampler("batch_invariant")
    chosen = x.float().argmax(-1)
    a = s.logprobs(x, chosen, 5, with_rank=True)
    b = s.logprobs(x.float(), chosen, 5, with_rank=True)
    assert same_bits(a.chosen, b.chosen) and same_bits(a.top_values, b.top_values)
    assert a.top_ids.tolist() == b.top_ids.tolist() and a.rank.tolist() == b.rank.tolist()
