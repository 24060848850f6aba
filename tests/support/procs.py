"""Real processes for tests: start a server, wait until it answers, stop it, keep its log
(through detgate.procs, as `detgate up` does)."""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from detgate import procs
from detgate.procs import free_port

__all__ = ["Proc", "detgate_cmd", "free_port"]


@dataclass
class Proc:
    """A server process started by a test; `url` is its base URL."""

    args: list[str]
    url: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen | None = None

    def start(self, health_path: str = "/health", timeout: float = 120.0) -> Proc:
        self.popen = procs.start(self.args, self.log_path, self.env)
        try:
            procs.wait_http(self.popen, self.url + health_path, timeout)
        except procs.Exited as exc:
            raise RuntimeError(f"{self.args} exited with {exc.returncode}:\n{self.log()}") from None
        except TimeoutError:
            self.stop()
            raise TimeoutError(f"{self.args} not healthy after {timeout}s:\n{self.log()}") from None
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.popen is not None:
            procs.stop(self.popen, sig, timeout)

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
