"""The HTTP edge with raw sockets: slow and silent connections are closed after the configured
timeouts while other clients are served; oversize headers, malformed HTTP and too many
connections are refused in the error shape; no redirects; Allow on 405; open mode's guard."""

from __future__ import annotations

import contextlib
import socket
import time

import httpx
import orjson
import pytest

from tests.gateway.test_gateway_inputs import assert_error_shape


@pytest.fixture(scope="module")
def gw(start_gateway_module, vllm_worker_module):
    return start_gateway_module([vllm_worker_module.url], env={
        "DETGATE_HEADER_TIMEOUT_S": "1", "DETGATE_BODY_TIMEOUT_S": "1",
        "DETGATE_KEEPALIVE_TIMEOUT_S": "1", "DETGATE_MAX_HEADER_BYTES": "8192",
        "DETGATE_MAX_CONNECTIONS": "40"})


def connect(gw) -> socket.socket:
    host, port = gw.url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    return s


def read_all(s: socket.socket, timeout: float = 10) -> bytes:
    s.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), orjson.loads(body)


def assert_shape(raw: bytes, status: int) -> dict:
    code, body = status_and_json(raw)
    assert code == status, raw[:300]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_silent_connection_is_closed_while_others_are_served(gw):
    silent = connect(gw)
    t0 = time.monotonic()
    assert httpx.get(gw.url + "/healthz", timeout=5).status_code == 200  # others: served
    assert read_all(silent) == b""  # closed, nothing said
    assert 0.5 < time.monotonic() - t0 < 8


def test_headers_sent_a_byte_at_a_time_are_cut_with_408(gw):
    s = connect(gw)
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100
    t0 = time.monotonic()
    s.settimeout(0.1)
    for byte in request:
        try:
            s.send(bytes([byte]))
        except OSError:
            break
        if time.monotonic() - t0 > 8:
            break
        time.sleep(0.05)
        try:
            if s.recv(65536, socket.MSG_PEEK):
                break
        except (TimeoutError, BlockingIOError):
            pass
    err = assert_shape(read_all(s), 408)
    assert err["code"] == "request_timeout"
    assert time.monotonic() - t0 < 8


def test_slow_body_gets_408(gw):
    s = connect(gw)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")
    err = assert_shape(read_all(s), 408)
    assert err["code"] == "request_timeout"


def test_idle_keepalive_connection_is_closed(gw):
    s = connect(gw)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    raw = read_all(s)  # the answer, then the close after the keep-alive timeout
    assert raw.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("size", [20_000, 50 << 20])
def test_oversize_headers_are_refused(gw, size):
    s = connect(gw)
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: "
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused midway
        s.sendall(head + b"a" * size + b"\r\n\r\n")
    err = assert_shape(read_all(s), 431)
    assert err["code"] == "headers_too_large"


def test_many_headers_in_one_packet_are_refused(gw):
    s = connect(gw)
    headers = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(100))
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + headers + b"\r\n")
    assert_shape(read_all(s), 431)


@pytest.mark.parametrize("request_bytes", [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"NOT HTTP AT ALL\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n",
], ids=["negative length", "length and chunked", "garbage", "header without colon"])
def test_malformed_http_is_answered_in_the_error_shape(gw, request_bytes):
    s = connect(gw)
    s.sendall(request_bytes)
    err = assert_shape(read_all(s), 400)
    assert err["code"] == "malformed_http"


def test_connection_cap_refuses_with_503_then_recovers(gw):
    held = [connect(gw) for _ in range(45)]
    try:
        time.sleep(0.2)
        s = connect(gw)
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert_shape(read_all(s), 503)
    finally:
        for h in held:
            h.close()
    time.sleep(0.3)
    assert httpx.get(gw.url + "/healthz", timeout=5).status_code == 200


def test_no_trailing_slash_redirect_and_allow_on_405(gw):
    with gw.http() as http:
        r = http.post("/v1/chat/completions/", json={}, headers={"Host": "localhost"})
        assert r.status_code == 404 and "location" not in r.headers
        assert_error_shape(r)
        r = http.get("/v1/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert_error_shape(r)


def test_open_mode_refuses_foreign_hosts_and_non_json_posts(gw):
    with gw.http() as http:
        r = http.get("/v1/requests", headers={"Host": "evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
        r = http.post("/v1/chat/completions/", json={}, headers={"Host": "evil.example"})
        assert r.status_code == 403 and "location" not in r.headers
        r = http.post("/v1/chat/completions", content=b'{"model": "x"}',
                      headers={"Content-Type": "text/plain"})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        r = http.post("/replay/x", content=b"load=1",
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 415
        for host in ("localhost:1", "127.0.0.1", "[::1]:8000", "app.localhost"):
            assert http.get("/healthz", headers={"Host": host}).status_code == 200, host


def test_openapi_document(gw):
    doc = httpx.get(gw.url + "/openapi.json", timeout=5).json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/chat/completions", "/v1/completions", "/v1/requests", "/replay/{record_id}",
            "/v1/score", "/readyz"} <= set(doc["paths"])


def test_oversize_chunked_body_is_cut_at_the_limit(gw):
    """A chunked body with no declared length, sent on and on: 413 once past the limit
    (1 MiB) and the connection closed, instead of reading all 200 MB first."""
    s = connect(gw)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 65536
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    sent = 0
    with contextlib.suppress(BrokenPipeError, ConnectionResetError, TimeoutError):
        s.settimeout(5)
        while sent < 200 << 20:
            s.sendall(framed)
            sent += len(chunk)
    raw = read_all(s)
    s.close()
    print(f"chunked body: {sent} bytes accepted before the connection closed")
    assert sent < 32 << 20  # the limit plus what socket buffers hold
    if raw:  # the 413 arrives unless the reset overtook it
        assert assert_shape(raw, 413)["code"] == "request_too_large"


def test_websocket_upgrade_gets_the_error_shape(gw):
    s = connect(gw)
    s.sendall(b"GET /v1/realtime HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\n"
              b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
              b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    raw = read_all(s)  # the answer, then the close after the 1 s keep-alive
    s.close()
    assert assert_shape(raw, 404)["type"] == "invalid_request_error"
    assert b"content-type: application/json" in raw.lower()
