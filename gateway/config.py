"""Gateway configuration: one `Settings` object per process, read from DETGATE_* variables."""

from __future__ import annotations

import ipaddress
import json
import re
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from detgate import paths
from gateway.limits import TenantLimits

_TENANT = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # as in DETGATE_API_KEYS


def _split_commas(value: object) -> object:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DETGATE_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Built-in workers or vLLM OpenAI servers, as base URLs (no /v1).
    workers: Annotated[list[str], NoDecode] = Field(default_factory=list)
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
    attempt_timeout_s: float = Field(120.0, gt=0)
    total_timeout_s: float = Field(300.0, gt=0)
    redis_timeout_s: float = Field(1.0, gt=0)
    retry_after_s: int = Field(1, ge=1)

    max_body_bytes: int = Field(1 << 20, gt=0)
    max_tokens: int = Field(4096, gt=0)
    max_n: int = Field(16, gt=0)
    max_stop: int = Field(4, ge=0)
    max_score_tokens: int = Field(32768, gt=0)
    max_replay_load: int = Field(64, ge=0)

    # Per-tenant limits (gateway/limits.py): a JSON object from tenant (or "*" for the rest)
    # to {"requests_per_s", "tokens_per_s", "storage_bytes", "max_record_bytes", "name"}.
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
    keepalive_timeout_s: float = Field(5.0, gt=0)  # an idle keep-alive connection is closed
    max_header_bytes: int = Field(32 << 10, ge=1024)  # request line plus headers
    max_connections: int = Field(1000, ge=1)  # more are answered 503 and closed

    # On SIGTERM: stop accepting, let requests finish for this long, then abort the rest.
    shutdown_grace_s: float = Field(30.0, ge=0)
    # A worker must start answering (stream: its first event) within this; the whole answer
    # has `attempt_timeout_s`.
    first_byte_timeout_s: float = Field(30.0, gt=0)
    health_timeout_s: float = Field(10.0, gt=0)

    @property
    def spool_path(self) -> Path:
        return (self.spool_dir or self.state_dir / "spool") / f"records-{self.key_prefix}.jsonl"

    @field_validator("workers", mode="before")
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
        return [url.rstrip("/") for url in value]

    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False
