"""Real processes for tests: start a server, wait until it answers, stop it, keep its log."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    """A server process started by a test; `url` is its base URL."""

    args: list[str]
    url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None

    def start(self, health_path: str = "/health", timeout: float = 120.0) -> Proc:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.popen = subprocess.Popen(
                self.args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                code = self.popen.returncode
                raise RuntimeError(f"{self.args} exited with {code}:\n{self.log()}")
            try:
                if httpx.get(self.url + health_path, timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"{self.args} not healthy after {timeout}s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        os.killpg(self.popen.pid, sig)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""


def detgate_cmd(*args: str) -> list[str]:
    """The `detgate` CLI run with this interpreter, so tests use the environment they run in."""
    return [sys.executable, "-m", "detgate.cli", *args]
