"""Child processes: start one with its output in a log, wait until it answers HTTP, stop it.

Used by `detgate up`, the benchmarks and the tests. A child gets its own session (process group)
so that stopping it stops whatever it started too; standard library only (no torch, no httpx).
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path


class Exited(RuntimeError):
    """The process ended before it answered."""

    def __init__(self, returncode: int) -> None:
        super().__init__(f"exited ({returncode})")
        self.returncode = returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log: Path, env: dict[str, str] | None = None,
          preexec_fn: Callable[[], None] | None = None) -> subprocess.Popen:
    """`args` in a new session, stdout and stderr appended to `log`, unbuffered Python output."""
    with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, preexec_fn=preexec_fn,
        )


def wait_http(popen: subprocess.Popen, url: str, timeout: float | None,
              interval: float = 0.1) -> None:
    """Until GET `url` answers 200. Raises Exited if the process ends first, TimeoutError after
    `timeout` seconds (None: no limit)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        if popen.poll() is not None:
            raise Exited(popen.returncode)
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except (OSError, http.client.HTTPException):  # not listening yet, or not HTTP
            pass
        time.sleep(interval)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s")


def signal_group(popen: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Send `sig` to the process's group, if it is still running."""
    if popen.poll() is None:
        os.killpg(popen.pid, sig)


def reap(popen: subprocess.Popen, timeout: float) -> None:
    """Wait for the process; SIGKILL its group if it is not gone after `timeout` seconds."""
    try:
        popen.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(popen.pid, signal.SIGKILL)
        popen.wait()


def stop(popen: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
    """`sig` to the group, then SIGKILL after `timeout` seconds; nothing if it has ended."""
    if popen.poll() is not None:
        return
    signal_group(popen, sig)
    reap(popen, timeout)
