"""What `detgate rl` writes: one row per step (the JSON's `steps`), a PNG of reward and KL per
step, and a line per step on the terminal."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class StepResult:
    step: int
    reward: float  # mean reward of the step's rollouts
    kl: float | None  # KL(sampler || trainer) estimated over every sampled token
    max_abs_diff: float | None  # largest |logp_sampler - logp_trainer| over those tokens
    tokens: int  # sampled tokens compared
    identical_tokens: int  # of those, the ones whose two logprobs have the same bits
    loss: float
    rollouts: int
    fingerprint: str  # the workers' system_fingerprint the rollouts were sampled on
    seconds: float  # the whole step: rollouts, trainer pass, optimizer step, weight push
    sync_seconds: float  # of it, pushing the new weights to every worker

    def line(self) -> str:
        kl = "n/a" if self.kl is None else f"{self.kl:.3g}"
        diff = "n/a" if self.max_abs_diff is None else f"{self.max_abs_diff:.3g}"
        return (f"step {self.step:3d}  reward {self.reward:.3f}  KL {kl}  max|diff| {diff}  "
                f"identical {self.identical_tokens}/{self.tokens}  loss {self.loss:+.4f}  "
                f"{self.seconds:.1f}s")


def write_json(path: Path, settings: dict, steps: list[StepResult], environment: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**settings, "environment": environment,
                                "steps": [asdict(s) for s in steps]}, indent=2) + "\n")


def write_plot(path: Path, steps: list[StepResult], title: str) -> None:
    """Reward (top) and KL (bottom) per step; matplotlib's Agg backend, no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s.step for s in steps]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.plot(xs, [s.reward for s in steps], marker="o")
    top.set_ylabel("mean reward")
    top.set_ylim(-0.05, 1.05)
    top.set_title(title)
    bottom.plot(xs, [s.kl or 0.0 for s in steps], marker="o", color="tab:red")
    bottom.set_ylabel("KL(sampler || trainer)")
    bottom.set_xlabel("step")
    bottom.axhline(0.0, color="grey", linewidth=0.5)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
