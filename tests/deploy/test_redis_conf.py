"""deploy/redis/redis.conf on a real redis-server: append-only file with fsync every second,
no eviction, a password required, and a record written before the process is killed survives
its restart."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis

from tests.deploy.conftest import DEPLOY
from tests.support.procs import free_port

CONF = DEPLOY / "redis" / "redis.conf"
PASSWORD = "test-password"


def start_redis(data: Path, port: int, *overrides: str) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed")
    # Command-line options follow the file, as in the compose service; `overrides` come last.
    args = [binary, str(CONF), "--dir", str(data), "--port", str(port), "--bind", "127.0.0.1"]
    proc = subprocess.Popen(
        [*args, "--requirepass", PASSWORD, *overrides],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, password=PASSWORD)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail("redis-server did not start with deploy/redis/redis.conf")
            time.sleep(0.05)
        finally:
            client.close()


def write_then_crash(data: Path, port: int, *overrides: str) -> None:
    proc = start_redis(data, port, *overrides)
    try:
        client = redis.Redis(port=port, password=PASSWORD)
        client.set("detgate:record:1", b"\x00bits\xff", ex=3600)
        client.close()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def read_after_restart(data: Path, port: int, *overrides: str) -> tuple[bytes | None, int]:
    proc = start_redis(data, port, *overrides)
    try:
        client = redis.Redis(port=port, password=PASSWORD)
        try:
            return client.get("detgate:record:1"), client.ttl("detgate:record:1")
        finally:
            client.close()
    finally:
        proc.terminate()
        proc.wait()


def test_redis_conf_sets_aof_everysec_noeviction_and_a_password(tmp_path):
    port = free_port()
    proc = start_redis(tmp_path, port)
    try:
        client = redis.Redis(port=port, password=PASSWORD)
        config = client.config_get("*")
        client.close()
        assert config["appendonly"] == "yes"
        assert config["appendfsync"] == "everysec"
        assert config["maxmemory-policy"] == "noeviction"
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
    finally:
        proc.terminate()
        proc.wait()


def test_a_record_survives_a_crash_of_redis(tmp_path):
    port = free_port()
    write_then_crash(tmp_path, port)
    value, ttl = read_after_restart(tmp_path, port)
    assert value == b"\x00bits\xff"
    assert 0 < ttl <= 3600


def test_without_the_append_only_file_the_record_is_lost(tmp_path):
    """Negative control: the same crash without the AOF (and without snapshots) loses it."""
    port = free_port()
    write_then_crash(tmp_path, port, "--appendonly", "no", "--save", "")
    assert read_after_restart(tmp_path, port, "--appendonly", "no", "--save", "") == (None, -2)
