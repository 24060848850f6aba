"""`POST /v1/drift` and `detgate drift` on a real gateway, a real Redis and two real built-in
workers of two fingerprints: batch_invariant and default mode (the tiny model).

Records of the batch_invariant worker replayed on its own fingerprint reproduce bit for bit
(drift 0), under other batches than the original (the replays run 8 at a time); replayed on
the default-mode worker they do not (the negative control: drift > 0). The fleet report
merges two tenants' reports, each tenant's replays counted against its own limits."""

from __future__ import annotations

import json
import subprocess
import threading
import time

import httpx
import pytest

from tests.support.procs import detgate_cmd

KEYS = {"team-a": "key-a", "team-b": "key-b"}
# team-b's rate is low enough that its drift replays must wait for it.
LIMITS = {"team-a": {"name": "team-a"}, "team-b": {"name": "team-b", "requests_per_s": 4}}
RECORDS_A = 16
RECORDS_B = 6


@pytest.fixture(scope="module")
def workers(start_workers_module):
    return start_workers_module(["batch_invariant", "default"])


@pytest.fixture(scope="module")
def gw(start_gateway_module, workers):
    return start_gateway_module(
        [w.url for w in workers], api_keys=",".join(f"{t}:{k}" for t, k in KEYS.items()),
        env={"DETGATE_TENANT_LIMITS": json.dumps(LIMITS)})


