"""The deploy files as the tools that consume them see them: Docker Compose v2, promtool, JSON.

The Docker engine is not needed: `docker compose config` resolves, interpolates and validates
the compose file client-side. .ci/system-deps installs the compose plugin and Debian's
prometheus package (promtool and the server).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = DEPLOY / ".env.example"
PROMETHEUS_DIR = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "detgate.json"
DATASOURCES = DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
COMPOSE_PLUGIN = Path("/usr/local/lib/docker/cli-plugins/docker-compose")
PROFILES = ("gpu", "vllm")
# Makes `import torch` / `import triton` fail in the process, as in the gateway's image.
WITHOUT_TORCH = (
    "import sys; sys.modules.update(torch=None, triton=None); "
    "from detgate.cli import main; sys.exit(main())"
)


def detgate_without_torch(*args: str) -> list[str]:
    """The `detgate` CLI in a process where torch and triton cannot be imported."""
    return [sys.executable, "-c", WITHOUT_TORCH, *args]


def compose_command() -> list[str]:
    """`docker compose` where the CLI has the plugin, else the plugin binary run standalone."""
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    standalone = shutil.which("docker-compose")
    for candidate in (COMPOSE_PLUGIN, Path(standalone) if standalone else None):
        if candidate and candidate.exists():
            out = subprocess.run([str(candidate), "version"], capture_output=True, text=True)
            if out.returncode == 0 and "v2." in out.stdout:
                return [str(candidate)]
    pytest.fail("Docker Compose v2 is not installed: run .ci/system-deps")


def run_compose_config(
    compose_file: Path,
    env_file: Path,
    profiles: tuple[str, ...] = PROFILES,
) -> subprocess.CompletedProcess:
    args = [
        *compose_command(),
        "--project-directory",
        str(compose_file.parent),
        "-f",
        str(compose_file),
        "--env-file",
        str(env_file),
    ]
    for profile in profiles:
        args += ["--profile", profile]
    return subprocess.run([*args, "config", "--format", "json"], capture_output=True, text=True)


def resolved_compose(env_file: Path = ENV_EXAMPLE, profiles: tuple[str, ...] = PROFILES) -> dict:
    out = run_compose_config(COMPOSE_FILE, env_file, profiles)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="session")
def compose() -> dict:
    """docker-compose.yml resolved with deploy/.env.example and every profile switched on."""
    return resolved_compose()


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: run .ci/system-deps")
    return path


@pytest.fixture(scope="session")
def prometheus_config() -> dict:
    return yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())


@pytest.fixture(scope="session")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_targets(dashboard: dict) -> list[tuple[str, dict]]:
    """(panel title, target) for every query of every panel, rows excluded."""
    return [
        (panel["title"], target)
        for panel in dashboard["panels"]
        if panel["type"] != "row"
        for target in panel["targets"]
    ]
