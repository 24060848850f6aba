"""Gateway configuration: one `Settings` object per process, read from DETGATE_* variables."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from detgate.contract import paths
from detgate.contract.constants import GATEWAY_PORT, REDIS_URL
from detgate.gateway.discovery import DnsSource, is_dns_source, parse_nameserver
from detgate.gateway.keys import Keys
from detgate.gateway.limits import TenantLimits
from detgate.gateway.store import RedisTarget

_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # as in DETGATE_API_KEYS


def _split_commas(value: object) -> object:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DETGATE_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = GATEWAY_PORT
    # One Redis, a Redis Cluster (`redis+cluster://`) or a Sentinel-managed master
    # (`redis+sentinel://`): gateway/store.py.
    redis_url: str = Field(REDIS_URL, repr=False)
    # Replicas a record's write waits for (WAIT) before the client is told it is durable;
    # None: 1 for a cluster or Sentinel, 0 for one Redis. Fewer in time: kept in the spool.
    redis_wait_replicas: int | None = Field(None, ge=0)
    redis_wait_timeout_ms: int = Field(200, gt=0)
    redis_max_connections: int = Field(64, ge=1)
    # Built-in workers or vLLM OpenAI servers, as base URLs (no /v1), or `dns+http://NAME:PORT`
    # for every address of NAME (gateway/discovery.py), resolved every `dns_refresh_s`.
    workers: Annotated[list[str], NoDecode] = Field(default_factory=list)
    dns_refresh_s: float = Field(5.0, gt=0)
    # DNS servers for those names (`ADDRESS[:PORT]`, comma-separated); none: /etc/resolv.conf.
    dns_nameservers: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # `tenant:key` pairs; empty means open mode (one tenant, loopback only).
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list, repr=False)
    record_ttl_s: int = Field(7 * 24 * 3600, gt=0)
    # Every Redis key starts with this, so several gateways (or tests) can share one Redis.
    key_prefix: str = "detgate"
    # Operator labels folded into the fingerprint of workers that report none (vLLM): either
    # one free-form string for every worker, e.g. "VLLM_BATCH_INVARIANT=1,gpu=H200", or a
    # JSON object from worker URL (or "*" for the rest) to such a string.
    worker_labels: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)

    health_interval_s: float = Field(2.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    # A request's whole time, queueing and a retry included: a bound on every task, not a
    # judgement on workers (which the timeouts below make).
    total_timeout_s: float = Field(900.0, gt=0)
    redis_timeout_s: float = Field(1.0, gt=0)
    retry_after_s: int = Field(1, ge=1)

    max_body_bytes: int = Field(1 << 20, gt=0)
    max_tokens: int = Field(4096, gt=0)
    max_n: int = Field(16, gt=0)
    max_stop: int = Field(4, ge=0)
    max_stop_chars: int = Field(256, gt=0)  # characters of one stop sequence
    max_score_tokens: int = Field(32768, gt=0)
    max_replay_load: int = Field(64, ge=0)
    # `POST /v1/drift` (gateway/drift.py): the tenant's newest records examined, records
    # replayed at most, replays at once, and the whole run's time.
    max_drift_scan: int = Field(50_000, ge=1)
    max_drift_records: int = Field(10_000, ge=1)
    max_drift_concurrency: int = Field(16, ge=1)
    drift_timeout_s: float = Field(600.0, gt=0)

    # Per-tenant limits (gateway/limits.py): a JSON object from tenant (or "*" for the rest)
    # to {"requests_per_s", "tokens_per_s", "storage_bytes", "max_record_bytes", "name"}.
    # Rates in Redis, shared by every gateway (gateway/rates.py), or in each process.
    rate_limits: Literal["redis", "process"] = "redis"
    tenant_limits: Annotated[dict[str, TenantLimits], NoDecode] = Field(default_factory=dict)
    # A record larger than this (its JSON) is stored as a bounded summary (gateway/summary.py).
    max_record_bytes: int = Field(16 << 20, ge=4096)

    # Durability: while Redis is unreachable, records are appended (fsynced) to a spool file
    # under `spool_dir` and drained into Redis, in order, when it answers again. 0 disables it.
    state_dir: Path = Field(default_factory=paths.state_dir)
    spool_dir: Path | None = None  # default: state_dir/spool
    spool_max_bytes: int = Field(64 << 20, ge=0)

    # The HTTP edge.
    header_timeout_s: float = Field(10.0, gt=0)  # from connection (or first byte) to headers
    body_timeout_s: float = Field(30.0, gt=0)  # to read a whole request body
    # An idle client connection is closed after this. Above the 5 s after which httpx (the
    # openai SDK) stops reusing one, so that a client never sends on a connection the
    # gateway is closing (the race the upstream keep-alive below avoids with workers).
    keepalive_timeout_s: float = Field(15.0, gt=0)
    max_header_bytes: int = Field(32 << 10, ge=1024)  # request line plus headers
    max_connections: int = Field(1000, ge=1)  # more are answered 503 and closed

    # On SIGTERM: stop accepting, let requests finish for this long, then abort the rest.
    shutdown_grace_s: float = Field(30.0, ge=0)
    # Timeouts that follow the request (gateway/forward.py): a stream's first event within
    # `first_byte_timeout_s`, then an event at least every `progress_timeout_s`; a whole
    # answer within first_byte_timeout_s + token_timeout_s x its tokens (max_tokens x n).
    first_byte_timeout_s: float = Field(30.0, gt=0)
    progress_timeout_s: float = Field(30.0, gt=0)
    token_timeout_s: float = Field(0.1, ge=0)
    health_timeout_s: float = Field(10.0, gt=0)
    # Idle pooled connections to workers are closed after this: keep it below the workers'
    # own idle timeout (the built-in worker's --keepalive-timeout-s, 65 s; vLLM's 5 s).
    upstream_keepalive_s: float = Field(4.0, gt=0)
    # A non-streamed request whose client left: how long the worker may take to hand back
    # the tokens generated so far (built-in workers) before the request is cut.
    abort_grace_s: float = Field(5.0, ge=0)

    # Admission (gateway/admission.py): each worker takes its advertised max_num_seqs (or
    # `default_worker_capacity`) sequences at once; at most queue_factor x their sum more
    # requests wait here, each at most `queue_timeout_s`; beyond, 503 at once.
    default_worker_capacity: int = Field(256, ge=1)
    queue_factor: float = Field(1.0, ge=0)
    queue_timeout_s: float = Field(60.0, gt=0)
    # Refused requests' summaries kept per tenant (the newest; a ring, gateway/recorder.py).
    refusal_ring: int = Field(100, ge=0)

    @property
    def redis_target(self) -> RedisTarget:
        return RedisTarget.parse(self.redis_url)

    @property
    def wait_replicas(self) -> int:
        if self.redis_wait_replicas is not None:
            return self.redis_wait_replicas
        return 1 if self.redis_target.replicated else 0

    @property
    def spool_path(self) -> Path:
        return (self.spool_dir or self.state_dir / "spool") / f"records-{self.key_prefix}.jsonl"

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        RedisTarget.parse(value)  # a bad URL stops the start
        return value

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, value: str) -> str:
        Keys(value)  # no hash-tag braces
        return value

    @field_validator("workers", "dns_nameservers", mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        return _split_commas(value)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _key_list(cls, value: object) -> object:
        # Set but blank ("" or spaces) is open mode; an empty entry inside a list ("a:k,,",
        # ",") is a mistake that must not quietly open the gateway or drop a tenant.
        if isinstance(value, str) and value.strip():
            parts = [part.strip() for part in value.split(",")]
            if not all(parts):
                raise ValueError("DETGATE_API_KEYS has an empty entry")
            return parts
        return _split_commas(value)

    @field_validator("worker_labels", mode="before")
    @classmethod
    def _labels(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("{") else ({"*": text} if text else {})
        return value

    @field_validator("tenant_limits", mode="before")
    @classmethod
    def _limits(cls, value: object) -> object:
        if isinstance(value, str):
            value = json.loads(value) if value.strip() else {}
        if isinstance(value, dict):
            bad = [t for t in value if t != "*" and not _TENANT.match(str(t))]
            if bad:
                raise ValueError(f"DETGATE_TENANT_LIMITS: {bad[0]!r} is neither a tenant nor '*'")
        return value

    @field_validator("workers")
    @classmethod
    def _strip_slash(cls, value: list[str]) -> list[str]:
        urls = [url.rstrip("/") for url in value]
        for url in urls:
            if is_dns_source(url):
                DnsSource.parse(url)  # a bad entry stops the start, not the first refresh
        return urls

    @field_validator("dns_nameservers")
    @classmethod
    def _nameservers(cls, value: list[str]) -> list[str]:
        for entry in value:
            parse_nameserver(entry)
        return value

    @property
    def static_workers(self) -> list[str]:
        return [url for url in self.workers if not is_dns_source(url)]

    @property
    def dns_sources(self) -> list[DnsSource]:
        return [DnsSource.parse(url) for url in self.workers if is_dns_source(url)]

    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False
