"""deploy/prometheus: promtool accepts the config and rules, and the rules' unit tests pass."""

from __future__ import annotations

import re
import subprocess

import yaml

from detgate.gateway.metrics import Metrics
from tests.deploy.conftest import PROMETHEUS_DIR, promtool

RULES = PROMETHEUS_DIR / "rules" / "detgate.yml"
RULE_TESTS = PROMETHEUS_DIR / "tests" / "detgate_test.yml"
REQUIRED_ALERTS = {
    "DetgateReplayDiverged",
    "DetgateRecordsFailing",
    "DetgateNoHealthyWorker",
    "DetgateGatewayOverheadHigh",
}


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, cwd=PROMETHEUS_DIR)


def test_promtool_check_config():
    out = run_promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 rule files found" in out.stdout


def test_promtool_check_rules():
    out = run_promtool("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_test_rules():
    out = run_promtool("test", "rules", str(RULE_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr


def test_rule_tests_fail_when_an_alert_is_broken(tmp_path):
    """Negative control: the unit tests notice a rule whose threshold was weakened."""
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "rules" / RULES.name).write_text(
        RULES.read_text().replace(
            'increase(detgate_replays_total{result="diverged"}[10m])) > 0',
            'increase(detgate_replays_total{result="diverged"}[10m])) > 1',
        )
    )
    (tmp_path / "tests" / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    out = subprocess.run(
        [promtool(), "test", "rules", str(tmp_path / "tests" / RULE_TESTS.name)],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0
    assert "DetgateReplayDiverged" in out.stdout + out.stderr


def test_required_alerts_exist_and_each_is_unit_tested():
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    alerts = {r["alert"] for r in rules}
    assert alerts >= REQUIRED_ALERTS
    tested = {
        t["alertname"]
        for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
        for t in case["alert_rule_test"]
    }
    assert alerts == tested
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_rules_use_metrics_the_gateway_exports():
    exported = set(
        re.findall(
            r"^(detgate_\w+?)(?:_bucket|_count|_sum|_created)?[{ ]",
            Metrics(["http://w:9001"]).render().decode(),
            re.M,
        )
    )
    used = set(re.findall(r"\b(detgate_\w+?)(?:_bucket|_count|_sum)?\b", RULES.read_text()))
    assert used and used <= exported, used - exported
