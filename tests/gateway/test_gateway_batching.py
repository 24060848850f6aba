"""Record writes batched per event-loop turn (gateway/batching.py), against real Redis: the
shared one (db 15, a key prefix of its own) or, where a test flushes scripts or waits for
replicas, a redis-server of its own.

Writes queued in one turn share one round trip, yet each caller gets its own script's reply
(the running byte totals prove which one); writes sent one after another each take their
own (the control that the round-trip count means something). A script error fails only its
own write; a failed round trip fails every write of the batch, and the recorder then refuses
each (no spool here) as it did for single writes; a flushed script cache is mended; too few
replicas raise NotReplicated for each write; a cancelled caller's write still lands."""

from __future__ import annotations

import asyncio
import secrets

import pytest
import redis as sync_redis
from redis.exceptions import ResponseError

from detgate.gateway import batching
from detgate.gateway.batching import WriteBatch
from detgate.gateway.errors import RecorderUnavailable
from detgate.gateway.recorder import Recorder, dumps, now
from detgate.gateway.store import NotReplicated, RedisTarget, Store
from tests.support.procs import free_port
from tests.support.redis_keys import delete_prefix
from tests.support.redis_servers import Server, _base_args, missing_tools


def make_record(record_id: str, text: str) -> dict:
    return {"id": record_id, "created": now(), "endpoint": "/v1/completions", "model": "m",
            "request": {"model": "m", "prompt": "p", "seed": 7}, "worker": "http://w",
            "system_fingerprint": "fp_x", "status": "complete",
            "choices": [{"index": 0, "text": text, "finish_reason": "length",
                         "token_ids": [1], "logprobs": [-0.5]}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


class RoundTrips:
    """Counts the batcher's round trips (each one write of commands and their replies)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        original = batching._exchange

        async def exchange(conn, commands):
            self.count += 1
            return await original(conn, commands)

        monkeypatch.setattr(batching, "_exchange", exchange)


@pytest.fixture
async def recorder(redis_url):
    prefix = f"detgate-test-{secrets.token_hex(4)}"
    rec = Recorder(Store(RedisTarget.parse(redis_url), timeout_s=2.0), prefix=prefix,
                   ttl_s=3600, retry_after_s=1)
    yield rec
    await rec.close()
    delete_prefix(redis_url, prefix)


@pytest.fixture
def own_redis(tmp_path):
    if missing_tools():
        pytest.skip(missing_tools())
    port = free_port()
    server = Server(port, tmp_path / "redis", _base_args(port)).start()
    yield server
    server.stop()


async def test_writes_of_one_turn_share_one_round_trip_each_with_its_own_reply(recorder,
                                                                            monkeypatch):
    trips = RoundTrips(monkeypatch)
    records = [make_record(f"cmpl-{i}", "x" * (i * 37)) for i in range(20)]
    stored = await asyncio.gather(*(recorder.save("t1", r) for r in records))
    assert trips.count == 1
    # Each reply is the tenant's total right after its own write: the running sum in order.
    sizes = [len(dumps(r)) for r in records]
    assert [s.total for s in stored] == [sum(sizes[:i + 1]) for i in range(20)]
    for r in records:
        found, _ = await recorder.get("t1", r["id"])
        assert found["choices"] == r["choices"]


async def test_control_writes_one_after_another_take_a_round_trip_each(recorder, monkeypatch):
    trips = RoundTrips(monkeypatch)
    for i in range(5):
        await recorder.save("t1", make_record(f"cmpl-{i}", "y"))
    assert trips.count == 5


async def test_a_script_error_fails_only_its_own_write(redis_url):
    store = Store(RedisTarget.parse(redis_url), timeout_s=2.0)
    batch = WriteBatch(store, 2.0)
    good = store.script("return redis.call('SET', KEYS[1], ARGV[1], 'EX', 60)")
    bad = store.script("return redis.error_reply('refused by the test')")
    prefix = f"detgate-test-{secrets.token_hex(4)}"
    try:
        results = await asyncio.gather(
            batch.run(good, [f"{prefix}:a"], ["1"]), batch.run(bad, [f"{prefix}:b"], []),
            batch.run(good, [f"{prefix}:c"], ["3"]), return_exceptions=True)
        assert results[0] == b"OK" and results[2] == b"OK"
        assert isinstance(results[1], ResponseError) and "refused by the test" in str(results[1])
        assert await store.client.mget(f"{prefix}:a", f"{prefix}:c") == [b"1", b"3"]
    finally:
        await batch.close()
        await store.aclose()
        delete_prefix(redis_url, prefix)


async def test_a_failed_round_trip_fails_every_write_and_each_is_refused():
    dead = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    rec = Recorder(Store(RedisTarget.parse(dead), timeout_s=0.5), prefix="p", ttl_s=60,
                   retry_after_s=1)
    try:
        results = await asyncio.gather(*(rec.save("t1", make_record(f"cmpl-{i}", "z"))
                                         for i in range(4)), return_exceptions=True)
        assert all(isinstance(r, RecorderUnavailable) for r in results), results
        assert not rec.up
    finally:
        await rec.close()


async def test_a_flushed_script_cache_is_loaded_again(own_redis):
    url = f"redis://127.0.0.1:{own_redis.port}/0"
    rec = Recorder(Store(RedisTarget.parse(url), timeout_s=2.0), prefix="p", ttl_s=60,
                   retry_after_s=1)
    try:
        await rec.save("t1", make_record("cmpl-first", "a"))
        with own_redis.client() as client:
            client.script_flush()
        await asyncio.gather(*(rec.save("t1", make_record(f"cmpl-{i}", "b"))
                               for i in range(5)))
        for i in range(5):
            assert (await rec.get("t1", f"cmpl-{i}")) is not None
    finally:
        await rec.close()


async def test_too_few_replicas_raise_not_replicated_for_each_write(own_redis):
    store = Store(RedisTarget.parse(f"redis://127.0.0.1:{own_redis.port}/0"), timeout_s=2.0,
                  wait_replicas=1, wait_timeout_ms=20)
    batch = WriteBatch(store, 2.0)
    script = store.script("return redis.call('SET', KEYS[1], ARGV[1])")
    try:
        results = await asyncio.gather(*(batch.run(script, [f"k{i}"], [str(i)])
                                         for i in range(3)), return_exceptions=True)
        assert all(isinstance(r, NotReplicated) and r.reply == b"OK" for r in results)
        assert await store.client.mget("k0", "k1", "k2") == [b"0", b"1", b"2"]  # on the master
    finally:
        await batch.close()
        await store.aclose()


async def test_a_cancelled_caller_does_not_cancel_the_batch(redis_url):
    store = Store(RedisTarget.parse(redis_url), timeout_s=2.0)
    batch = WriteBatch(store, 2.0)
    script = store.script("return redis.call('SET', KEYS[1], ARGV[1], 'EX', 60)")
    prefix = f"detgate-test-{secrets.token_hex(4)}"
    try:
        tasks = [asyncio.create_task(batch.run(script, [f"{prefix}:{i}"], [str(i)]))
                 for i in range(3)]
        await asyncio.sleep(0)  # every task has queued its write; the batch is not sent yet
        tasks[1].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert results[0] == results[2] == b"OK"
        assert isinstance(results[1], asyncio.CancelledError)
        await asyncio.sleep(0.2)
        client = sync_redis.Redis.from_url(redis_url)
        assert client.get(f"{prefix}:1") == b"1"
        client.close()
    finally:
        await batch.close()
        await store.aclose()
        delete_prefix(redis_url, prefix)


def test_commands_are_packed_as_redis_py_packs_them():
    from redis.asyncio.connection import Connection

    command = ("EVALSHA", "a" * 40, 2, "p:{t}:cmpl-1", "p:{t}:index", b"\x00" * 7000,
               604800, "cmpl-1", 1764500000.123, -0.0, 1e-300, "ünïcode", 0)
    assert batching._pack(command) == b"".join(Connection().pack_command(*command))
    with pytest.raises(TypeError):
        batching._pack(("SET", "k", None))
