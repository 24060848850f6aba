"""Bounded summaries of records: what is stored for a refused request (over a tenant limit)
or one its worker rejected (4xx), and in place of a record over the tenant's maximum size.

A summary keeps what identifies and accounts for the request (id, endpoint, model, worker,
fingerprint, status, usage, finish reasons, the request's short scalar fields) and replaces
the rest (prompt, messages, generated text, token ids, logprobs) by its size and SHA-256, so
that its size is bounded whatever was sent: at most about 4 KiB. A summarised record cannot
be replayed.
"""

from __future__ import annotations

import hashlib

import orjson

MAX_FIELDS = 24  # request fields kept
MAX_FIELD_BYTES = 64  # a kept field's JSON; longer ones are replaced by their size and hash
MAX_TEXT = 256  # error message, model name (characters)


def _digest(value: object) -> dict:
    data = orjson.dumps(value)
    return {"omitted_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def summarise(record: dict, reason: str, size: int, limit: int | None = None) -> dict:
    """`record` reduced to a bounded summary; `reason` is why, `size` the full record's bytes."""
    request = {}
    for name, value in list(record.get("request", {}).items())[:MAX_FIELDS]:
        small = len(orjson.dumps(value)) <= MAX_FIELD_BYTES and len(name) <= MAX_FIELD_BYTES
        request[name[:MAX_FIELD_BYTES]] = value if small else _digest(value)
    choices = [{"index": c.get("index", 0), "text": "",
                "finish_reason": str(c.get("finish_reason"))[:32]
                if c.get("finish_reason") is not None else None,
                "token_ids": [], "logprobs": []}
               for c in record.get("choices", [])[:16]]
    out = {"id": record["id"], "created": record["created"], "endpoint": record["endpoint"],
           "model": str(record.get("model"))[:MAX_TEXT], "request": request,
           "worker": record.get("worker"), "system_fingerprint": record.get("system_fingerprint"),
           "status": record["status"], "choices": choices, "usage": record.get("usage"),
           "summary": {"reason": reason, "record_bytes": size}}
    if limit is not None:
        out["summary"]["max_record_bytes"] = limit
    if record.get("error") is not None:
        out["error"] = str(record["error"])[:MAX_TEXT]
    return out
