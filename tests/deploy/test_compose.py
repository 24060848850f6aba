"""docker-compose.yml: valid for Docker Compose v2, and every service consistent with the others.

Each check reads the file as `docker compose config` resolves it (profiles on, variables from
deploy/.env.example), so interpolation, anchors and defaults are what Docker would run.
"""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from tests.deploy.conftest import (
    COMPOSE_FILE,
    DEPLOY,
    ENV_EXAMPLE,
    ROOT,
    resolved_compose,
    run_compose_config,
)

# Backends whose vLLM implementation declares batch-invariance support
# (AttentionBackend.supports_batch_invariance); FlashInfer does not.
BATCH_INVARIANT_BACKENDS = {"FLASH_ATTN", "TRITON_ATTN", "FLASH_ATTN_MLA", "TRITON_MLA"}
SECRETS = ("DETGATE_API_KEYS", "REDIS_PASSWORD", "GRAFANA_ADMIN_PASSWORD", "HF_TOKEN")
# Which services may see each secret: no other service gets it.
SECRET_USERS = {
    "DETGATE_API_KEYS": {"gateway"},
    "REDIS_PASSWORD": {"redis", "gateway"},
    "GRAFANA_ADMIN_PASSWORD": {"grafana"},
    "HF_TOKEN": {"vllm"},
}
URL_PORT = re.compile(r"https?://(?:127\.0\.0\.1|localhost):(\d+)/")


def listening_ports(service: dict) -> set[int]:
    """Container ports a service declares: `expose` and the targets of `ports`."""
    return {int(p) for p in service.get("expose", [])} | {
        int(p["target"]) for p in service.get("ports", [])
    }


def command_flag(service: dict, flag: str) -> str | None:
    for arg in service.get("command") or []:
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def healthcheck_text(service: dict) -> str:
    return " ".join(service["healthcheck"]["test"][1:])


def test_compose_v2_accepts_the_file_with_and_without_profiles():
    for profiles in ((), ("gpu",), ("vllm",), ("gpu", "vllm")):
        out = run_compose_config(COMPOSE_FILE, ENV_EXAMPLE, profiles)
        assert out.returncode == 0, (profiles, out.stderr)


def test_default_stack_is_redis_gateway_two_cpu_workers_prometheus_grafana():
    services = set(resolved_compose(profiles=())["services"])
    assert services == {"redis", "gateway", "worker-1", "worker-2", "prometheus", "grafana"}
    profiled = set(resolved_compose()["services"]) - services
    assert profiled == {"worker-gpu", "vllm"}


@pytest.mark.parametrize(
    "mutation, message",
    [
        (
            lambda doc: doc["services"]["gateway"].update(bogus_key=1),
            "additional properties 'bogus_key'",
        ),
        (
            lambda doc: doc["services"]["grafana"]["depends_on"].update(
                nowhere={"condition": "service_healthy"}
            ),
            "nowhere",
        ),
        (lambda doc: doc["services"]["redis"]["healthcheck"].update(retries="three"), "retries"),
    ],
)
def test_validator_rejects_broken_files(tmp_path, mutation, message):
    """Negative control: the validator used above does refuse what Docker would refuse."""
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    mutation(doc)
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(yaml.safe_dump(doc))
    for sub in ("deploy",):
        shutil.copytree(ROOT / sub, tmp_path / sub)
    out = run_compose_config(broken, ENV_EXAMPLE)
    assert out.returncode != 0
    assert message in out.stderr


def test_required_secrets_must_be_set(tmp_path):
    env = tmp_path / ".env"
    env.write_text("".join(f"{k}=x\n" for k in SECRETS if k != "REDIS_PASSWORD"))
    out = run_compose_config(COMPOSE_FILE, env)
    assert out.returncode != 0 and "set REDIS_PASSWORD in deploy/.env" in out.stderr


def test_every_service_has_an_image_a_healthcheck_and_a_restart_policy(compose):
    for name, service in compose["services"].items():
        assert service.get("image"), name
        if "build" in service:
            dockerfile = Path(service["build"]["context"]) / service["build"]["dockerfile"]
            assert dockerfile.is_file(), (name, dockerfile)
        else:
            tag = service["image"].rpartition(":")[2]
            assert ":" in service["image"] and tag not in ("", "latest"), (
                f"{name}: pin the image tag"
            )
        check = service.get("healthcheck")
        assert check and not check.get("disable") and check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert service.get("restart") in ("unless-stopped", "always"), name


