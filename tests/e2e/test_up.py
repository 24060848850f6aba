"""`detgate up` end to end: the whole embedded stack from one command, used with the openai SDK."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import openai
import pytest

from tests.support.procs import detgate_cmd, free_port


@pytest.fixture
def stack(tmp_path, redis_url, smollm2_state):
    """`detgate up` as the README runs it (the default model), its state dir sharing the
    session's prepared model folder."""
    port = free_port()
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "models").symlink_to(smollm2_state / "models")
    env = {**os.environ, "DETGATE_STATE_DIR": str(tmp_path / "state"),
           "DETGATE_REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "up.log", "wb") as log:
        proc = subprocess.Popen(detgate_cmd("up", "--workers", "1", "--port", str(port)),
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "up.log").read_text()
        try:
            if httpx.get(base + "/readyz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    else:
        proc.kill()
        pytest.fail("detgate up did not become ready:\n" + (tmp_path / "up.log").read_text())
    yield base, proc, tmp_path / "up.log"
    if proc.poll() is None:
        proc.kill()


def test_up_serves_records_replays_and_stops_cleanly(stack):
    base, proc, log_path = stack
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    assert model == "smollm2-135m-instruct"
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12, temperature=0,
    )
    assert "Paris" in answer.choices[0].message.content
    record = httpx.get(f"{base}/v1/requests/{answer.id}").json()
    assert record["status"] == "complete"
    replay = httpx.post(f"{base}/replay/{answer.id}", json={"load": 4}, timeout=120).json()
    assert replay["match"] is True and replay["first_divergence"] is None

    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    assert "detgate is up" in log_path.read_text()
    with pytest.raises(httpx.HTTPError):
        httpx.get(base + "/healthz", timeout=1)
