"""API keys and tenants: 401 without a valid key, another tenant's record is a plain 404,
keys never appear in logs, open mode only on loopback."""

from __future__ import annotations

import os
import subprocess

import pytest

from detgate.gateway.auth import Authenticator
from detgate.gateway.errors import Unauthorized
from tests.support.procs import detgate_cmd

KEYS = "alice:sk-alice-0123456789,bob:sk-bob-9876543210"
MODEL = "Qwen/Qwen3-8B"


def test_authenticator_keeps_only_hashes():
    auth = Authenticator.from_pairs(KEYS.split(","))
    assert "sk-alice" not in repr(auth)
    assert auth.tenant("Bearer sk-alice-0123456789") == "alice"
    assert auth.tenant("Bearer sk-bob-9876543210") == "bob"
    # The scheme is case-insensitive (RFC 9110); the key is not.
    for scheme in ("bearer", "BEARER", "BeArEr"):
        assert auth.tenant(f"{scheme} sk-alice-0123456789") == "alice"
    for header in (None, "", "Bearer ", "Bearer sk-alice", "Basic sk-alice-0123456789",
                   "sk-alice-0123456789", "Bearer SK-ALICE-0123456789", "bearer"):
        with pytest.raises(Unauthorized):
            auth.tenant(header)


def test_malformed_key_pairs_are_refused_without_echoing_them():
    with pytest.raises(ValueError) as info:
        Authenticator.from_pairs(["no-colon-secret"])
    assert "no-colon-secret" not in str(info.value)


def test_open_mode_is_refused_off_loopback():
    env = {"DETGATE_HOST": "0.0.0.0", "DETGATE_API_KEYS": "", "DETGATE_PORT": "1"}
    done = subprocess.run(detgate_cmd("gateway"), env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "loopback" in done.stderr


@pytest.fixture
def keyed(start_gateway, vllm_worker):
    return start_gateway([vllm_worker.url], api_keys=KEYS)


def test_missing_and_wrong_keys_get_401(keyed):
    for key in (None, "sk-nobody"):
        with keyed.http(key) as http:
            for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                                 ("GET", "/v1/requests"), ("POST", "/replay/chatcmpl-x")):
                r = http.request(method, path, json={"model": MODEL,
                                                     "messages": [{"role": "user",
                                                                   "content": "hi"}]})
                assert r.status_code == 401, (method, path, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"


def test_tenants_are_isolated(keyed, vllm_worker):
    alice = keyed.client("sk-alice-0123456789")
    answer = alice.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                   "content": "hi"}])
    rid = answer.id
    with keyed.http("sk-alice-0123456789") as http:
        assert http.get(f"/v1/requests/{rid}").status_code == 200
        assert [r["id"] for r in http.get("/v1/requests").json()["data"]] == [rid]
    with keyed.http("sk-bob-9876543210") as http:
        theirs = http.get(f"/v1/requests/{rid}")
        unknown = http.get("/v1/requests/chatcmpl-000000000000000000000000")
        assert theirs.status_code == unknown.status_code == 404
        assert (theirs.json()["error"]["message"].replace(rid, "ID")
                == unknown.json()["error"]["message"].replace("chatcmpl-" + "0" * 24, "ID"))
        assert http.post(f"/replay/{rid}", json={}).status_code == 404
        assert http.get("/v1/requests").json()["data"] == []
    assert "sk-alice" not in keyed.proc.log() and "sk-bob" not in keyed.proc.log()
    assert not any(b"sk-alice" in k for k in keyed.redis_keys())
