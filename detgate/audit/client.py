"""An async client for any OpenAI-compatible endpoint, as the audit needs it.

Asks for logprobs and, where the server accepts it, vLLM's `return_token_ids`; an endpoint
that rejects such an optional field (400/422) is asked again without it, and the client
remembers. Overload answers (429, 502-504) and dropped connections are retried with
exponential backoff, honouring Retry-After, but never past the audit's deadline.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from dataclasses import dataclass, field

import httpx

from detgate.audit.sample import Sample

RETRY_STATUSES = frozenset({429, 502, 503, 504})
REJECTED_STATUSES = frozenset({400, 422})
# Optional request fields, dropped in this order when an endpoint rejects them.
OPTIONAL_FIELDS = ("return_token_ids", "logprobs")
BACKOFF_BASE_S = 0.25
BACKOFF_CAP_S = 8.0


class AuditRequestError(Exception):
    """A request that failed for good: not retryable, out of retries, or out of time."""

    def __init__(self, message: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


@dataclass
class Deadline:
    """The audit's overall time bound; every wait and every request timeout fits inside it."""

    seconds: float
    start: float = field(default_factory=time.monotonic)

    def remaining(self) -> float:
        return self.seconds - (time.monotonic() - self.start)


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    max_tokens: int
    temperature: float
    seed: int | None


@dataclass
class ClientStats:
    requests: int = 0
    retries: int = 0
    dropped_fields: list[str] = field(default_factory=list)


def api_root(base_url: str) -> str:
    """The server root behind an OpenAI SDK base_url: http://h:9001/v1 -> http://h:9001."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def retry_after_s(response: httpx.Response) -> float | None:
    """Retry-After as seconds (delta-seconds or an HTTP date), None when absent or unreadable."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class EndpointClient:
    def __init__(self, base_url: str, api_key: str | None, model: str, endpoint: str,
                 retries: int, deadline: Deadline, pool_size: int,
                 request_timeout_s: float = 300.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.endpoint = endpoint
        self.retries = retries
        self.deadline = deadline
        self.request_timeout_s = request_timeout_s
        self.stats = ClientStats()
        self._dropped = 0
        self._http = httpx.AsyncClient(
            base_url=self.base_url + "/", headers=headers,
            limits=httpx.Limits(max_connections=pool_size, max_keepalive_connections=pool_size),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def complete(self, spec: RequestSpec, index: int) -> Sample:
        """One completion of `spec`, falling back to fewer optional fields when rejected."""
        while True:
            level = self._dropped
            try:
                data, attempts = await self._post_json(self.endpoint, self._body(spec, level))
            except AuditRequestError as exc:
                if rejects_field(exc, OPTIONAL_FIELDS[level:]):
                    self._drop(level)
                    continue
                raise
            try:
                return parse_response(data, self.endpoint, index, attempts)
            except (KeyError, IndexError, TypeError, AttributeError) as exc:
                raise AuditRequestError(f"not an OpenAI {self.endpoint} answer: {exc!r}") from exc

    async def score(self, token_ids: list[int], start: int) -> list[float]:
        """Teacher-forced logprobs of token_ids[start:] from the endpoint's /score route."""
        body = {"model": self.model, "token_ids": token_ids, "start": start}
        data, _ = await self._post_json("score", body)
        return [float(x) for x in data["logprobs"]]

    async def get_text(self, url: str) -> str | None:
        """A GET answered 200, else None (an endpoint without that route is not an error)."""
        try:
            timeout = max(0.1, min(10.0, self.deadline.remaining()))
            response = await self._http.get(url, timeout=timeout)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    def _drop(self, level: int) -> None:
        if self._dropped == level:
            self.stats.dropped_fields.append(OPTIONAL_FIELDS[level])
            self._dropped = level + 1

    def _body(self, spec: RequestSpec, dropped: int) -> dict:
        wanted = OPTIONAL_FIELDS[dropped:]
        body: dict = {"model": self.model, "max_tokens": spec.max_tokens,
                      "temperature": spec.temperature}
        if spec.seed is not None:
            body["seed"] = spec.seed
        if self.endpoint == "chat/completions":
            body["messages"] = [{"role": "user", "content": spec.prompt}]
            if "logprobs" in wanted:
                body["logprobs"] = True
        else:
            body["prompt"] = spec.prompt
            if "logprobs" in wanted:
                body["logprobs"] = 1
        if "return_token_ids" in wanted:
            body["return_token_ids"] = True
        return body

    async def _post_json(self, path: str, body: dict) -> tuple[dict, int]:
        """POST with retries; answers (json, attempts) or raises AuditRequestError."""
        attempt = 0
        while True:
            attempt += 1
            self.stats.requests += 1
            remaining = self.deadline.remaining()
            if remaining <= 0:
                raise AuditRequestError("the audit's time bound was reached")
            delay: float | None = None
            try:
                response = await self._http.post(
                    path, json=body, timeout=min(self.request_timeout_s, remaining))
            except httpx.TimeoutException as exc:
                raise AuditRequestError(f"timed out: {exc!r}") from exc
            except httpx.TransportError as exc:
                if attempt > self.retries:
                    raise AuditRequestError(f"connection failed: {exc!r}") from exc
            else:
                if response.status_code == 200:
                    try:
                        return response.json(), attempt
                    except ValueError as exc:
                        raise AuditRequestError(f"answer is not JSON: {exc}") from exc
                if response.status_code not in RETRY_STATUSES or attempt > self.retries:
                    raise AuditRequestError(_error_message(response), response.status_code,
                                            response.text)
                delay = retry_after_s(response)
            if delay is None:
                backoff = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (attempt - 1))
                delay = backoff * random.uniform(0.5, 1.0)
            if delay >= self.deadline.remaining():
                raise AuditRequestError("no time left to retry within the audit's time bound")
            self.stats.retries += 1
            await asyncio.sleep(delay)


def rejects_field(exc: AuditRequestError, fields: tuple[str, ...]) -> bool:
    """A 400/422 naming the first still-sent optional field: the endpoint does not take it.

    The name must appear in the answer, so that an unknown model or a bad prompt is not
    mistaken for a missing extension.
    """
    return bool(fields) and exc.status in REJECTED_STATUSES and fields[0] in exc.body


def _error_message(response: httpx.Response) -> str:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:300]
    return f"HTTP {response.status_code}: {message}"


def parse_response(data: dict, endpoint: str, index: int, attempts: int = 1) -> Sample:
    """An OpenAI-shaped completion or chat response -> Sample (first choice)."""
    choice = data["choices"][0]
    tokens = logprobs = None
    raw = choice.get("logprobs")
    if endpoint == "chat/completions":
        text = (choice.get("message") or {}).get("content") or ""
        if raw and raw.get("content") is not None:
            tokens = tuple(t["token"] for t in raw["content"])
            logprobs = tuple(t["logprob"] for t in raw["content"])
    else:
        text = choice.get("text", "")
        if raw and raw.get("tokens") is not None:
            tokens = tuple(raw["tokens"])
            logprobs = tuple(raw["token_logprobs"])
    token_ids = choice.get("token_ids")
    # vLLM puts prompt_token_ids on the choice for completions and on the response for chat.
    prompt_ids = choice.get("prompt_token_ids") or data.get("prompt_token_ids")
    return Sample(
        index=index, text=text,
        token_ids=tuple(token_ids) if token_ids is not None else None,
        tokens=tokens, logprobs=logprobs,
        prompt_token_ids=tuple(prompt_ids) if prompt_ids is not None else None,
        finish_reason=choice.get("finish_reason"), fingerprint=data.get("system_fingerprint"),
        attempts=attempts,
    )