def body(i: int) -> tuple[str, dict]:
    """Greedy and seeded sampled requests, completions and chat."""
    sampling = {"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0}
    if i % 3 == 0:
        return "/v1/chat/completions", {
            "model": "tiny", "max_tokens": 12, **sampling,
            "messages": [{"role": "user", "content": f"question {i} about tokens"}]}
    return "/v1/completions", {"model": "tiny", "max_tokens": 12, "prompt": f"record {i}:",
                               **sampling}


def make_records(gw, key: str, n: int, pause_s: float = 0.0) -> list[str]:
    ids = []
    with gw.http(key) as http:
        for i in range(n):
            path, payload = body(i)
            r = http.post(path, json=payload)
            assert r.status_code == 200, r.text
            ids.append(r.json()["id"])
            time.sleep(pause_s)
    return ids


@pytest.fixture(scope="module")
def recorded(gw, workers) -> dict:
    """Records of both tenants on both workers; fingerprints by worker URL."""
    ids = {"team-a": [], "team-b": []}

    def tenant_a() -> None:
        # Two clients at once, so records land on both workers.
        threads = [threading.Thread(target=lambda: ids["team-a"].extend(
            make_records(gw, KEYS["team-a"], RECORDS_A // 2))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    tenant_a()
    ids["team-b"] = make_records(gw, KEYS["team-b"], RECORDS_B, pause_s=0.3)
    fingerprints: dict[str, str] = {}
    by_fp: dict[str, dict[str, int]] = {}
    for tenant, rids in ids.items():
        with gw.http(KEYS[tenant]) as http:
            for rid in rids:
                rec = http.get(f"/v1/requests/{rid}").json()
                fingerprints[rec["worker"]] = rec["system_fingerprint"]
                counts = by_fp.setdefault(rec["system_fingerprint"], {})
                counts[tenant] = counts.get(tenant, 0) + 1
    invariant, default = (fingerprints[w.url] for w in workers)
    assert invariant != default
    assert by_fp[invariant].get("team-a") and by_fp[invariant].get("team-b"), by_fp
    return {"invariant": invariant, "default": default, "counts": by_fp}


def run_cli(gw, tmp_path, from_fp: str, to_fp: str, *extra: str) -> dict:
    out = tmp_path / "drift.json"
    png = tmp_path / "drift.png"
    args = ["drift", "--base-url", gw.url, "--from", from_fp, "--to", to_fp, "--json", str(out),
            "--png", str(png), *extra]
    for key in KEYS.values():
        args += ["--api-key", key]
    done = subprocess.run(detgate_cmd(*args), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "detgate drift" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(out.read_text())


def test_drift_is_zero_on_the_same_numerics(gw, recorded, tmp_path):
    fp = recorded["invariant"]
    admitted = gw.metric("detgate_tenant_requests_total", tenant="team-b", result="admitted")
    report = run_cli(gw, tmp_path, fp, fp)
    expected = recorded["counts"][fp]
    assert report["selected"] == sum(expected.values())
    s = report["summary"]
    assert s["records"] == s["replayed"] == s["identical"] == report["selected"]
    assert s["identical_share"] == 1.0 and s["errors"] == 0
    assert s["first_divergence"] == [] and s["logprob_mse_mean"] == 0.0
    assert set(report["by_tenant"]) == set(expected)
    assert {t: g["records"] for t, g in report["by_tenant"].items()} == expected
    assert set(report["by_endpoint"]) == {"/v1/completions", "/v1/chat/completions"}
    assert all(r["match"] and r["tokens_compared"] > 0 for r in report["records"])
    # Every drift replay was admitted against team-b's rate, as a request is.
    assert gw.metric("detgate_tenant_requests_total", tenant="team-b",
                     result="admitted") == admitted + expected["team-b"]
    assert gw.metric("detgate_drift_identical_ratio", tenant="team-a",
                     endpoint="/v1/completions") == 1.0


def test_negative_control_default_mode_drifts(gw, recorded, tmp_path):
    report = run_cli(gw, tmp_path, recorded["invariant"], recorded["default"])
    s = report["summary"]
    assert s["replayed"] == report["selected"] > 0 and s["errors"] == 0
    assert s["identical"] < s["replayed"]
    assert s["logprob_mse_mean"] > 0 and s["max_abs_logprob_diff"] > 0
    # The gateway's metrics and GET /v1/drift show each tenant's last report.
    for tenant, key in KEYS.items():
        with gw.http(key) as http:
            last = http.get("/v1/drift").json()
        assert last["tenant"] == tenant and last["to_fingerprint"] == recorded["default"]
        for endpoint, group in last["by_endpoint"].items():
            assert gw.metric("detgate_drift_identical_ratio", tenant=tenant,
                             endpoint=endpoint) == group["identical_share"]
            assert gw.metric("detgate_drift_records", tenant=tenant, endpoint=endpoint,
                             result="diverged") == group["replayed"] - group["identical"]
    # A drift replay on other numerics is no failed /replay: the divergence alert stays quiet.
    assert gw.metric("detgate_replays_total", result="diverged") == 0


def test_sample_endpoint_and_refusals(gw, recorded):
    fp = recorded["invariant"]
    with gw.http(KEYS["team-a"]) as http:
        r = http.post("/v1/drift", json={"from_fingerprint": fp, "to_fingerprint": fp,
                                         "sample": 3, "seed": 7,
                                         "endpoint": "/v1/completions"})
        assert r.status_code == 200, r.text
        report = r.json()
        assert report["selected"] == 3 and report["matched"] >= 3
        assert all(row["endpoint"] == "/v1/completions" for row in report["records"])
        again = http.post("/v1/drift", json={"from_fingerprint": fp, "to_fingerprint": fp,
                                             "sample": 3, "seed": 7,
                                             "endpoint": "/v1/completions"}).json()
        assert [row["id"] for row in again["records"]] == [row["id"] for row in
                                                           report["records"]]
        nothing = http.post("/v1/drift", json={"from_fingerprint": "fp_none",
                                               "to_fingerprint": fp}).json()
        assert nothing["selected"] == 0 and nothing["summary"]["identical_share"] is None
        for payload, status, param in (
                ({"from_fingerprint": fp, "to_fingerprint": "fp_absent"}, 409,
                 "to_fingerprint"),
                ({"from_fingerprint": fp, "to_fingerprint": fp, "extra": 1}, 400, "extra"),
                ({"from_fingerprint": fp, "to_fingerprint": fp, "sample": 0}, 400, "sample"),
                ({"from_fingerprint": fp, "to_fingerprint": fp, "concurrency": 1000}, 400,
                 "concurrency"),
                ({"to_fingerprint": fp}, 400, "from_fingerprint")):
            r = http.post("/v1/drift", json=payload)
            assert r.status_code == status, (payload, r.text)
            assert r.json()["error"]["param"] == param
    assert httpx.post(gw.url + "/v1/drift", json={}).status_code == 401