def test_healthchecks_probe_the_port_each_service_listens_on(compose):
    for name, service in compose["services"].items():
        probed = {int(p) for p in URL_PORT.findall(healthcheck_text(service))}
        assert probed <= listening_ports(service), (name, probed)
    assert "redis-cli ping" in healthcheck_text(compose["services"]["redis"])


def test_servers_listen_where_the_compose_file_says(compose):
    services = compose["services"]
    for name, service in services.items():
        port = command_flag(service, "--port")
        if port is not None:
            assert int(port) in listening_ports(service), name
            assert command_flag(service, "--host") == "0.0.0.0", name
    gateway = services["gateway"]["environment"]
    assert gateway["DETGATE_HOST"] == "0.0.0.0"
    assert int(gateway["DETGATE_PORT"]) in listening_ports(services["gateway"])


def test_dependencies_exist_and_wait_for_health(compose):
    services = compose["services"]
    for name, service in services.items():
        for dep, spec in (service.get("depends_on") or {}).items():
            assert dep in services, (name, dep)
            assert spec["condition"] == "service_healthy", (name, dep)
            assert "healthcheck" in services[dep]
            assert not set(services[dep].get("profiles", [])) - set(service.get("profiles", [])), (
                f"{name} (always on) cannot require {dep}, which only a profile starts"
            )
    assert set(services["gateway"]["depends_on"]) == {"redis", "worker-1", "worker-2"}


def test_published_ports_are_distinct_and_observability_stays_on_loopback(compose):
    published = [
        (p.get("host_ip", ""), p["published"])
        for s in compose["services"].values()
        for p in s.get("ports", [])
    ]
    assert len({port for _, port in published}) == len(published)
    for name in ("prometheus", "grafana"):
        assert all(p.get("host_ip") == "127.0.0.1" for p in compose["services"][name]["ports"]), (
            name
        )
    for name in ("redis", "worker-1", "worker-2", "worker-gpu", "vllm"):
        assert not compose["services"][name].get("ports"), f"{name} is internal"


def test_the_gateway_points_at_worker_services_and_redis(compose):
    services = compose["services"]
    workers = services["gateway"]["environment"]["DETGATE_WORKERS"].split(",")
    assert workers
    for url in workers:
        parsed = urlparse(url)
        assert parsed.hostname in services, url
        assert parsed.port in listening_ports(services[parsed.hostname]), url
    assert "redis://:${REDIS_PASSWORD}@redis:6379/0" in " ".join(
        services["gateway"]["command"]
    ).replace("$$", "$")
    assert 6379 in listening_ports(services["redis"])
    # Operator labels name worker services too (the vLLM one by default).
    labels = yaml.safe_load(services["gateway"]["environment"]["DETGATE_WORKER_LABELS"])
    for url in labels:
        if url != "*":
            assert urlparse(url).hostname in services, url


def test_prometheus_scrapes_services_that_exist(compose, prometheus_config):
    services = compose["services"]
    for job in prometheus_config["scrape_configs"]:
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, _, port = target.rpartition(":")
                if job["job_name"] == "prometheus":
                    host = "prometheus"
                assert host in services, (job["job_name"], target)
                assert int(port) in listening_ports(services[host]), (job["job_name"], target)
        for sd in job.get("dns_sd_configs", []):
            for host in sd["names"]:
                assert host in services, (job["job_name"], host)
                assert sd["port"] in listening_ports(services[host]), (job["job_name"], host)
    scraped = {
        name
        for job in prometheus_config["scrape_configs"]
        for sd in job.get("dns_sd_configs", [])
        for name in sd["names"]
    }
    scraped |= {
        t.rpartition(":")[0]
        for job in prometheus_config["scrape_configs"]
        for s in job.get("static_configs", [])
        for t in s["targets"]
    }
    assert {"gateway", "worker-1", "worker-2", "worker-gpu", "vllm"} <= scraped


def test_mounted_config_files_exist(compose):
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), (name, volume["source"])
                assert volume.get("read_only"), (name, volume["target"])
            else:
                assert volume["source"] in compose["volumes"], (name, volume["source"])


