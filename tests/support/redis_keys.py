"""The Redis keys a test's gateway wrote: every test runs under a key prefix of its own."""

from __future__ import annotations

import redis


def keys_under(redis_url: str, prefix: str) -> list[bytes]:
    client = redis.Redis.from_url(redis_url)
    try:
        return list(client.scan_iter(match=f"{prefix}:*", count=1000))
    finally:
        client.close()


def delete_prefix(redis_url: str, *prefixes: str) -> None:
    """Remove what the tests under these prefixes left in Redis."""
    client = redis.Redis.from_url(redis_url)
    try:
        for prefix in prefixes:
            keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
            if keys:
                client.delete(*keys)
    finally:
        client.close()
