"""`detgate up` leaves nothing behind: its children die with it, even when it is SIGKILLed,
and a second `detgate up` on ports already served refuses to start instead of reporting an
old stack as its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.procs import detgate_cmd, free_port


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    """Running: a zombie (dead, waiting for a parent to reap it) counts as gone."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_die_with_a_killed_supervisor_and_a_second_up_refuses(tmp_path):
    port = free_port()
    # An unreachable DETGATE_REDIS_URL: `detgate up` starts a redis-server of its own, so
    # every kind of child is covered.
    env = {**os.environ, "DETGATE_STATE_DIR": str(tmp_path / "state"),
           "DETGATE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0", "PYTHONUNBUFFERED": "1"}
    cmd = detgate_cmd("up", "--workers", "1", "--model", "tiny", "--port", str(port))
    with open(tmp_path / "up.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    children: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while "detgate is up" not in (tmp_path / "up.log").read_text():
            assert proc.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.3)
        children = _children(proc.pid)
        assert len(children) == 3  # redis, one worker, the gateway

        second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
        assert second.returncode != 0
        assert f"port {port} is already in use" in second.stderr
        assert "detgate is up" not in second.stdout
        assert httpx.get(base + "/readyz", timeout=5).status_code == 200  # left untouched

        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if _alive(pid)]
        with pytest.raises(httpx.HTTPError):
            httpx.get(base + "/healthz", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in children:  # only if the test failed: never leave its processes behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
