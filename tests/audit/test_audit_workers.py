"""`detgate audit` against real built-in workers (and the gateway), through the real CLI.

The load is varied on purpose: 8 audited requests in flight plus 4 streams of other prompts
of random lengths, so the worker's batches change size and composition while the audited
prompt decodes (the worker's batch-size histogram is checked to prove it). A batch-invariant
worker must answer bitwise identically; the default mode, the negative control, must not.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import matplotlib.image
import pytest

from detgate.audit.batch_sizes import find_histogram
from tests.support.procs import Proc, detgate_cmd, free_port
from tests.support.redis_keys import delete_prefix

CONTRACT_FIELDS = {"n", "unique_completions", "most_common_count", "first_divergence",
                   "logprob_mse_mean", "max_abs_logprob_diff"}
PROMPT = "Tell me about Richard Feynman"
N = 32
LOAD = ("--concurrency", "8", "--mix", "4", "--max-tokens", "16")
# A wide terminal, so that the report's rows are not wrapped where the tests read them.
CLI_ENV = {**os.environ, "COLUMNS": "200"}


def start_worker_proc(tiny_model: Path, log_dir: Path, mode: str) -> Proc:
    port = free_port()
    args = detgate_cmd("worker", "--model", str(tiny_model), "--mode", mode, "--port", str(port))
    return Proc(args, f"http://127.0.0.1:{port}", log_dir / f"worker-{mode}.log").start("/health")


# One worker per mode for the whole module: earlier traffic must not matter to an invariant
# worker, and sharing them keeps the module fast.
@pytest.fixture(scope="module")
def invariant_worker(tiny_model, tmp_path_factory) -> Iterator[Proc]:
    proc = start_worker_proc(tiny_model, tmp_path_factory.mktemp("logs"), "batch_invariant")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def default_worker(tiny_model, tmp_path_factory) -> Iterator[Proc]:
    proc = start_worker_proc(tiny_model, tmp_path_factory.mktemp("logs"), "default")
    yield proc
    proc.stop()


def audit(base_url: str, tmp_path: Path, *extra: str, n: int = N) -> tuple[dict, str]:
    """Runs `detgate audit` and answers (the JSON it wrote, its stdout)."""
    out = tmp_path / "audit.json"
    run = subprocess.run(
        detgate_cmd("audit", "--base-url", base_url, "--model", "tiny", "--prompt", PROMPT,
                    "-n", str(n), *LOAD, "--json", str(out), *extra),
        capture_output=True, text=True, timeout=300, env=CLI_ENV)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(out.read_text()), run.stdout


def assert_batches_varied(doc: dict) -> None:
    buckets = doc["details"]["batch_sizes"]["buckets"]
    assert len(buckets) >= 2, buckets  # more than one batch size was scheduled
    assert any(b["up_to"] > 1 for b in buckets), buckets


def test_batch_invariant_worker_is_bitwise_identical_under_varied_load(invariant_worker, tmp_path):
    report_dir = tmp_path / "report"
    doc, stdout = audit(invariant_worker.url + "/v1", tmp_path, "--score",
                        "--report", str(report_dir))

    assert set(doc) == CONTRACT_FIELDS | {"details"}
    assert (doc["n"], doc["unique_completions"], doc["most_common_count"]) == (N, 1, N)
    assert doc["first_divergence"] == []
    assert doc["logprob_mse_mean"] == 0.0 and doc["max_abs_logprob_diff"] == 0.0
    details = doc["details"]
    assert details["exact_matches"] == N and details["compared_by"] == "token_id"
    assert details["distinct_outputs"] == 1
    assert details["mixed_in_requests"] > 0 and details["failed"] == 0
    assert_batches_varied(doc)
    # The on-policy check: teacher-forced logprobs equal the sampled ones bitwise.
    score = details["score"]
    assert (score["scored"], score["exact"], score["errors"]) == (N, N, [])
    assert score["max_abs_logprob_diff"] == 0.0 and score["kl_estimate"] == 0.0

    assert "unique completions" in stdout and "max |sampler - trainer|" in stdout
    md = (report_dir / "report.md").read_text()
    assert "| unique completions | 1 |" in md and f"| most common count | {N} of {N} |" in md
    for name in ("first_divergence.png", "logprob_delta.png"):
        assert matplotlib.image.imread(report_dir / name).ndim == 3
        assert f"({name})" in md


def test_default_mode_shows_logprob_differences_negative_control(default_worker, tmp_path):
    doc, stdout = audit(default_worker.url + "/v1", tmp_path, "--score")

    assert doc["n"] == N
    assert_batches_varied(doc)
    # On CPU the batch changes the bits of the logprobs before it flips tokens.
    assert doc["max_abs_logprob_diff"] > 0 or doc["unique_completions"] > 1
    assert doc["details"]["exact_matches"] < N and doc["details"]["distinct_outputs"] > 1
    # Decode under load vs one full forward pass: the sampler and the trainer disagree.
    assert doc["details"]["score"]["max_abs_logprob_diff"] > 0
    assert "max |delta logprob|" in stdout


def test_chat_with_seeded_sampling_is_identical_on_an_invariant_worker(invariant_worker,
                                                                       tmp_path):
    doc, _ = audit(invariant_worker.url + "/v1", tmp_path, "--endpoint", "chat",
                   "--temperature", "0.9", "--seed", "7", "--score", n=16)
    assert (doc["n"], doc["unique_completions"]) == (16, 1)
    assert doc["max_abs_logprob_diff"] == 0.0
    assert doc["details"]["seed"] == 7 and doc["details"]["score"]["max_abs_logprob_diff"] == 0.0


def test_audit_through_the_gateway_with_an_api_key(invariant_worker, redis_url, tmp_path):
    port, prefix = free_port(), f"detgate-test-audit-{secrets.token_hex(4)}"
    gateway = Proc(detgate_cmd("gateway"), f"http://127.0.0.1:{port}", tmp_path / "gateway.log",
                   env={"DETGATE_HOST": "127.0.0.1", "DETGATE_PORT": str(port),
                        "DETGATE_WORKERS": invariant_worker.url, "DETGATE_API_KEYS": "t1:k-audit",
                        "DETGATE_REDIS_URL": redis_url, "DETGATE_KEY_PREFIX": prefix,
                        "DETGATE_HEALTH_INTERVAL_S": "0.2"})
    gateway.start("/readyz", timeout=60)
    try:
        doc, stdout = audit(gateway.url + "/v1", tmp_path, "--api-key", "k-audit", "--score",
                            n=16)
    finally:
        gateway.stop()
        delete_prefix(redis_url, prefix)
    assert (doc["n"], doc["unique_completions"], doc["max_abs_logprob_diff"]) == (16, 1, 0.0)
    assert doc["details"]["fingerprints"] and doc["details"]["compared_by"] == "token_id"
    # The gateway passes /v1/score to the built-in worker: the trainer's view equals the
    # sampled logprobs bitwise (the negative control is the default-mode audit above).
    score = doc["details"]["score"]
    assert (score["unsupported"], score["errors"], score["skipped"]) == (None, [], 0)
    assert score["scored"] == score["exact"] == 16
    assert score["max_abs_logprob_diff"] == 0.0 and score["kl_estimate"] == 0.0


def test_wrong_model_fails_fast_with_the_endpoint_message(invariant_worker, tmp_path):
    run = subprocess.run(
        detgate_cmd("audit", "--base-url", invariant_worker.url + "/v1", "--model", "nope",
                    "--prompt", PROMPT, "-n", "4"),
        capture_output=True, text=True, timeout=120, env=CLI_ENV)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "error:" in run.stdout and "nope" in run.stdout
    assert "0 answered, 1 failed" in run.stdout


def engine_steps(worker: Proc) -> float:
    return find_histogram(httpx.get(worker.url + "/metrics", timeout=10).text).count


def test_ctrl_c_reports_what_it_has(invariant_worker, tmp_path):
    out = tmp_path / "partial.json"
    steps = engine_steps(invariant_worker)
    proc = subprocess.Popen(
        detgate_cmd("audit", "--base-url", invariant_worker.url + "/v1", "--model", "tiny",
                    "--prompt", PROMPT, "-n", "100000", "--concurrency", "4",
                    "--max-tokens", "4", "--json", str(out)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=CLI_ENV)
    try:
        # Wait for real progress (engine steps), not for a duration.
        while engine_steps(invariant_worker) < steps + 40:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stdout + stderr
    doc = json.loads(out.read_text())
    assert doc["details"]["outcome"] == "interrupted"
    assert 1 <= doc["n"] < 100000 and doc["unique_completions"] == 1
    assert "interrupted: partial results" in stdout


def test_time_bound_stops_the_run_and_keeps_results(invariant_worker, tmp_path):
    doc, stdout = audit(invariant_worker.url + "/v1", tmp_path, "--timeout", "5", n=100000)
    assert doc["details"]["outcome"] == "timeout"
    assert 1 <= doc["n"] < 100000
    assert "time bound reached" in stdout
