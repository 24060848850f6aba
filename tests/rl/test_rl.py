"""`detgate rl` end to end on the CPU: its own stack (Redis, a worker accepting weight updates,
the gateway), the tiny model on the `words` task (random weights earn that reward now and
then, so the loop takes optimizer steps and pushes weights).

batch_invariant: KL exactly 0 (its bit pattern) and every sampled token bit-identical to the
trainer at every step, across weight pushes. The negative control is the same loop against
default-mode workers (MKL matmuls, torch norms, SDPA: reductions in other orders than the
trainer's fixed ones, on any CPU), so some token differs and KL is not 0.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess

import pytest

from detgate.rl.task import Arithmetic, Words, group_advantages, problems
from tests.support.procs import detgate_cmd

STEPS = 3


def run_rl(tmp_path, tiny_model, redis_url, mode: str) -> dict:
    out = tmp_path / f"rl-{mode}.json"
    env = {**os.environ, "DETGATE_STATE_DIR": str(tmp_path / "state"),
           "DETGATE_REDIS_URL": redis_url}
    done = subprocess.run(
        detgate_cmd("rl", "--model", str(tiny_model), "--task", "words", "--mode", mode,
                    "--steps", str(STEPS), "--problems", "2", "--group-size", "4",
                    "--max-tokens", "6", "--workers", "1", "--lr", "1e-3", "--json", str(out)),
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert out.with_suffix(".png").stat().st_size > 0
    return json.loads(out.read_text())


def test_batch_invariant_rl_has_kl_exactly_zero_across_weight_pushes(tmp_path, tiny_model,
                                                                      redis_url):
    result = run_rl(tmp_path, tiny_model, redis_url, "batch_invariant")
    steps = result["steps"]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        assert s["tokens"] > 0
        assert s["identical_tokens"] == s["tokens"], s
        assert struct.pack("<d", s["kl"]) == struct.pack("<d", 0.0), s  # +0.0, not -0.0
        assert s["max_abs_diff"] == 0.0
    # The weights changed during the run: later rollouts were sampled on pushed weights.
    assert len({s["fingerprint"] for s in steps}) > 1
    assert any(s["sync_seconds"] > 0 for s in steps)


def test_default_mode_rl_is_the_control_kl_is_not_zero(tmp_path, tiny_model, redis_url):
    steps = run_rl(tmp_path, tiny_model, redis_url, "default")["steps"]
    assert any(s["identical_tokens"] < s["tokens"] for s in steps), steps
    # The KL estimate is > 0 wherever a logprob differs (contract/analysis.py's k3).
    assert all(s["kl"] > 0.0 and s["max_abs_diff"] > 0 for s in steps
               if s["identical_tokens"] < s["tokens"]), steps


def test_problems_are_a_function_of_the_seed():
    assert problems("arithmetic", 7, 5) == problems("arithmetic", 7, 5)
    assert problems("arithmetic", 7, 5) != problems("arithmetic", 8, 5)


@pytest.mark.parametrize("problem,text,reward", [
    (Arithmetic(7, "+", 5), " 12\nQ", 1.0),
    (Arithmetic(7, "+", 5), " 13 or 12", 0.0),  # the first integer counts
    (Arithmetic(3, "-", 8), " -5", 1.0),
    (Arithmetic(3, "*", 4), " twelve", 0.0),
    (Words(2), " two words", 1.0),
    (Words(2), " three more words", 0.0),
])
def test_rewards(problem, text, reward):
    assert problem.reward(text) == reward


def test_group_advantages_are_zero_without_signal():
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0, 0.0]) == [1.0, -1.0]
