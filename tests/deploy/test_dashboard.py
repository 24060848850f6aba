"""deploy/grafana: the provisioning matches the compose stack, and the dashboard has every panel
the operators need, each querying the provisioned Prometheus for metrics that exist."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlparse

import yaml

from detgate.gateway.metrics import Metrics
from detgate.worker.server.metrics import WorkerMetrics
from tests.deploy.conftest import DASHBOARD, DATASOURCES, DEPLOY, dashboard_targets

# What an operator must see at a glance (the titles the dashboard is reviewed against).
REQUIRED_PANELS = {
    "Request rate by endpoint",
    "Request latency by endpoint (p50, p99)",
    "Gateway overhead (p50, p90, p99)",
    "Replay match ratio",
    "Replay logprob MSE distribution",
    "First-divergence position distribution",
    "Worker health",
    "Worker in-flight requests",
    "Worker batch-size distribution",
}
METRIC = re.compile(r"\b(detgate_\w+?)(?:_bucket|_count|_sum)?\b")


def family_names(text: bytes) -> set[str]:
    return set(re.findall(r"^# TYPE (\w+) ", text.decode(), re.M))


def test_datasource_is_the_compose_prometheus(compose):
    source = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]
    assert source["type"] == "prometheus" and source["isDefault"]
    url = urlparse(source["url"])
    prometheus = compose["services"][url.hostname]
    assert url.port in {int(p["target"]) for p in prometheus["ports"]}
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


def test_grafana_loads_the_dashboard_folder_that_compose_mounts(compose):
    grafana = compose["services"]["grafana"]
    mounts = {v["target"]: Path(v["source"]) for v in grafana["volumes"] if v["type"] == "bind"}
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/detgate.yml").read_text())
    folder = provider["providers"][0]["options"]["path"]
    assert mounts[folder] == DASHBOARD.parent
    assert mounts["/etc/grafana/provisioning"] == DATASOURCES.parents[1]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{folder}/{DASHBOARD.name}"


def test_dashboard_has_every_required_panel(dashboard):
    titles = [p["title"] for p in dashboard["panels"] if p["type"] != "row"]
    assert set(titles) >= REQUIRED_PANELS, REQUIRED_PANELS - set(titles)
    assert len(titles) == len(set(titles))
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_every_query_uses_the_provisioned_datasource(dashboard):
    uid = yaml.safe_load(DATASOURCES.read_text())["datasources"][0]["uid"]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == uid, panel["title"]
            assert panel["targets"], panel["title"]
    for title, target in dashboard_targets(dashboard):
        assert target["datasource"]["uid"] == uid, title
        assert target["expr"].strip(), title


def test_every_query_names_metrics_that_gateway_or_worker_export(dashboard):
    exported = family_names(Metrics(["http://w:9001"]).render())
    exported |= family_names(WorkerMetrics().render())
    # Counters' TYPE lines drop the _total suffix.
    exported |= {name + "_total" for name in exported}
    for title, target in dashboard_targets(dashboard):
        used = set(METRIC.findall(target["expr"]))
        assert used and used <= exported, (title, used - exported)
