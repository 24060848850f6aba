"""The recorder against the real Redis (db 15, a key prefix of its own)."""

from __future__ import annotations

import math
import random
import secrets
import struct

import pytest
import redis as sync_redis

from detgate.gateway.errors import RecorderUnavailable
from detgate.gateway.recorder import Recorder, now
from detgate.gateway.store import RedisTarget, Store
from tests.support.floats import bits


@pytest.fixture
async def recorder(redis_url):
    prefix = f"detgate-test-{secrets.token_hex(4)}"
    rec = Recorder(Store(RedisTarget.parse(redis_url), timeout_s=1.0), prefix=prefix,
                   ttl_s=3600, retry_after_s=1)
    yield rec
    await rec.close()
    client = sync_redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def make_record(record_id: str, logprobs: list[float], created: float | None = None) -> dict:
    return {"id": record_id, "created": created or now(), "endpoint": "/v1/completions",
            "model": "m", "request": {"model": "m", "prompt": "p", "seed": 7},
            "worker": "http://w", "system_fingerprint": "fp_x", "status": "complete",
            "choices": [{"index": 0, "text": "t", "finish_reason": "length",
                         "token_ids": list(range(len(logprobs))), "logprobs": logprobs}],
            "usage": {"prompt_tokens": 1, "completion_tokens": len(logprobs),
                      "total_tokens": 1 + len(logprobs)}}


def awkward_floats() -> list[float]:
    """Doubles whose decimal text is easy to get wrong: subnormals, float32 values widened
    to double, values a float32 round trip would change, -0.0, extremes."""
    rng = random.Random(0)
    out = [-0.0, 0.0, -5e-324, -2.2250738585072014e-308, -1.7976931348623157e308,
           -1.1920928955078125e-07, -0.1, -1 / 3, -math.pi]
    out += [-struct.unpack("<f", struct.pack("<f", rng.random() * 20))[0] for _ in range(200)]
    out += [-rng.random() * 30 for _ in range(200)]
    out += [-struct.unpack("<d", rng.randbytes(8))[0] % 50.0 for _ in range(100)]
    return out


async def test_logprobs_round_trip_bit_for_bit(recorder):
    floats = awkward_floats()
    await recorder.save("t1", make_record("cmpl-a", floats))
    record, _ = await recorder.get("t1", "cmpl-a")
    got = record["choices"][0]["logprobs"]
    assert bits(got) == bits(floats)


async def test_every_key_has_a_ttl_and_the_write_is_indexed(recorder, redis_url):
    await recorder.save("t1", make_record("cmpl-a", [-1.0]))
    found = await recorder.get("t1", "cmpl-a")
    assert found is not None
    await recorder.add_replay("t1", "cmpl-a", {"replay_id": "rpl-1", "match": True}, found[1])
    client = sync_redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{recorder.keys.prefix}:*"))
    assert len(keys) == 5  # record, index, replays, stored bytes, expiries
    for key in keys:
        assert 0 < client.ttl(key) <= 3600, key
    client.close()
    record, _ = await recorder.get("t1", "cmpl-a")
    assert record["replays"] == [{"replay_id": "rpl-1", "match": True}]


async def test_tenants_do_not_see_each_other(recorder):
    await recorder.save("alice", make_record("cmpl-a", [-1.0]))
    assert await recorder.get("bob", "cmpl-a") is None
    assert (await recorder.list("bob", 10)).data == []
    assert [r["id"] for r in (await recorder.list("alice", 10)).data] == ["cmpl-a"]


async def test_list_is_newest_first_and_limited(recorder):
    for i in range(5):
        await recorder.save("t1", make_record(f"cmpl-{i}", [-1.0], created=now() - 10 + i))
    ids = [r["id"] for r in (await recorder.list("t1", 3)).data]
    assert ids == ["cmpl-4", "cmpl-3", "cmpl-2"]


async def test_list_pages_with_after_and_filters_past_a_short_page(recorder):
    for i in range(7):
        await recorder.save("t1", make_record(f"cmpl-{i}", [-1.0], created=now() - 10 + i))
    first = await recorder.list("t1", 3)
    assert [r["id"] for r in first.data] == ["cmpl-6", "cmpl-5", "cmpl-4"] and first.has_more
    second = await recorder.list("t1", 3, after=first.last_id)
    assert [r["id"] for r in second.data] == ["cmpl-3", "cmpl-2", "cmpl-1"] and second.has_more
    last = await recorder.list("t1", 3, after=second.last_id)
    assert [r["id"] for r in last.data] == ["cmpl-0"] and not last.has_more
    assert await recorder.list("t1", 3, after="cmpl-unknown") is None
    odd = lambda r: int(r["id"].rsplit("-", 1)[1]) % 2 == 1
    page = await recorder.list("t1", 2, keep=odd)
    assert [r["id"] for r in page.data] == ["cmpl-5", "cmpl-3"] and page.has_more
    page = await recorder.list("t1", 2, after=page.last_id, keep=odd)
    assert [r["id"] for r in page.data] == ["cmpl-1"] and not page.has_more
    recorder.max_scan = 2  # a page that stops scanning early still says where to go on
    page = await recorder.list("t1", 5, keep=odd)
    assert [r["id"] for r in page.data] == ["cmpl-5"]
    assert page.last_id == "cmpl-5" and page.has_more


async def test_listing_drops_index_entries_older_than_the_ttl(recorder):
    await recorder.save("t1", make_record("cmpl-old", [-1.0], created=now() - 3600 - 60))
    await recorder.save("t1", make_record("cmpl-new", [-1.0]))
    assert [r["id"] for r in (await recorder.list("t1", 10)).data] == ["cmpl-new"]
    assert await recorder.store.call("ZRANGE", recorder.keys.index("t1"), 0, -1) \
        == [b"cmpl-new"]


async def test_redis_down_marks_unavailable_with_retry_after():
    rec = Recorder(Store(RedisTarget.parse("redis://127.0.0.1:1/0"), timeout_s=0.5), prefix="x",
                   ttl_s=60, retry_after_s=2)
    with pytest.raises(RecorderUnavailable) as info:
        await rec.save("t", make_record("cmpl-z", [-1.0]))
    assert info.value.headers["Retry-After"] == "2"
    assert rec.up is False
    with pytest.raises(RecorderUnavailable):
        rec.ensure_up()
    await rec.close()
