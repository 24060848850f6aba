"""A live stack: a real Prometheus server (Debian's package) scrapes a real gateway (run as in its
image: torch and triton cannot be imported) and a real built-in worker, with the shipped scrape
config and alert rules. After traffic and replays,
every query of every Grafana panel returns at least one series through Prometheus' HTTP API,
and every alert rule evaluates without error."""

from __future__ import annotations

import copy
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.deploy.conftest import PROMETHEUS_DIR, dashboard_targets, detgate_without_torch
from tests.support.procs import Proc, free_port
from tests.support.redis_keys import delete_prefix

# What Grafana substitutes before it sends a query. The rate window spans the whole test.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__range": "1h", "$__interval": "15s"}
WAIT_S = 120.0


@dataclass
class Prometheus:
    url: str

    def query(self, expr: str) -> list[dict]:
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait_for(self, expr: str, predicate, what: str) -> float:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            value = self.value(expr)
            if value is not None and predicate(value):
                return value
            time.sleep(0.25)
        pytest.fail(f"Prometheus never saw {what} ({expr} = {self.value(expr)})")


def live_config(shipped: dict, targets: dict[str, list[str]]) -> dict:
    """The shipped config with the test's loopback addresses in place of the compose services:
    same jobs, relabelling and rules; 1 s scrapes so the test does not wait long."""
    config = copy.deepcopy(shipped)
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(PROMETHEUS_DIR / pattern) for pattern in shipped["rule_files"]]
    jobs = []
    for job in config["scrape_configs"]:
        if job["job_name"] in targets:
            job.pop("dns_sd_configs", None)
            job["static_configs"] = [{"targets": targets[job["job_name"]]}]
            jobs.append(job)
    config["scrape_configs"] = jobs
    return config


@pytest.fixture
def gateway(start_worker, redis_url, tmp_path) -> Iterator[tuple[str, str]]:
    worker = start_worker()
    port = free_port()
    prefix = f"detgate-test-deploy-{secrets.token_hex(4)}"
    env = {
        "DETGATE_HOST": "127.0.0.1",
        "DETGATE_PORT": str(port),
        "DETGATE_WORKERS": worker.url,
        "DETGATE_REDIS_URL": redis_url,
        "DETGATE_KEY_PREFIX": prefix,
        "DETGATE_HEALTH_INTERVAL_S": "0.5",
    }
    proc = Proc(
        detgate_without_torch("gateway"),
        f"http://127.0.0.1:{port}",
        tmp_path / "gateway.log",
        env=env,
    )
    proc.start("/readyz", timeout=60)
    yield proc.url, worker.url
    proc.stop()
    assert "halted" not in proc.log(), "the gateway tried to import torch or triton"
    delete_prefix(redis_url, prefix)


@pytest.fixture
def prometheus(gateway, prometheus_config, tmp_path) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("the prometheus server is not installed: run .ci/system-deps")
    gateway_url, worker_url = gateway
    port = free_port()
    address = f"127.0.0.1:{port}"
    config = live_config(
        prometheus_config,
        {
            "gateway": [gateway_url.removeprefix("http://")],
            "worker": [worker_url.removeprefix("http://")],
            "prometheus": [address],
        },
    )
    assert [job["job_name"] for job in config["scrape_configs"]] == [
        "gateway",
        "worker",
        "prometheus",
    ]
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    proc = Proc(
        [
            binary,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address={address}",
            "--storage.tsdb.retention.time=1h",
        ],
        f"http://{address}",
        tmp_path / "prometheus.log",
    )
    proc.start("/-/ready", timeout=60)
    yield Prometheus(proc.url)
    proc.stop()


def traffic(gateway_url: str) -> tuple[int, int]:
    """Completions and chat completions (plain, streamed, sampled), reads of records, and
    replays alone and under load. Answers (replays, matching replays)."""
    client = openai.OpenAI(base_url=gateway_url + "/v1", api_key="open", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    ids = [
        client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=8, temperature=0
        ).id,
        client.completions.create(
            model=model,
            prompt="Once upon a time",
            max_tokens=8,
            temperature=0.8,
            seed=7,
            logprobs=2,
        ).id,
        client.chat.completions.create(
            model=model,
            max_tokens=8,
            temperature=0,
            messages=[{"role": "user", "content": "Hello"}],
        ).id,
    ]
    for chunk in client.chat.completions.create(
        model=model,
        max_tokens=8,
        temperature=0,
        stream=True,
        messages=[{"role": "user", "content": "Count"}],
    ):
        ids.append(chunk.id)
    ids = list(dict.fromkeys(ids))
    with httpx.Client(base_url=gateway_url, timeout=120) as http:
        assert http.get("/v1/requests", params={"limit": 10}).status_code == 200
        assert http.get(f"/v1/requests/{ids[0]}").status_code == 200
        assert http.get("/v1/requests/chatcmpl-unknown").status_code == 404
        matches = 0
        for i, record_id in enumerate(ids):
            replay = http.post(f"/replay/{record_id}", json={"load": 2 * (i % 2)})
            assert replay.status_code == 200, replay.text
            matches += replay.json()["match"]
    return len(ids), matches


