"""The gateway's Prometheus metrics, exactly as the contract names them, in one registry per app.

Labels come from small fixed sets: endpoint templates, HTTP status codes, configured worker
names (URLs without user-info), record and replay results, tenant names given in
DETGATE_TENANT_LIMITS (every other tenant is "other"). Never a request id, key, password,
tenant id or prompt.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01,
                    0.025, 0.05, 0.1, 0.25, 1.0)
MSE_BUCKETS = tuple(10.0 ** e for e in range(-12, 1))  # 1e-12 ... 1
ABS_DIFF_BUCKETS = tuple(10.0 ** e for e in range(-9, 2))  # 1e-9 ... 10
DIVERGENCE_BUCKETS = (0, 1, *(2 ** e for e in range(1, 13)))  # 0, 1, 2, 4, ... 4096

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/score", "/v1/models",
             "/v1/requests", "/v1/requests/{id}", "/replay/{id}", "/metrics", "/healthz",
             "/readyz", "/openapi.json", "/v1/drift")

TENANT_RESULTS = ("admitted", "requests_per_s_exceeded", "tokens_per_s_exceeded",
                  "storage_budget_exceeded")
SUMMARY_REASONS = ("record_too_large", "refused", "rejected")
DNS_RESULTS = ("ok", "empty", "failed")
DRIFT_ENDPOINTS = ENDPOINTS[:2]  # the generation endpoints: the records that replay
DRIFT_RESULTS = ("identical", "diverged", "error")


def endpoint_label(path: str) -> str:
    """The route template for a path, so the label set stays small whatever clients send."""
    if path in ENDPOINTS:
        return path
    if path.startswith("/v1/requests/"):
        return "/v1/requests/{id}"
    if path.startswith("/replay/"):
        return "/replay/{id}"
    return "other"


class Metrics:
    def __init__(self, workers: list[str], tenants: tuple[str, ...] = ("other",)) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("detgate_requests_total", "HTTP requests answered",
                                ["endpoint", "code"], registry=r)
        self.request_duration = Histogram(
            "detgate_request_duration_seconds", "Time from request to the last byte answered",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.upstream_duration = Histogram(
            "detgate_upstream_duration_seconds", "Time spent waiting on a worker, per attempt",
            ["worker"], buckets=LATENCY_BUCKETS, registry=r)
        self.overhead = Histogram(
            "detgate_gateway_overhead_seconds",
            "Request duration minus upstream time: what the gateway itself adds",
            buckets=OVERHEAD_BUCKETS, registry=r)
        self.records = Counter("detgate_records_total", "Record writes", ["result"], registry=r)
        self.replays = Counter("detgate_replays_total", "Replays", ["result"], registry=r)
        self.replay_mse = Histogram(
            "detgate_replay_logprob_mse", "Logprob MSE of a replay before its first divergence",
            buckets=MSE_BUCKETS, registry=r)
        self.replay_max_abs = Histogram(
            "detgate_replay_max_abs_logprob_diff",
            "Largest |logprob difference| of a replay before its first divergence",
            buckets=ABS_DIFF_BUCKETS, registry=r)
        self.replay_divergence = Histogram(
            "detgate_replay_first_divergence_position",
            "Generated-token index of the first differing token (diverged replays only)",
            buckets=DIVERGENCE_BUCKETS, registry=r)
        self.worker_up = Gauge("detgate_worker_up", "1 when the worker passes health checks",
                               ["worker"], registry=r)
        self.spool_records = Gauge("detgate_spool_records",
                                   "Records in the on-disk spool, waiting for Redis", registry=r)
        self.spool_bytes = Gauge("detgate_spool_bytes", "Size of the on-disk record spool",
                                 registry=r)
        self.worker_inflight = Gauge("detgate_worker_inflight", "Requests outstanding per worker",
                                     ["worker"], registry=r)
        self.worker_capacity = Gauge(
            "detgate_worker_capacity", "Sequences a worker takes at once (its max_num_seqs)",
            ["worker"], registry=r)
        self.queue_depth = Gauge("detgate_queue_depth",
                                 "Requests waiting in the gateway for a worker slot", registry=r)
        self.reconnects = Counter(
            "detgate_upstream_reconnects_total", "Requests sent again on a fresh connection "
            "because a pooled one dropped before the worker answered", ["worker"], registry=r)
        self.tenant_requests = Counter(
            "detgate_tenant_requests_total", "Inference requests per tenant: admitted, or the "
            "limit that refused them", ["tenant", "result"], registry=r)
        self.tenant_tokens = Counter("detgate_tenant_tokens_total",
                                     "Tokens (usage.total_tokens) charged per tenant",
                                     ["tenant"], registry=r)
        self.tenant_stored_bytes = Gauge(
            "detgate_tenant_stored_bytes", "A named tenant's record bytes in Redis, as last seen",
            ["tenant"], registry=r)
        self.records_summarised = Counter(
            "detgate_records_summarised_total", "Records stored as a bounded summary",
            ["reason"], registry=r)
        self.dns_lookups = Counter(
            "detgate_dns_lookups_total", "Lookups of DNS worker names (DETGATE_WORKERS dns+...): "
            "addresses found, none, or failed (the last set kept)", ["result"], registry=r)
        for result in DNS_RESULTS:
            self.dns_lookups.labels(result)
        # The last drift report (gateway/drift.py) per tenant label and endpoint.
        self.drift_records = Gauge(
            "detgate_drift_records", "Records of the last drift report: replayed identical, "
            "diverged, or not replayed (error)", ["tenant", "endpoint", "result"], registry=r)
        self.drift_identical_ratio = Gauge(
            "detgate_drift_identical_ratio", "Share of the last drift report's replayed records "
            "that were bitwise identical", ["tenant", "endpoint"], registry=r)
        self.drift_logprob_mse = Gauge(
            "detgate_drift_logprob_mse", "Mean logprob MSE (before the first divergence) of "
            "the last drift report's replays", ["tenant", "endpoint"], registry=r)
        self.drift_max_abs = Gauge(
            "detgate_drift_max_abs_logprob_diff", "Largest |logprob difference| of the last "
            "drift report's replays", ["tenant", "endpoint"], registry=r)
        self.drift_time = Gauge(
            "detgate_drift_last_run_timestamp_seconds", "When the tenant's last drift report "
            "was made", ["tenant"], registry=r)
        for tenant in tenants:
            for result in TENANT_RESULTS:
                self.tenant_requests.labels(tenant, result)
            self.tenant_tokens.labels(tenant)
        for reason in SUMMARY_REASONS:
            self.records_summarised.labels(reason)
        self._request_children: dict[tuple[str, int], tuple] = {}
        self._tenant_children: dict[tuple[str, str], Counter] = {}
        self._upstream_children: dict[str, Histogram] = {}
        self.records_stored = self.records.labels("stored")
        self.records_failed = self.records.labels("failed")
        self.records_spooled = self.records.labels("spooled")  # durable, not yet in Redis
        # A refusal's summary not stored: over the tenant's storage budget, or Redis away.
        self.records_skipped = self.records.labels("skipped")
        for label in ("match", "diverged", "error"):
            self.replays.labels(label)
        for name in workers:
            self.worker_up.labels(name).set(0)
            self.reconnects.labels(name)

    def forget_worker(self, name: str) -> None:
        """A worker gone from DNS and drained: its series go, so labels follow the fleet."""
        for metric in (self.worker_up, self.worker_inflight, self.worker_capacity,
                       self.upstream_duration):
            with contextlib.suppress(KeyError):
                metric.remove(name)
        self._upstream_children.pop(name, None)

    def observe_request(self, endpoint: str, status: int, elapsed_s: float,
                        upstream_s: float | None) -> None:
        # Labelled children are looked up once and kept: `labels()` takes a lock every call.
        key = (endpoint, status)
        children = self._request_children.get(key)
        if children is None:
            children = (self.requests.labels(endpoint, str(status)),
                        self.request_duration.labels(endpoint))
            self._request_children[key] = children
        children[0].inc()
        children[1].observe(elapsed_s)
        if upstream_s is not None:
            self.overhead.observe(max(elapsed_s - upstream_s, 0.0))

    def count_tenant(self, tenant: str, result: str, tokens: int = 0) -> None:
        """An admitted or refused request (`result`), or `tokens` charged, for a tenant label."""
        key = (tenant, result)
        child = self._tenant_children.get(key)
        if child is None:
            child = self._tenant_children[key] = (self.tenant_tokens.labels(tenant) if tokens
                                                  else self.tenant_requests.labels(*key))
        child.inc(tokens or 1)

    def observe_upstream(self, worker: str, seconds: float) -> None:
        child = self._upstream_children.get(worker)
        if child is None:
            child = self._upstream_children[worker] = self.upstream_duration.labels(worker)
        child.observe(seconds)

    def observe_replay(self, comparison: dict) -> None:
        self.replays.labels("match" if comparison["match"] else "diverged").inc()
        if comparison["logprob_mse"] is not None:
            self.replay_mse.observe(comparison["logprob_mse"])
            self.replay_max_abs.observe(comparison["max_abs_logprob_diff"])
        if comparison["first_divergence"] is not None:
            self.replay_divergence.observe(comparison["first_divergence"])

    def observe_drift(self, tenant: str, report: dict) -> None:
        """A tenant label's last drift report replaces its previous one."""
        self.drift_time.labels(tenant).set(report["created"])
        for endpoint in DRIFT_ENDPOINTS:
            group = report["by_endpoint"].get(endpoint)
            results = ((group["identical"], group["replayed"] - group["identical"],
                        group["errors"]) if group else (0, 0, 0))
            for result, count in zip(DRIFT_RESULTS, results, strict=True):
                self.drift_records.labels(tenant, endpoint, result).set(count)
            for gauge, field in ((self.drift_identical_ratio, "identical_share"),
                                 (self.drift_logprob_mse, "logprob_mse_mean"),
                                 (self.drift_max_abs, "max_abs_logprob_diff")):
                value = group and group[field]
                if value is None:  # nothing measured: no series rather than a stale one
                    with contextlib.suppress(KeyError):
                        gauge.remove(tenant, endpoint)
                else:
                    gauge.labels(tenant, endpoint).set(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