def test_secrets_reach_only_the_services_that_use_them(tmp_path):
    values = {k: secrets.token_hex(16) for k in SECRETS}
    env = tmp_path / ".env"
    env.write_text(ENV_EXAMPLE.read_text() + "".join(f"{k}={v}\n" for k, v in values.items()))
    compose = resolved_compose(env)
    for key, value in values.items():
        seen = {name for name, service in compose["services"].items() if value in str(service)}
        assert seen == SECRET_USERS[key], key
    text = COMPOSE_FILE.read_text()
    for key in SECRETS:
        assert re.search(rf"\${{{key}:[?-]", text), f"{key} must come from the env file"


def test_git_ignores_the_env_file_with_the_secrets():
    out = subprocess.run(["git", "check-ignore", "-q", "deploy/.env"], cwd=ROOT)
    assert out.returncode == 0
    assert (
        subprocess.run(["git", "check-ignore", "-q", "deploy/.env.example"], cwd=ROOT).returncode
        == 1
    )


def test_images_hold_no_secrets_and_build_contexts_exclude_env_files(compose):
    secret_words = re.compile(r"(PASSWORD|TOKEN|API_KEY|SECRET)", re.I)
    for name, service in compose["services"].items():
        if "build" not in service:
            continue
        dockerfile = Path(service["build"]["context"]) / service["build"]["dockerfile"]
        for line in dockerfile.read_text().splitlines():
            if re.match(r"\s*(ENV|ARG)\b", line):
                assert not secret_words.search(line), (name, line)
        ignore = [
            line.strip()
            for line in dockerfile.with_name(dockerfile.name + ".dockerignore")
            .read_text()
            .splitlines()
            if line.strip() and not line.startswith("#")
        ]
        assert ignore[0] == "*", name  # deny by default, then allow the package sources only
        assert not any(line.lstrip("!").startswith(("deploy", ".env")) for line in ignore), name


def test_worker_images_install_torch_for_their_device():
    cpu = (DEPLOY / "worker-cpu.Dockerfile").read_text()
    gpu = (DEPLOY / "worker-gpu.Dockerfile").read_text()
    assert "download.pytorch.org/whl/cpu" in cpu and '".[worker]"' in cpu
    assert re.search(r"download\.pytorch\.org/whl/cu\d+", gpu) and '".[worker,gpu]"' in gpu
    assert "gcc" in gpu  # Triton builds its launcher with the system compiler at run time


def test_gpu_profile_runs_the_builtin_worker_on_cuda(compose):
    worker = compose["services"]["worker-gpu"]
    assert worker["profiles"] == ["gpu"]
    assert command_flag(worker, "--device") == "cuda"
    assert command_flag(worker, "--mode") == "batch_invariant"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_vllm_profile_runs_vllm_batch_invariant(compose):
    vllm = compose["services"]["vllm"]
    assert vllm["profiles"] == ["vllm"]
    assert vllm["image"].startswith("vllm/vllm-openai:")
    assert vllm["entrypoint"] == ["vllm", "serve"]
    assert vllm["environment"]["VLLM_BATCH_INVARIANT"] == "1"
    assert command_flag(vllm, "--attention-backend") in BATCH_INVARIANT_BACKENDS
    # The gateway asks for logprobs on every request and allows top_logprobs up to 20.
    assert int(command_flag(vllm, "--max-logprobs")) >= 20
    devices = vllm["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia"
    assert "/health" in healthcheck_text(vllm)


def test_redis_keeps_an_append_only_file_on_a_volume(compose):
    redis = compose["services"]["redis"]
    conf_mount = next(v for v in redis["volumes"] if v["type"] == "bind")
    conf = dict(
        line.split(None, 1)
        for line in Path(conf_mount["source"]).read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert conf["appendonly"] == "yes" and conf["appendfsync"] == "everysec"
    assert conf["maxmemory-policy"] == "noeviction"
    assert conf_mount["target"] in " ".join(redis["command"])
    data = next(v for v in redis["volumes"] if v["type"] == "volume")
    assert f"--dir {data['target']} " in " ".join(redis["command"])


def test_env_example_sets_every_variable_the_compose_file_reads():
    used = set(re.findall(r"\$\{([A-Z0-9_]+)", COMPOSE_FILE.read_text()))
    example = ENV_EXAMPLE.read_text()
    documented = set(re.findall(r"^#?\s*([A-Z0-9_]+)=", example, re.M))
    assert used - {"DETGATE_IMAGE_TAG"} <= documented, used - documented
