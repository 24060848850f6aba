"""Weight-update helpers for tests: a worker that accepts updates, the admin call, and the
answers of a set of probe requests in a form that compares bit for bit."""

from __future__ import annotations

from pathlib import Path

import httpx

from detgate.contract.constants import ADMIN_TOKEN_ENV, FINGERPRINT_HEADER, UPDATE_WEIGHTS_PATH
from tests.support.procs import Proc, detgate_cmd, free_port

TOKEN = "admin-secret-for-tests"
MODEL = "tiny"

# What each probe exercises: greedy with alternatives, prompt logprobs (a full prefill), a
# seeded draw, a chat, and a prompt of four KV blocks (the prefix cache).
LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
PROBES: list[tuple[str, dict]] = [
    ("/v1/completions", {"prompt": "The river", "max_tokens": 12, "temperature": 0,
                         "logprobs": 2, "prompt_logprobs": 1, "return_token_ids": True}),
    ("/v1/completions", {"prompt": "Once upon", "max_tokens": 12, "temperature": 1.0,
                         "seed": 7, "logprobs": 0, "return_token_ids": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}],
                              "max_tokens": 10, "temperature": 0, "logprobs": True,
                              "top_logprobs": 1, "return_token_ids": True}),
    ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0,
                         "logprobs": 0, "return_token_ids": True}),
]
SCORE = {"token_ids": [5, 80, 200, 31, 7, 99, 12], "start": 1}


def start_worker(model: Path, log_dir: Path, *, token: str | None = TOKEN,
                 extra: tuple[str, ...] = ()) -> Proc:
    port = free_port()
    proc = Proc(detgate_cmd("worker", "--model", str(model), "--port", str(port), *extra),
                f"http://127.0.0.1:{port}", log_dir / f"worker-{port}.log",
                env={ADMIN_TOKEN_ENV: token} if token else {})
    return proc.start("/health", timeout=180)


def update_worker(url: str, model_path: Path | str, *, token: str | None = TOKEN,
           abort: bool = False, timeout: float = 120) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    return httpx.post(url + UPDATE_WEIGHTS_PATH, headers=headers, timeout=timeout,
                      json={"model_path": str(model_path), "abort_all_requests": abort})


def fingerprint(url: str) -> str:
    return httpx.get(url + "/health", timeout=10).headers[FINGERPRINT_HEADER]


def exact(value):
    """`value` (a JSON answer) with every float as its hex spelling (so -0.0 != 0.0), and the
    per-answer ids, times and usage (its cached tokens depend on the worker's past) left out:
    equal iff the numbers are equal bit for bit."""
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, dict):
        return {k: exact(v) for k, v in value.items() if k not in ("id", "created", "usage")}
    if isinstance(value, list):
        return [exact(v) for v in value]
    return value


def probe(url: str) -> list:
    """Every probe's answer (and a /v1/score) from the worker at `url`, made exact."""
    with httpx.Client(base_url=url, timeout=120) as client:
        out = []
        for path, body in PROBES:
            r = client.post(path, json={"model": MODEL, **body})
            r.raise_for_status()
            out.append(exact(r.json()))
        r = client.post("/v1/score", json={"model": MODEL, **SCORE})
        r.raise_for_status()
        out.append(exact(r.json()))
    return out
