"""`detgate bench gateway`: what the gateway adds, measured side by side in one run.

Three targets share one canned upstream (raw asyncio, see gateway_servers): the upstream
directly, a bare FastAPI passthrough with the same upstream client and one Redis SET, and
the gateway with validation, routing and full recording. For each: latency p50/p99 at one
connection, and requests/s at 16 and 32 connections. Then a check that the gateway stored
exactly one record per 2xx answer. The JSON goes to bench/results/ (and --json OUT).
"""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import orjson

from detgate.provenance import cpu_model, git_commit, utc_now, versions

REQUEST = orjson.dumps({"model": "canned", "max_tokens": 16, "temperature": 0,
                        "messages": [{"role": "user", "content": "Say hello"}]})
LATENCY_REQUESTS = 2000
WARMUP = 200
THROUGHPUT_S = 4.0
CONCURRENCY = (16, 32)
REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("fastapi", "starlette", "uvicorn", "uvloop", "httptools", "aiohttp", "redis",
            "hiredis", "orjson", "pydantic")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], url: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(args, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    import httpx
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{args} did not become ready")


async def _latency(url: str) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        times = []
        for i in range(WARMUP + LATENCY_REQUESTS):
            t0 = time.perf_counter()
            async with s.post(url, data=REQUEST,
                              headers={"Content-Type": "application/json"}) as r:
                await r.read()
                assert r.status == 200, r.status
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
    times.sort()
    return {"p50_ms": 1e3 * statistics.median(times),
            "p99_ms": 1e3 * times[int(0.99 * len(times)) - 1],
            "mean_ms": 1e3 * statistics.fmean(times), "n": len(times)}


async def _throughput(url: str, concurrency: int) -> dict:
    counts = {"ok": 0, "other": 0}
    stop = time.perf_counter() + THROUGHPUT_S
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        async def loop() -> None:
            while time.perf_counter() < stop:
                async with s.post(url, data=REQUEST,
                                  headers={"Content-Type": "application/json"}) as r:
                    await r.read()
                    counts["ok" if r.status == 200 else "other"] += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    return {"rps": counts["ok"] / elapsed, "ok": counts["ok"], "non_2xx": counts["other"]}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a process: robust to other load on a shared machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(url: str, server_pid: int) -> dict:
    result = {"c1": await _latency(url)}
    cpu0 = _cpu_seconds(server_pid)
    for c in CONCURRENCY:
        result[f"c{c}"] = await _throughput(url, c)
    served = sum(result[f"c{c}"]["ok"] for c in CONCURRENCY)
    result["server_cpu_us_per_request"] = 1e6 * (_cpu_seconds(server_pid) - cpu0) / served
    return result


def _device(load_average: tuple[float, float, float]) -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(),
            "platform": platform.platform(),
            # Other work on the machine widens latency tails; CPU per request is robust to it.
            "load_average_at_start": load_average}


def _records(redis_url: str, prefix: str) -> int:
    import redis

    from gateway.keys import Keys
    client = redis.Redis.from_url(redis_url)
    try:
        count = client.zcard(Keys(prefix).index("default"))
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i:i + 500])
        return count
    finally:
        client.close()


