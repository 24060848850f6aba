"""The gateway image has no torch: deploy/gateway.Dockerfile runs `pip install .`, and the base
dependencies name neither torch nor triton. The live stack (test_live_dashboard.py) runs its
gateway the same way, in a process where torch and triton cannot be imported."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib

from tests.deploy.conftest import DEPLOY, ROOT, detgate_without_torch
from tests.support.procs import free_port


def test_the_image_installs_the_base_dependencies_only():
    lines = (DEPLOY / "gateway.Dockerfile").read_text().splitlines()
    instructions = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    assert re.findall(r"pip install ([^\s&\\]+)", instructions) == ["."]
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in base if re.match(r"(torch|triton|numpy|safetensors)\b", d)], base


def test_the_torch_blocker_bites(tmp_path):
    """Negative control: a worker, which needs torch, cannot start under the same launcher."""
    out = subprocess.run(
        detgate_without_torch("worker", "--port", str(free_port())),
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DETGATE_STATE_DIR": str(tmp_path)},
    )
    assert out.returncode != 0
    assert "import of torch halted" in out.stderr
