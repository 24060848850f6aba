"""The gateway image has no torch (deploy/gateway.Dockerfile runs `pip install .`, the base
dependencies only): a gateway process in which torch and triton cannot be imported serves
completions, records and replays against a real worker."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import httpx
import openai

from tests.deploy.conftest import DEPLOY, ROOT
from tests.support.procs import Proc, free_port

# Makes `import torch` / `import triton` raise ImportError in the process, as in the image.
WITHOUT_TORCH = (
    "import sys; sys.modules.update(torch=None, triton=None); "
    "from detgate.cli import main; sys.exit(main())"
)


def test_the_image_installs_the_base_dependencies_only():
    lines = (DEPLOY / "gateway.Dockerfile").read_text().splitlines()
    instructions = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    assert re.findall(r"pip install ([^\s&\\]+)", instructions) == ["."]
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in base if re.match(r"(torch|triton|numpy|safetensors)\b", d)], base


def test_the_torch_blocker_bites(tmp_path):
    """Negative control: a worker, which needs torch, cannot start under the same launcher."""
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, "worker", "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DETGATE_STATE_DIR": str(tmp_path)},
    )
    assert out.returncode != 0
    assert "import of torch halted" in out.stderr


def test_gateway_serves_records_and_replays_without_torch(start_worker, redis_url, tmp_path):
    worker = start_worker()
    port = free_port()
    gateway = Proc(
        [sys.executable, "-c", WITHOUT_TORCH, "gateway"],
        f"http://127.0.0.1:{port}",
        tmp_path / "gateway.log",
        env={
            "DETGATE_PORT": str(port),
            "DETGATE_REDIS_URL": redis_url,
            "DETGATE_WORKERS": worker.url,
            "DETGATE_KEY_PREFIX": "detgate-test-image",
            "DETGATE_RECORD_TTL_S": "60",
        },
    )
    gateway.start("/readyz", timeout=60)
    try:
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="open", max_retries=0)
        model = client.models.list().data[0].id
        answer = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=4,
            temperature=0,
        )
        replay = httpx.post(f"{gateway.url}/replay/{answer.id}", json={"load": 1}, timeout=60)
        assert replay.status_code == 200, replay.text
        assert "detgate_replays_total" in httpx.get(gateway.url + "/metrics").text
    finally:
        gateway.stop()
    assert "halted" not in gateway.log()
