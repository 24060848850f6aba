"""Where a benchmark result comes from: date, git commit, package versions, host.

Every benchmark (gateway, engine, kernels) saves this beside its figures, so that a result
file says what produced it. Imports nothing heavy: the gateway's benchmark uses it too.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def git_commit() -> str | None:
    """HEAD of the checkout this code runs from, with "-dirty" when tracked files changed;
    DETGATE_GIT_COMMIT when set (a tree copied onto a GPU machine, whose .git may be absent or
    stale) or when there is no .git."""
    if os.environ.get("DETGATE_GIT_COMMIT"):
        return os.environ["DETGATE_GIT_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("DETGATE_GIT_COMMIT")
    return sha + ("-dirty" if dirty.strip() else "")


def versions(*packages: str) -> dict[str, str | None]:
    """Python's version and each installed package's (None when it is not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


RESULTS = Path("bench/results")


def save_result(report: dict, stem: str, path: str | None = None) -> Path:
    """Write a benchmark's JSON to `path`, or to bench/results/<stem>-<UTC stamp>.json."""
    out = Path(path) if path else RESULTS / (
        f"{stem}-{datetime.datetime.now(datetime.UTC).strftime('%Y%m%dT%H%M%SZ')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return out
