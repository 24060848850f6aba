"""DETGATE_REDIS_URL's forms (gateway/store.py) and the keys' layout (gateway/keys.py): what
each URL asks for, the mistakes refused at start, every key of a tenant on one hash slot."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot
from redis.exceptions import RedisError

from detgate.gateway.config import Settings
from detgate.gateway.keys import Keys
from detgate.gateway.store import CLUSTER, SENTINEL, STANDALONE, ClientFailure, RedisTarget, _Slot


@pytest.mark.parametrize(("url", "expected"), [
    ("redis://127.0.0.1:6379/0", {"mode": STANDALONE}),
    ("rediss://:pw@cache.internal:6380/2", {"mode": STANDALONE}),
    ("unix:///run/redis.sock?db=3", {"mode": STANDALONE}),
    ("redis+cluster://10.0.0.1:7000,10.0.0.2:7001,10.0.0.3", {
        "mode": CLUSTER, "nodes": (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("10.0.0.3", 6379)),
        "tls": False, "password": None}),
    ("rediss+cluster://default:s%40cret@[::1]:7000/0", {
        "mode": CLUSTER, "nodes": (("::1", 7000),), "tls": True, "username": "default",
        "password": "s@cret"}),
    ("redis+sentinel://:pw@s1:26380,s2/mymaster", {
        "mode": SENTINEL, "nodes": (("s1", 26380), ("s2", 26379)), "master": "mymaster",
        "db": 0, "password": "pw", "sentinel_auth": {}}),
    ("redis+sentinel://s1/mymaster/4?sentinel_password=spw", {
        "mode": SENTINEL, "master": "mymaster", "db": 4, "password": None,
        "sentinel_auth": {"sentinel_password": "spw"}}),
])
def test_url_forms(url: str, expected: dict) -> None:
    target = RedisTarget.parse(url)
    for field, value in expected.items():
        assert getattr(target, field) == value, field
    assert target.replicated == (target.mode != STANDALONE)


@pytest.mark.parametrize("url", [
    "redis+shard://h:1",  # no such form
    "http+cluster://h:1",
    "redis+cluster://",  # no host
    "redis+cluster://h:1/3",  # a cluster has database 0 only
    "redis+cluster://h:1?ssl_cert_reqs=none",  # options are not passed on silently
    "redis+cluster://h:99999",
    "redis+sentinel://s1",  # no master name
    "redis+sentinel://s1/m/x",  # a database is a number
    "redis+sentinel://s1/m?password=x",  # the master's password goes in the user-info
])
def test_bad_urls_stop_the_start(url: str, monkeypatch) -> None:
    with pytest.raises(ValueError):
        RedisTarget.parse(url)
    monkeypatch.setenv("DETGATE_REDIS_URL", url)
    with pytest.raises(ValueError):
        Settings()


def test_replicas_are_waited_for_where_there_are_replicas(monkeypatch) -> None:
    assert Settings(redis_url="redis://127.0.0.1:6379/0").wait_replicas == 0
    assert Settings(redis_url="redis+cluster://h:7000").wait_replicas == 1
    assert Settings(redis_url="redis+sentinel://s/m").wait_replicas == 1
    assert Settings(redis_url="redis+sentinel://s/m", redis_wait_replicas=0).wait_replicas == 0
    assert "pw" not in repr(Settings(redis_url="redis://:pw@h:6379/0"))


def test_every_key_of_a_tenant_is_on_one_slot() -> None:
    keys = Keys("detgate")
    for tenant in ("default", "team-a", "t.1_x"):
        names = [keys.record(tenant, "chatcmpl-1"), keys.replays(tenant, "chatcmpl-1"),
                 keys.index(tenant), keys.stored(tenant), keys.expiries(tenant),
                 keys.rates(tenant), keys.drift(tenant), keys.refusals(tenant)]
        assert {key_slot(n.encode()) for n in names} == {key_slot(tenant.encode())}, names
        assert all(n.startswith("detgate:") for n in names)
    # Negative control: without the tag the same keys land all over the slots.
    assert len({key_slot(f"detgate:{kind}:default".encode())
                for kind in ("rec", "idx", "sto", "exp", "lim", "drf", "ref")}) > 1
    with pytest.raises(ValueError):
        Keys("detgate{x}")


class _HalfTornWriter:
    """A stream writer as a teardown racing a write left it on the Pythons of redis-py issue
    4287 (3.12, 3.13.0-3.13.9, 3.14.0): its transport still says it is open, yet the write
    fails inside the client with AttributeError. redis-py 8.2 checks for a cleared writer
    first, so a real connection no longer shows it; this one does on every version."""

    def __init__(self, transport) -> None:
        self.transport = transport


async def test_a_write_on_a_torn_down_connection_is_a_redis_failure(redis_url) -> None:
    """redis-py issues 3546 / 4287: a connection that another task has just torn down (a killed
    cluster master, under load) raises AttributeError or TypeError on its next write instead
    of ConnectionError. Inside a command's slot that is a failure of Redis (ClientFailure,
    which the recorder spools on, as on every RedisError); the same error raised by our own code
    in the slot stays what it is. On a real connection: its writer cleared as the teardown
    leaves it (a RedisError from redis-py 8.2 on, ClientFailure before), then half torn."""
    conn = aioredis.ConnectionPool.from_url(redis_url).make_connection()
    await conn.connect()
    writer = conn._writer
    ping = [b"*1\r\n$4\r\nPING\r\n"]
    try:
        conn._writer = None
        with pytest.raises(RedisError):  # ConnectionError, or ClientFailure before 8.2
            async with _Slot(None):
                await conn._send_packed_command(ping)
        conn._writer = _HalfTornWriter(writer.transport)
        with pytest.raises(ClientFailure, match="AttributeError.*writelines"):
            async with _Slot(None):
                await conn._send_packed_command(ping)
        # Negative control: the same error from our own code in the slot is not Redis's.
        with pytest.raises(AttributeError):
            async with _Slot(None):
                writer_of_nothing = None
                writer_of_nothing.writelines([])  # type: ignore[attr-defined]
    finally:
        conn._writer = writer
        await conn.disconnect()
