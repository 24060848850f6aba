"""Secrets: after a run with keys and a worker URL holding a password (answers, streams, a
failing worker, replays), no API key and no password is in the gateway's log, /metrics, or any
Redis key or value; 502s name no worker address. Duplicate or empty keys refuse to start."""

from __future__ import annotations

import os
import subprocess

import openai
import pytest
import redis

from tests.support.procs import detgate_cmd

PASSWORD = "hunter2-WORKER-PASSWORD"
KEY_A = "sk-tenant-a-0123456789abcdef"
KEY_B = "sk-tenant-b-fedcba9876543210"
MODEL = "Qwen/Qwen3-8B"
MSG = [{"role": "user", "content": "hi"}]


def test_no_secret_in_logs_metrics_or_redis(start_gateway, vllm_worker):
    worker_url = vllm_worker.url.replace("http://", f"http://user:{PASSWORD}@")
    gw = start_gateway([worker_url], api_keys=f"a:{KEY_A},b:{KEY_B}")
    client = gw.client(KEY_A)
    answer = client.chat.completions.create(model=MODEL, messages=MSG)
    list(client.chat.completions.create(model=MODEL, messages=MSG, stream=True))
    gw.client(KEY_B).completions.create(model=MODEL, prompt="x")
    with gw.http(KEY_A) as http:
        assert http.post(f"/replay/{answer.id}", json={}).status_code == 200
        record = http.get(f"/v1/requests/{answer.id}").json()
        assert record["worker"] == vllm_worker.url  # the name: the URL without user-info
        vllm_worker.fail_status = 500
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG})
        vllm_worker.fail_status = None
        assert r.status_code == 502, r.text
        assert vllm_worker.url.removeprefix("http://") not in r.text and PASSWORD not in r.text
        metrics = http.get("/metrics").text
        http.get("/v1/requests")
    with pytest.raises(openai.AuthenticationError):
        gw.client("wrong-" + KEY_A).models.list()
    gw.proc.stop()

    dump = [gw.proc.log(), metrics]
    client = redis.Redis.from_url(gw.redis_url)
    try:
        for key in client.scan_iter(match=f"{gw.prefix}:*", count=1000):
            dump.append(key.decode())
            kind = client.type(key)
            if kind == b"string":
                dump.append(client.get(key).decode())
            elif kind == b"list":
                dump.extend(v.decode() for v in client.lrange(key, 0, -1))
            elif kind == b"zset":
                dump.extend(v.decode() for v in client.zrange(key, 0, -1))
    finally:
        client.close()
    text = "\n".join(dump)
    assert len(dump) > 5
    for secret in (PASSWORD, KEY_A, KEY_B):
        assert secret not in text


@pytest.mark.parametrize("keys", [f"a:{KEY_A},b:{KEY_A}", f"a:{KEY_A},,b:{KEY_B}", "a:",
                                  f"a: {KEY_A}", ","], ids=["duplicate", "empty entry",
                                                            "empty key", "spaces", "only comma"])
def test_bad_keys_refuse_to_start(keys):
    env = {**os.environ, "DETGATE_API_KEYS": keys, "DETGATE_PORT": "1"}
    proc = subprocess.run(detgate_cmd("gateway"), env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "DETGATE_API_KEYS" in proc.stderr
    assert KEY_A not in proc.stderr + proc.stdout and KEY_B not in proc.stderr + proc.stdout
