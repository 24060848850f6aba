"""Redis stopped with the spool off: the gateway answers 503 with Retry-After instead of
unrecordable answers, and recovers by itself once Redis is back. Uses its own redis-server,
never the shared one. (With the spool, see test_gateway_faults.py.)"""

from __future__ import annotations

import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from detgate.gateway.keys import Keys
from tests.support.procs import free_port

MODEL = "Qwen/Qwen3-8B"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


class OwnRedis:
    """`durable`: every write fsynced to its AOF before Redis answers, so that what it
    acknowledged survives kill -9 (the gateway's promise can be no stronger than its Redis')."""

    def __init__(self, tmp_path, durable: bool = False) -> None:
        self.port = free_port()
        self.dir = tmp_path
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.durable = durable

    def start(self) -> None:
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.durable \
            else ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             *aof, "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "own redis-server did not start"
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def kill(self) -> None:
        """kill -9: no shutdown, no save."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def own_redis(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    r = OwnRedis(tmp_path)
    r.start()
    yield r
    r.stop()


def test_redis_down_without_spool_gives_503_then_recovers(start_gateway, vllm_worker,
                                                          own_redis):
    gw = start_gateway([vllm_worker.url], redis=own_redis.url,
                       env={"DETGATE_SPOOL_MAX_BYTES": "0"})
    with gw.http() as http:
        assert http.post("/v1/chat/completions", json=BODY).status_code == 200

        own_redis.stop()
        seen_503 = None
        deadline = time.monotonic() + 30
        while seen_503 is None and time.monotonic() < deadline:
            r = http.post("/v1/chat/completions", json=BODY)
            assert r.status_code in (200, 503), r.text
            if r.status_code == 503:
                seen_503 = r
        assert seen_503 is not None
        assert int(seen_503.headers["Retry-After"]) >= 1
        assert seen_503.json()["error"]["code"] == "recorder_unavailable"
        assert http.get("/readyz").status_code == 503
        forwarded = len(vllm_worker.forwarded())
        assert http.post("/v1/chat/completions", json=BODY).status_code == 503
        assert len(vllm_worker.forwarded()) == forwarded  # refused before any work

        own_redis.start()
        deadline = time.monotonic() + 30
        while (r := http.post("/v1/chat/completions", json=BODY)).status_code != 200:
            assert r.status_code == 503 and time.monotonic() < deadline
            time.sleep(0.1)
        rid = r.json()["id"]
        assert http.get(f"/v1/requests/{rid}").json()["status"] == "complete"
        assert http.get("/readyz").status_code == 200


def test_a_restarted_redis_is_used_at_once_through_the_same_pool(start_gateway, vllm_worker,
                                                                 own_redis):
    """Redis restarted between two bursts (no health ping in between): every pooled
    connection is stale, and each command on one is sent once more on a new connection. All
    answers 200, recorded; before, 2-5 requests saw a false "redis unavailable" (503 with
    the spool off)."""
    gw = start_gateway([vllm_worker.url], redis=own_redis.url,
                       env={"DETGATE_SPOOL_MAX_BYTES": "0", "DETGATE_HEALTH_INTERVAL_S": "60"})

    def burst() -> list[int]:
        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda _: httpx.post(
                gw.url + "/v1/chat/completions", json=BODY, timeout=30).status_code, range(16)))

    assert burst() == [200] * 16  # the pool now holds several connections
    own_redis.stop()
    own_redis.start()
    assert burst() == [200] * 16
    assert "redis unavailable" not in gw.proc.log()
    assert gw.metric("detgate_records_total", result="stored") == 32


def test_shared_rates_fall_back_to_this_process_while_redis_is_down(start_gateway, vllm_worker,
                                                                   own_redis):
    """Rates kept in Redis do not make an outage unusable: with Redis stopped the gateway
    admits the tenant at its full rate from its own bucket (2 of a burst, then 429), spools
    the answers' records, and drains them once Redis is back."""
    gw = start_gateway([vllm_worker.url], redis=own_redis.url,
                       env={"DETGATE_TENANT_LIMITS": '{"default": {"requests_per_s": 2}}'})
    with gw.http() as http:
        own_redis.stop()
        codes = [http.post("/v1/chat/completions", json=BODY) for _ in range(6)]
        assert [r.status_code for r in codes[:2]] == [200, 200], codes[0].text
        assert [r.status_code for r in codes[2:]] == [429] * 4
        assert codes[2].json()["error"]["code"] == "requests_per_s_exceeded"
        assert gw.metric("detgate_records_total", result="spooled") == 2
        own_redis.start()
        deadline = time.monotonic() + 30
        while (ready := http.get("/readyz").json())["spool"]["records"] or not ready["redis"]:
            assert time.monotonic() < deadline, ready
            time.sleep(0.1)
        client = redis.Redis.from_url(own_redis.url)
        try:
            keys = Keys(gw.prefix)
            assert all(client.get(keys.record("default", r.json()["id"])) for r in codes[:2])
        finally:
            client.close()
