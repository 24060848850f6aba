"""deploy/kubernetes: every overlay renders (kubectl's kustomize), every object fits the
Kubernetes schemas or its operator's CRD schema, and the objects fit together: probes, Services,
the disruption budget and the autoscaler select the pods they are for, the gateway finds the
workers' headless Services, secrets come only from Secret references, and the monitoring and
Redis objects carry exactly what deploy/prometheus, deploy/grafana and deploy/redis hold."""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
import subprocess
import sys

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import DASHBOARD, DEPLOY, PROMETHEUS_DIR, ROOT
from tests.deploy.kubernetes import (
    OVERLAYS,
    containers,
    one,
    pod_specs,
    rendered,
    selects,
    validate,
)
from tests.deploy.test_compose import BATCH_INVARIANT_BACKENDS

GENERATOR = ROOT / "scripts" / "k8s_generated.py"
SECRET = "detgate-secrets"
SECRET_KEYS = {"api-keys", "redis-password", "hf-token"}
SECRET_NAMES = re.compile(r"KEY|PASSWORD|TOKEN|SECRET")
GATEWAY = "detgate-gateway"


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def gateway_config(objects) -> dict[str, str]:
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap"
             and o["metadata"]["name"].startswith(GATEWAY + "-")]
    return cm["data"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_fits_its_schema(overlay):
    objects = rendered(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Namespace", "Deployment", "Service", "PodDisruptionBudget",
            "HorizontalPodAutoscaler", "ServiceMonitor", "PrometheusRule", "Redis"} <= kinds
    assert "Secret" not in kinds, "secrets are created apart, never rendered from the repo"
    for obj in objects:
        validate(obj)
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "detgate", obj["metadata"]["name"]


@pytest.mark.parametrize("mutate, fails", [
    (lambda o: o["spec"].update(replica=2), "Deployment"),
    (lambda o: o["spec"]["template"]["spec"]["containers"][0].update(imagePullPolicy=3),
     "Deployment"),
    (lambda o: o["spec"]["endpoints"][0].update(intervall="15s"), "ServiceMonitor"),
    (lambda o: o["spec"]["groups"][0]["rules"][0].update(expr=["not a string"]),
     "PrometheusRule"),
    (lambda o: o["spec"].pop("kubernetesConfig"), "Redis"),
    (lambda o: o["spec"]["storage"].update(volumeClaimTemplate={"spec": {"accessMode": []}}),
     "Redis"),
])
def test_validation_refuses_broken_objects(mutate, fails):
    """Negative control: the schemas catch a typo'd field and a wrong type, built-in kinds
    and custom resources alike."""
    broken = copy.deepcopy(next(o for o in rendered("cpu") if o["kind"] == fails))
    mutate(broken)
    with pytest.raises((kubernetes_validate.ValidationError, jsonschema.ValidationError)):
        validate(broken)


def test_gateway_probes_readiness_and_liveness_on_its_port():
    objects = rendered("cpu")
    (c,) = one(objects, "Deployment", GATEWAY)["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == int(env_of(c)["DETGATE_PORT"]["value"])
    assert env_of(c)["DETGATE_HOST"]["value"] == "0.0.0.0"
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # The spool's folder is writable (the root filesystem is not).
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert env_of(c)["DETGATE_STATE_DIR"]["value"] in mounts


def test_budget_autoscaler_and_service_act_on_the_gateway_pods():
    objects = rendered("cpu")
    deployment = one(objects, "Deployment", GATEWAY)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    pdb = one(objects, "PodDisruptionBudget", GATEWAY)["spec"]
    assert selects(pdb["selector"]["matchLabels"], labels)
    assert pdb["maxUnavailable"] < deployment["spec"]["replicas"]
    hpa = one(objects, "HorizontalPodAutoscaler", GATEWAY)["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": GATEWAY}
    assert hpa["minReplicas"] >= 2 and hpa["maxReplicas"] > hpa["minReplicas"]
    service = one(objects, "Service", GATEWAY)["spec"]
    assert selects(service["selector"], labels)
    # Nothing but the gateway is selected by its budget or Service.
    for name, template in pod_specs(objects):
        if name != GATEWAY:
            assert not selects(pdb["selector"]["matchLabels"], template["metadata"]["labels"])
            assert not selects(service["selector"], template["metadata"]["labels"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_selects_pods_on_a_named_port(overlay):
    objects = rendered(overlay)
    for svc in (o for o in objects if o["kind"] == "Service"):
        chosen = [(name, t) for name, t in pod_specs(objects)
                  if selects(svc["spec"]["selector"], t["metadata"]["labels"])]
        assert chosen, svc["metadata"]["name"]
        for _, template in chosen:
            named = {p["name"] for c in template["spec"]["containers"] for p in c["ports"]}
            assert {p["targetPort"] for p in svc["spec"]["ports"]} <= named


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_finds_every_worker_through_a_headless_service(overlay):
    objects = rendered(overlay)
    entries = gateway_config(objects)["DETGATE_WORKERS"].split(",")
    found = set()
    for entry in entries:
        m = re.fullmatch(r"dns\+http://([a-z0-9-]+):(\d+)", entry)
        assert m, entry
        svc = one(objects, "Service", m[1])["spec"]
        assert svc["clusterIP"] == "None" and not svc["publishNotReadyAddresses"]
        assert int(m[2]) in {p["port"] for p in svc["ports"]}
        found |= {name for name, t in pod_specs(objects)
                  if selects(svc["selector"], t["metadata"]["labels"])}
    workers = {name for name, t in pod_specs(objects) if name != GATEWAY}
    assert found == workers
    for name, c in containers(objects):
        if name != GATEWAY:
            assert c["readinessProbe"]["httpGet"]["path"] == "/health", name
            assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] \
                >= 300, name


def test_gpu_workers_request_gpus_and_run_on_cuda():
    objects = rendered("gpu-vllm")
    for name in ("detgate-worker-gpu", "detgate-vllm"):
        (c,) = one(objects, "Deployment", name)["spec"]["template"]["spec"]["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1, name
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 1, name
    (c,) = one(objects, "Deployment", "detgate-worker-gpu")["spec"]["template"]["spec"][
        "containers"]
    assert {"--device=cuda", "--mode=batch_invariant"} <= set(c["args"])
    for name, c in containers(rendered("cpu")):
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {}), name


def readme_vllm_command() -> tuple[dict[str, str], list[str], dict[str, str]]:
    """The README's "Real workers" `vllm serve` line: (environment, positional, flags)."""
    text = (ROOT / "README.md").read_text().split("## Real workers (vLLM)", 1)[1]
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    line = block.split("\n\n", 1)[0].split("DETGATE_WORKERS=", 1)[0].replace("\\\n", " ")
    words = shlex.split(line)
    env = dict(w.split("=", 1) for w in words[:words.index("vllm")])
    rest = words[words.index("serve") + 1:]
    positional = [w for i, w in enumerate(rest)
                  if not w.startswith("--") and (i == 0 or not rest[i - 1].startswith("--"))]
    flags = {w: rest[i + 1] for i, w in enumerate(rest) if w.startswith("--")}
    return env, positional, flags


def test_vllm_runs_with_the_readme_batch_invariant_flags():
    env, positional, flags = readme_vllm_command()
    assert env == {"VLLM_BATCH_INVARIANT": "1"} and flags["--attention-backend"]
    objects = rendered("vllm")
    (c,) = one(objects, "Deployment", "detgate-vllm")["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["vllm", "serve"]
    args = dict(a.split("=", 1) for a in c["args"] if a.startswith("--"))
    assert [a for a in c["args"] if not a.startswith("--")] == positional
    # Every flag of the README but where it listens, with the README's value.
    assert {k: v for k, v in args.items() if k not in ("--host", "--port",
                                                       "--served-model-name")} == {
        k: v for k, v in flags.items() if k != "--port"}
    assert args["--attention-backend"] in BATCH_INVARIANT_BACKENDS
    assert env_of(c)["VLLM_BATCH_INVARIANT"]["value"] == env["VLLM_BATCH_INVARIANT"]
    assert int(args["--port"]) == c["ports"][0]["containerPort"]
    labels = json.loads(gateway_config(objects)["DETGATE_WORKER_LABELS"])
    assert "VLLM_BATCH_INVARIANT=1" in labels[f"dns+http://detgate-vllm:{args['--port']}"]
    assert c["image"].split(":")[1] in labels[f"dns+http://detgate-vllm:{args['--port']}"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_come_from_secret_references_only(overlay):
    objects = rendered(overlay)
    for name, c in containers(objects):
        env = c.get("env", [])
        for i, e in enumerate(env):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if SECRET_NAMES.search(e["name"]) and e["name"] != "DETGATE_REDIS_URL":
                assert ref, (name, e["name"])
            if ref:
                assert ref["name"] == SECRET and ref["key"] in SECRET_KEYS, (name, e)
            # A password spliced into a value comes from an earlier variable of the same list.
            for var in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                assert var in {x["name"] for x in env[:i]}, (name, e["name"], var)
        assert not c.get("envFrom") or all("secretRef" not in s for s in c["envFrom"])
    (gw,) = one(objects, "Deployment", GATEWAY)["spec"]["template"]["spec"]["containers"]
    url = env_of(gw)["DETGATE_REDIS_URL"]["value"]
    assert url == "redis://:$(REDIS_PASSWORD)@detgate-redis:6379/0"
    redis = one(objects, "Redis", "detgate-redis")["spec"]["kubernetesConfig"]["redisSecret"]
    assert redis == {"name": SECRET, "key": "redis-password"}
    assert not any(SECRET_NAMES.search(k) for k in gateway_config(objects))
    readme = (DEPLOY / "README.md").read_text()
    assert all(f"--from-literal={key}=" in readme for key in SECRET_KEYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_pinned(overlay):
    for name, c in containers(rendered(overlay)):
        repo, _, tag = c["image"].rpartition(":")
        assert repo and "/" not in tag and tag not in ("", "latest"), (name, c["image"])
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert c["resources"]["limits"]["memory"], name
    redis = one(rendered(overlay), "Redis", "detgate-redis")
    assert not redis["spec"]["kubernetesConfig"]["image"].endswith(":latest")


def test_redis_persists_with_the_compose_stack_config():
    objects = rendered("cpu")
    spec = one(objects, "Redis", "detgate-redis")["spec"]
    claim = spec["storage"]["volumeClaimTemplate"]["spec"]
    assert claim["accessModes"] == ["ReadWriteOnce"] and claim["resources"]["requests"]["storage"]
    config = one(objects, "ConfigMap", spec["redisConfig"]["additionalRedisConfig"])
    assert config["data"]["redis-additional.conf"] == (DEPLOY / "redis" / "redis.conf").read_text()
    assert "appendonly yes" in config["data"]["redis-additional.conf"]


def test_monitoring_objects_carry_the_deploy_files():
    objects = rendered("cpu")
    rules = yaml.safe_load((PROMETHEUS_DIR / "rules" / "detgate.yml").read_text())
    assert one(objects, "PrometheusRule", "detgate")["spec"] == rules
    dashboard = one(objects, "ConfigMap", "detgate-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["data"]["detgate.json"] == DASHBOARD.read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_scrapes_each_job_the_rules_and_compose_name(overlay, prometheus_config):
    objects = rendered(overlay)
    monitor = one(objects, "ServiceMonitor", "detgate")["spec"]
    (endpoint,) = monitor["endpoints"]
    jobs = {}
    for svc in (o for o in objects if o["kind"] == "Service"):
        labels = svc["metadata"]["labels"]
        if selects(monitor["selector"]["matchLabels"], labels) and all(
                e["key"] in labels for e in monitor["selector"]["matchExpressions"]):
            assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
            jobs[labels[monitor["jobLabel"]]] = svc["metadata"]["name"]
    compose_jobs = {c["job_name"] for c in prometheus_config["scrape_configs"]} - {"prometheus"}
    expected = {"gateway", "worker"} | ({"vllm"} if "vllm" in overlay else set())
    assert set(jobs) == expected and expected <= compose_jobs
    assert endpoint["path"] == "/metrics"
    # The alert on a silent gateway names the job this produces.
    assert 'up{job="gateway"}' in (PROMETHEUS_DIR / "rules" / "detgate.yml").read_text()


def test_generated_files_are_up_to_date():
    out = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr


def test_generated_check_fails_when_a_source_changes(tmp_path):
    """Negative control: an edited alert rule makes the committed PrometheusRule stale."""
    shutil.copytree(DEPLOY, tmp_path / "deploy")
    rules = tmp_path / "deploy" / "prometheus" / "rules" / "detgate.yml"
    rules.write_text(rules.read_text().replace("for: 2m", "for: 3m"))
    out = subprocess.run([sys.executable, str(GENERATOR), "--check", "--root", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert "prometheus-rule.yaml is out of date" in out.stderr