def main(args) -> int:
    load_average = os.getloadavg()
    redis_url = os.environ.get("DETGATE_REDIS_URL", "redis://127.0.0.1:6379/15")
    prefix = f"detgate-bench-{secrets.token_hex(4)}"
    ports = {name: _free_port() for name in ("upstream", "passthrough", "gateway")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    py = sys.executable
    procs = []
    try:
        procs.append(_start([py, "-m", "detgate.bench.gateway_servers", "upstream",
                             "--port", str(ports["upstream"])], urls["upstream"] + "/health"))
        procs.append(_start([py, "-m", "detgate.bench.gateway_servers", "passthrough",
                             "--port", str(ports["passthrough"]), "--upstream", urls["upstream"],
                             "--redis-url", redis_url, "--prefix", prefix],
                            urls["passthrough"] + "/health"))
        procs.append(_start([py, "-m", "detgate.cli", "gateway"], urls["gateway"] + "/readyz", {
            "DETGATE_PORT": str(ports["gateway"]), "DETGATE_WORKERS": urls["upstream"],
            "DETGATE_REDIS_URL": redis_url, "DETGATE_KEY_PREFIX": prefix,
            "DETGATE_API_KEYS": ""}))
        results = {}
        for i, name in enumerate(("direct", "passthrough", "gateway")):
            target = urls["upstream" if name == "direct" else name]
            print(f"measuring {name} ...", flush=True)
            results[name] = asyncio.run(_measure(target + "/v1/chat/completions", procs[i].pid))
        gateway_2xx = WARMUP + LATENCY_REQUESTS + sum(
            results["gateway"][f"c{c}"]["ok"] for c in CONCURRENCY)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    stored = _records(redis_url, prefix)
    summary = _summary(results, gateway_2xx, stored)
    report = {"benchmark": "gateway", "date": utc_now(), "commit": git_commit(),
              "device": _device(load_average), "versions": versions(*PACKAGES),
              "request": orjson.loads(REQUEST), "results": results, "summary": summary}
    _print(summary)
    data = orjson.dumps(report, option=orjson.OPT_INDENT_2)
    out_dir = REPO / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    (out_dir / f"gateway-{stamp}.json").write_bytes(data)
    if args.json:
        Path(args.json).write_bytes(data)
    return 0 if summary["records_match_2xx"] else 1


def _summary(results: dict, gateway_2xx: int, stored: int) -> dict:
    d, p, g = (results[k] for k in ("direct", "passthrough", "gateway"))
    out = {
        "added_p50_ms_vs_direct": {"passthrough": p["c1"]["p50_ms"] - d["c1"]["p50_ms"],
                                   "gateway": g["c1"]["p50_ms"] - d["c1"]["p50_ms"]},
        "added_p99_ms_vs_direct": {"passthrough": p["c1"]["p99_ms"] - d["c1"]["p99_ms"],
                                   "gateway": g["c1"]["p99_ms"] - d["c1"]["p99_ms"]},
        "gateway_over_passthrough_p50_ms": g["c1"]["p50_ms"] - p["c1"]["p50_ms"],
        "c1_p50_ratio_gateway_to_passthrough": g["c1"]["p50_ms"] / p["c1"]["p50_ms"],
        "gateway_2xx": gateway_2xx, "records_stored": stored,
        "records_match_2xx": gateway_2xx == stored,
    }
    out["server_cpu_us_per_request"] = {k: results[k]["server_cpu_us_per_request"]
                                        for k in results}
    out["cpu_ratio_gateway_to_passthrough"] = (g["server_cpu_us_per_request"]
                                               / p["server_cpu_us_per_request"])
    for c in CONCURRENCY:
        out[f"rps_c{c}"] = {k: results[k][f"c{c}"]["rps"] for k in results}
        out[f"rps_ratio_gateway_to_passthrough_c{c}"] = (
            g[f"c{c}"]["rps"] / p[f"c{c}"]["rps"])
    return out


def _print(summary: dict) -> None:
    a50, a99 = summary["added_p50_ms_vs_direct"], summary["added_p99_ms_vs_direct"]
    print(f"added latency at c=1 vs direct: passthrough p50 {a50['passthrough']:.2f} ms "
          f"p99 {a99['passthrough']:.2f} ms | gateway p50 {a50['gateway']:.2f} ms "
          f"p99 {a99['gateway']:.2f} ms")
    for c in CONCURRENCY:
        r = summary[f"rps_c{c}"]
        print(f"req/s at c={c}: direct {r['direct']:.0f}, passthrough {r['passthrough']:.0f}, "
              f"gateway {r['gateway']:.0f} (gateway/passthrough "
              f"{summary[f'rps_ratio_gateway_to_passthrough_c{c}']:.2f})")
    cpu = summary["server_cpu_us_per_request"]
    print(f"server CPU per request: upstream {cpu['direct']:.0f} us, passthrough "
          f"{cpu['passthrough']:.0f} us, gateway {cpu['gateway']:.0f} us (gateway/passthrough "
          f"{summary['cpu_ratio_gateway_to_passthrough']:.2f})")
    print(f"records stored {summary['records_stored']} / gateway 2xx {summary['gateway_2xx']}: "
          f"{'OK' if summary['records_match_2xx'] else 'MISMATCH'}")
