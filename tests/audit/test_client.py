"""The audit client against endpoints that throttle or reject vLLM's extensions.

No built-in server behaves like this on purpose, so a small aiohttp server stands in for a
strict OpenAI-compatible provider: it answers 429 with Retry-After, 400 to unknown fields.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from detgate.audit.client import (
    AuditRequestError,
    Deadline,
    EndpointClient,
    RequestSpec,
    api_root,
    parse_response,
)
from detgate.audit.runner import LoadPlan, collect

SPEC = RequestSpec(prompt="Tell me about Richard Feynman", max_tokens=3, temperature=0.0, seed=None)
STANDARD_FIELDS = {"model", "prompt", "messages", "max_tokens", "temperature", "seed", "logprobs"}


def completion(body: dict) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "model": body["model"],
            "system_fingerprint": "fp_x",
            "choices": [{"index": 0, "text": " Queens, New", "finish_reason": "length",
                         "logprobs": {"tokens": [" Queens", ",", " New"],
                                      "token_logprobs": [-0.5, -0.25, -0.125]}}]}


class StrictProvider:
    """Throttles the first `throttle` requests, rejects fields it does not know."""

    def __init__(self, throttle: int = 0, retry_after: str = "0") -> None:
        self.throttle = throttle
        self.retry_after = retry_after
        self.bodies: list[dict] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        if self.throttle > 0:
            self.throttle -= 1
            return web.json_response({"error": {"message": "slow down"}}, status=429,
                                     headers={"Retry-After": self.retry_after})
        if body["prompt"] == "garbage":
            return web.json_response({"choices": []})
        unknown = set(body) - STANDARD_FIELDS
        if unknown:
            return web.json_response(
                {"error": {"message": f"Unrecognized request argument supplied: {unknown}"}},
                status=400)
        return web.json_response(completion(body))


@pytest.fixture
async def provider_url():
    servers = []

    async def start(provider: StrictProvider) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", provider.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        servers.append(runner)
        port = site._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    yield start
    for runner in servers:
        await runner.cleanup()


def client_for(url: str, retries: int = 3, seconds: float = 30.0) -> EndpointClient:
    return EndpointClient(url, "k", "m", "completions", retries=retries,
                          deadline=Deadline(seconds), pool_size=4)


async def test_rejected_extension_is_dropped_once_and_remembered(provider_url):
    provider = StrictProvider()
    client = client_for(await provider_url(provider))
    try:
        first = await client.complete(SPEC, 0)
        second = await client.complete(SPEC, 1)
    finally:
        await client.aclose()
    assert first.tokens == (" Queens", ",", " New") and first.token_ids is None
    assert second.logprobs == (-0.5, -0.25, -0.125)
    assert client.stats.dropped_fields == ["return_token_ids"]
    assert ["return_token_ids" in b for b in provider.bodies] == [True, False, False]
    assert all(b["logprobs"] == 1 for b in provider.bodies)


async def test_throttled_requests_are_retried_honouring_retry_after(provider_url):
    provider = StrictProvider(throttle=2, retry_after="0.05")
    client = client_for(await provider_url(provider))
    try:
        sample = await client.complete(SPEC, 0)
    finally:
        await client.aclose()
    assert sample.text == " Queens, New"
    assert client.stats.retries == 2
    assert sample.attempts == 1  # the attempt that counted after the fallback


async def test_retries_are_bounded(provider_url):
    provider = StrictProvider(throttle=10, retry_after="0")
    client = client_for(await provider_url(provider), retries=2)
    try:
        with pytest.raises(AuditRequestError) as info:
            await client.complete(SPEC, 0)
    finally:
        await client.aclose()
    assert info.value.status == 429
    assert len(provider.bodies) == 3


async def test_a_malformed_answer_is_a_failed_sample_not_a_crash(provider_url):
    client = client_for(await provider_url(StrictProvider()))
    try:
        with pytest.raises(AuditRequestError, match="not an OpenAI completions answer"):
            await client.complete(RequestSpec("garbage", 3, 0.0, None), 0)
    finally:
        await client.aclose()


async def test_a_retry_after_beyond_the_time_bound_is_not_waited_for(provider_url):
    provider = StrictProvider(throttle=1, retry_after="3600")
    client = client_for(await provider_url(provider), seconds=5.0)
    try:
        with pytest.raises(AuditRequestError, match="time bound"):
            await client.complete(SPEC, 0)
    finally:
        await client.aclose()


async def test_collect_keeps_what_finished_when_stopped(provider_url):
    client = client_for(await provider_url(StrictProvider()))
    stop = asyncio.Event()
    seen = []

    def progress(collected):
        seen.append(len(collected.samples))
        if len(collected.samples) >= 3:
            stop.set()

    try:
        out = await collect(client, SPEC, LoadPlan(n=1000, concurrency=1, mix=1, seed=0),
                            stop, progress)
    finally:
        await client.aclose()
    assert out.outcome == "interrupted"
    assert 3 <= len(out.samples) < 1000
    assert out.mix_done >= 0 and seen


def test_chat_response_with_vllm_token_ids_is_parsed():
    data = {"system_fingerprint": "fp_1", "prompt_token_ids": [5, 6],
            "choices": [{"message": {"role": "assistant", "content": "Hi"}, "token_ids": [7, 8],
                         "finish_reason": "stop",
                         "logprobs": {"content": [{"token": "H", "logprob": -0.1},
                                                  {"token": "i", "logprob": -0.2}]}}]}
    sample = parse_response(data, "chat/completions", 3)
    assert (sample.text, sample.token_ids, sample.prompt_token_ids) == ("Hi", (7, 8), (5, 6))
    assert sample.tokens == ("H", "i") and sample.logprobs == (-0.1, -0.2)
    assert sample.fingerprint == "fp_1"


# vLLM's response shapes, as the gateway's tests keep them.
VLLM_FIXTURES = Path(__file__).parent.parent / "gateway" / "fixtures"


def test_vllm_completion_shape_is_parsed():
    data = json.loads((VLLM_FIXTURES / "vllm_completion.json").read_text())
    sample = parse_response(data, "completions", 0)
    assert sample.token_ids == (12095, 13, 1084, 374)
    assert sample.prompt_token_ids == (785, 6722, 315, 9625, 374)
    assert sample.tokens == (" Paris", ".", " It", " is") and len(sample.logprobs) == 4
    assert sample.fingerprint is None


def test_vllm_chat_shape_is_parsed():
    data = json.loads((VLLM_FIXTURES / "vllm_chat.json").read_text())
    sample = parse_response(data, "chat/completions", 0)
    assert sample.text == "Hello! How can I help?"
    assert sample.tokens[:2] == ("Hello", "!") and sample.logprobs[4] == 0.0
    assert sample.token_ids is None or len(sample.token_ids) == len(sample.tokens)


def test_api_root():
    assert api_root("http://h:9001/v1") == "http://h:9001"
    assert api_root("http://h:9001/v1/") == "http://h:9001"
    assert api_root("https://api.example.com/openai") == "https://api.example.com/openai"
