"""Gateway configuration: one `Settings` object per process, read from DETGATE_* variables."""

from __future__ import annotations

import ipaddress
import json
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


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

    @field_validator("workers", "api_keys", mode="before")
    @classmethod
    def _comma_list(cls, value: object) -> object:
        return _split_commas(value)

    @field_validator("worker_labels", mode="before")
    @classmethod
    def _labels(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("{") else ({"*": text} if text else {})
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
