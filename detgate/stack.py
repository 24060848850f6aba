"""The embedded stack's processes: Redis, N built-in workers and the gateway, started in
dependency order and supervised together (`detgate up`, `detgate rl`).

Each part runs as its own process, exactly as it would in a deployment. The children must not
outlive the supervisor: a SIGKILLed supervisor cannot stop them, so on Linux each child asks
the kernel (PR_SET_PDEATHSIG) for a SIGKILL when its parent dies. They run in sessions of their
own (a Ctrl-C in the terminal reaches only the supervisor, which stops them in order), and the
death signal is independent of the process group.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from detgate import procs
from detgate.contract.constants import REDIS_URL
from detgate.procs import free_port

CLI = [sys.executable, "-m", "detgate.cli"]


def reachable(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _die_with(parent: int):
    """A `preexec_fn` for children of `parent` (the supervisor): SIGKILL when it dies.

    SIGKILL, not SIGTERM: nothing is left to wait for a graceful stop, and every child is safe
    to kill (the gateway answers 2xx only for durable records; Redis has written its AOF)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the supervisor died before the signal was armed
            os._exit(1)

    return arm


def served_port(host: str, port: int) -> bool:
    """Something answers on the port, or holds it so that our gateway could not bind it."""
    if reachable(host, port):
        return True
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


@dataclass
class Stack:
    """The child processes of one `detgate up`, stopped in reverse order of start."""

    logs: Path
    children: list[tuple[str, subprocess.Popen]] = field(default_factory=list)

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        popen = procs.start(args, self.logs / f"{name}.log", env, preexec_fn=_die_with(os.getpid()))
        self.children.append((name, popen))

    def wait_http(self, name: str, url: str, timeout: float = 180.0) -> None:
        try:
            procs.wait_http(dict(self.children)[name], url, timeout, interval=0.2)
        except procs.Exited as exc:
            log = self.logs / f"{name}.log"
            raise RuntimeError(f"{name} exited ({exc.returncode}); see {log}") from None
        except TimeoutError:
            raise RuntimeError(f"{name} did not answer {url} within {timeout:.0f}s") from None

    def first_dead(self) -> str | None:
        return next((name for name, p in self.children if p.poll() is not None), None)

    def stop(self) -> None:
        for _, popen in reversed(self.children):
            procs.signal_group(popen, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for _, popen in reversed(self.children):
            procs.reap(popen, max(0.1, deadline - time.monotonic()))


def start_redis(stack: Stack, data_dir: Path) -> str:
    """Use DETGATE_REDIS_URL when it answers; otherwise run a persistent redis-server of our own."""
    url = os.environ.get("DETGATE_REDIS_URL", REDIS_URL)
    parsed = urlparse(url)
    if "+" in parsed.scheme:  # a Redis Cluster or Sentinel: the gateway reaches it, or says why
        return url
    # A URL without a port means Redis's own, 6379.
    if reachable(parsed.hostname or "127.0.0.1", parsed.port or 6379):
        return url
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError(f"Redis is not reachable at {url} and redis-server is not installed")
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    # appendfsync everysec: at most about one second of records is lost if the machine crashes.
    stack.spawn("redis", [binary, "--bind", "127.0.0.1", "--port", str(port),
                          "--dir", str(data_dir), "--appendonly", "yes",
                          "--appendfsync", "everysec", "--save", ""])
    deadline = time.monotonic() + 20
    while not reachable("127.0.0.1", port):
        if time.monotonic() > deadline or stack.first_dead():
            raise RuntimeError(f"redis-server did not start; see {stack.logs}/redis.log")
        time.sleep(0.1)
    return f"redis://127.0.0.1:{port}/0"


@dataclass(frozen=True)
class Endpoints:
    gateway: str
    workers: list[str]
    redis_url: str


def start_stack(stack: Stack, root: Path, *, workers: int, mode: str, model: str, port: int,
                worker_args: tuple[str, ...] = (), worker_env: dict[str, str] | None = None,
                gateway_env: dict[str, str] | None = None) -> Endpoints:
    """Redis (DETGATE_REDIS_URL if it answers, else our own under `root`), `workers` built-in
    workers of `model`, and the gateway on `port`, each answering before the next starts."""
    redis_url = start_redis(stack, root / "redis")
    # Prepared once here (a GGUF dequantised, a preset written), so that N workers neither
    # race nor repeat it; they find it ready under the state dir.
    prepare = subprocess.run([*CLI, "prepare-model", model], stdout=subprocess.DEVNULL,
                             preexec_fn=_die_with(os.getpid()))
    if prepare.returncode:
        raise RuntimeError(f"model {model!r} is not available (see above)")
    urls = []
    for i in range(workers):
        worker_port = free_port()
        stack.spawn(f"worker-{i}", [*CLI, "worker", "--model", model, "--mode", mode,
                                    "--port", str(worker_port), *worker_args], env=worker_env)
        urls.append(f"http://127.0.0.1:{worker_port}")
    for i, url in enumerate(urls):
        stack.wait_http(f"worker-{i}", url + "/health")
    gateway = f"http://127.0.0.1:{port}"
    stack.spawn("gateway", [*CLI, "gateway"], env={
        "DETGATE_HOST": "127.0.0.1", "DETGATE_PORT": str(port),
        "DETGATE_REDIS_URL": redis_url, "DETGATE_WORKERS": ",".join(urls), **(gateway_env or {}),
    })
    stack.wait_http("gateway", gateway + "/readyz")
    return Endpoints(gateway, urls, redis_url)


def stop_on_sigterm() -> None:
    """SIGTERM handled like Ctrl-C, so that supervisors (and tests) stop the stack cleanly, and
    Ctrl-C even where SIGINT was ignored when we started (a background job of a script)."""
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    signal.signal(signal.SIGINT, signal.default_int_handler)