def test_every_dashboard_query_returns_series_on_a_live_stack(gateway, prometheus, dashboard):
    gateway_url, worker_url = gateway
    prometheus.wait_for('min(up{job=~"gateway|worker"})', lambda v: v == 1, "both targets up")
    prometheus.wait_for("count(up)", lambda v: v == 3, "every target")
    # Negative control: an empty answer is visible, so the checks below are not vacuous.
    assert prometheus.query("sum(rate(detgate_no_such_metric_total[5m]))") == []

    replays, matches = traffic(gateway_url)

    # Wait until a scrape holds the final counts, then for a few more scrapes, so that every
    # series born during the traffic has the two samples rate() needs.
    prometheus.wait_for("sum(detgate_replays_total)", lambda v: v >= replays, "the replays")
    steps = float(
        next(
            line.split()[-1]
            for line in httpx.get(worker_url + "/metrics").text.splitlines()
            if line.startswith("detgate_worker_batch_size_seqs_count")
        )
    )
    prometheus.wait_for(
        "sum(detgate_worker_batch_size_seqs_count)",
        lambda v: v >= steps,
        "the worker's engine steps",
    )
    scrapes = prometheus.value('count_over_time(up{job="gateway"}[1h])')
    prometheus.wait_for(
        'count_over_time(up{job="gateway"}[1h])', lambda v: v >= scrapes + 3, "three more scrapes"
    )

    empty = []
    for title, target in dashboard_targets(dashboard):
        expr = grafana_substitute(target["expr"])
        assert "$" not in expr, (title, expr)
        if not prometheus.query(expr):
            empty.append(f"{title}: {expr}")
    assert not empty, "panel queries without data:\n" + "\n".join(empty)

    # The match-ratio panel agrees with what the replays themselves answered.
    ratio = next(t for title, t in dashboard_targets(dashboard) if title == "Replay match ratio")
    assert prometheus.value(grafana_substitute(ratio["expr"])) == pytest.approx(
        matches / replays, abs=1e-9
    )

    # Every rule evaluates on the live series; the alerts say what the stack did.
    rules = evaluated_rules(prometheus)
    assert all(rule["health"] == "ok" for rule in rules), [
        (r["name"], r.get("lastError")) for r in rules
    ]
    state = {rule["name"]: rule["state"] for rule in rules}
    for quiet in (
        "DetgateNoHealthyWorker",
        "DetgateRecordsFailing",
        "DetgateReplayErrors",
        "DetgateGatewayDown",
        "DetgateWorkerDown",
    ):
        assert state[quiet] == "inactive", quiet
    if matches < replays:  # a diverged replay must raise the alert at once
        wait_until(lambda: rule_state(prometheus, "DetgateReplayDiverged") == "firing", "the alert")
    else:
        assert state["DetgateReplayDiverged"] == "inactive"


def grafana_substitute(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.25)


def rules_now(prometheus: Prometheus) -> list[dict]:
    groups = httpx.get(f"{prometheus.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    return [rule for group in groups for rule in group["rules"]]


def evaluated_rules(prometheus: Prometheus) -> list[dict]:
    wait_until(
        lambda: all(r["health"] != "unknown" for r in rules_now(prometheus)), "rule evaluation"
    )
    rules = rules_now(prometheus)
    assert rules
    return rules


def rule_state(prometheus: Prometheus, name: str) -> str:
    return next(r["state"] for r in rules_now(prometheus) if r["name"] == name)


def test_live_config_keeps_the_shipped_jobs(prometheus_config):
    shipped = {job["job_name"]: job for job in prometheus_config["scrape_configs"]}
    live = live_config(prometheus_config, {"gateway": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]})
    for job in live["scrape_configs"]:
        assert {k: v for k, v in job.items() if k != "static_configs"} == {
            k: v
            for k, v in shipped[job["job_name"]].items()
            if k not in ("static_configs", "dns_sd_configs")
        }
    assert all(Path(p).is_absolute() for p in live["rule_files"])
