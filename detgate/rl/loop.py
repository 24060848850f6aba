"""The RL loop: rollouts -> trainer logprobs of the sampled tokens -> policy gradient step ->
new weights on every worker -> next step.

The objective is GRPO's without its importance ratio and without a KL penalty: for each group
of rollouts of one problem, advantage A_i = (r_i - mean) / std of the group's rewards, and

    loss = - mean over groups of  mean over the group's rollouts of  A_i * mean_t log p(o_i,t)

with log p the trainer's, computed in one differentiable pass over every rollout of the step.
Dropping the ratio pi_theta / pi_sampler is exact only when the two are the same numbers: that
is what the step measures before it trains, per sampled token, by the contract's
`compare_to_teacher` (bit patterns, the KL(sampler || trainer) estimate, max |difference|).

Every rollout must have been sampled on the weights the trainer holds: the workers' answers
name their fingerprint, which must be the one the last weight push returned (or, at the first
step, one fingerprint for every worker).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import torch

from detgate.contract.analysis import TeacherTotals, compare_to_teacher
from detgate.rl.report import StepResult
from detgate.rl.rollout import Rollout, Sampling, sample_groups
from detgate.rl.task import group_advantages, problems
from detgate.train import Policy
from detgate.worker.tools.push_weights import update_weights


@dataclass(frozen=True)
class Settings:
    task: str
    steps: int
    problems_per_step: int
    sampling: Sampling
    lr: float
    seed: int


class FingerprintMismatch(RuntimeError):
    """A rollout was sampled on weights other than the trainer's."""


@dataclass
class Workers:
    """The workers whose weights the loop replaces: base URLs and their admin token."""

    urls: list[str]
    admin_token: str


class Loop:
    def __init__(self, policy: Policy, gateway: httpx.Client, model: str, workers: Workers,
                 settings: Settings) -> None:
        self.policy = policy
        self.gateway = gateway
        self.model = model
        self.workers = workers
        self.settings = settings
        self.optimizer = torch.optim.AdamW(policy.parameters(), lr=settings.lr)
        self.fingerprint: str | None = None  # the weights the rollouts must be sampled on

    def run(self, on_step: Callable[[StepResult], None]) -> list[StepResult]:
        results = []
        for step in range(1, self.settings.steps + 1):
            results.append(self.step(step))
            on_step(results[-1])
        return results

    def step(self, step: int) -> StepResult:
        start = time.perf_counter()
        groups = self.rollouts(step)
        rollouts = [r for g in groups for r in g]
        self.check_fingerprints(rollouts)
        scored = [r for r in rollouts if r.token_ids]
        trainer = self.policy.completion_logprobs([r.prompt for r in scored],
                                                  [r.token_ids for r in scored])
        totals = TeacherTotals.of([compare_to_teacher(r.logprobs, lp.tolist())
                                   for r, lp in zip(scored, trainer, strict=True)])
        loss = self.loss(groups, dict(zip(map(id, scored), trainer, strict=True)))
        sync = 0.0
        if loss.requires_grad:  # some group's rewards differed: there is a gradient
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            sync_start = time.perf_counter()
            self.push()
            sync = time.perf_counter() - sync_start
        return StepResult(
            step=step, reward=sum(r.problem.reward(r.text) for r in rollouts) / len(rollouts),
            kl=totals.kl, max_abs_diff=totals.max_abs_diff, tokens=totals.tokens,
            identical_tokens=totals.identical, loss=loss.item(), rollouts=len(rollouts),
            fingerprint=rollouts[0].fingerprint, seconds=time.perf_counter() - start,
            sync_seconds=sync)

    def rollouts(self, step: int) -> list[list[Rollout]]:
        s = self.settings
        base = s.seed * 1_000_003 + step * 1_000
        batch = problems(s.task, base, s.problems_per_step)
        prompts = [(p, self.policy.tokenizer.encode(p.prompt)) for p in batch]
        seeds = [base + i for i in range(len(batch))]
        return sample_groups(self.gateway, self.model, prompts, s.sampling, seeds)

    def check_fingerprints(self, rollouts: list[Rollout]) -> None:
        seen = {r.fingerprint for r in rollouts}
        expected = {self.fingerprint} if self.fingerprint is not None else seen
        if seen != expected or len(seen) != 1:
            raise FingerprintMismatch(
                f"rollouts sampled on {sorted(seen)}, the trainer's weights are "
                f"{sorted(expected)}: every worker must serve the trainer's weights")
        self.fingerprint = seen.pop()

    def loss(self, groups: list[list[Rollout]], trainer: dict[int, torch.Tensor]
             ) -> torch.Tensor:
        """The objective above; a plain 0 (no gradient) when every group's rewards are equal."""
        terms = []
        for group in groups:
            advantages = group_advantages([r.problem.reward(r.text) for r in group])
            terms += [a * trainer[id(r)].mean() / len(group)
                      for r, a in zip(group, advantages, strict=True)
                      if a != 0.0 and id(r) in trainer]
        if not terms:
            return torch.zeros(())
        return -torch.stack(terms).sum() / len(groups)

    def push(self) -> None:
        """The serving weights to every worker; they must all report one new fingerprint."""
        answers = update_weights(self.workers.urls, self.workers.admin_token,
                                 tensors=self.policy.serving_state_dict())
        fingerprints = {a["system_fingerprint"] for a in answers}
        if len(fingerprints) != 1:
            raise FingerprintMismatch(f"the workers disagree after the update: {fingerprints}")
        self.fingerprint = fingerprints.pop()
