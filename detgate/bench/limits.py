"""`detgate bench limits`: what a tenant's rate limits cost the gateway, per mode, side by side.

Three gateway processes in front of one canned upstream (gateway_servers.py) and one Redis
of the benchmark's own (a redis-server on a free port, so that its CPU is the gateway's
alone): `none` (the tenant has no limits: no limit check at all), `process`
(DETGATE_RATE_LIMITS=process: requests/s and tokens/s in the gateway's memory) and `redis`
(the default: the same limits as one script in Redis per request, tokens charged in the
record's write). The limits are set far above the load, so that every request is admitted
and all three do the same work otherwise. Rounds are interleaved (none, process, redis,
none, ...): requests/s at 16 connections (4 s), the gateway's and Redis' CPU per request, latency
at one connection; the medians over rounds, and their ratios, go to bench/results/.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson
import redis

from detgate import procs
from detgate.bench.gateway import REQUEST, _cpu_seconds, _device, _throughput
from detgate.contract.provenance import git_commit, utc_now, versions

MODES = ("none", "process", "redis")
LIMITS = orjson.dumps({"*": {"requests_per_s": 1e9, "tokens_per_s": 1e12}}).decode()
PACKAGES = ("fastapi", "starlette", "uvicorn", "redis", "hiredis", "orjson")
REPO = Path(__file__).resolve().parents[2]


def register_args(p) -> None:
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every mode")
    p.add_argument("--latency-requests", type=int, default=300,
                   help="requests at one connection per round")
    p.add_argument("--json", default=None, help="write the result JSON here")


async def _latency_p50_ms(url: str, n: int) -> float:
    times = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        for _ in range(n):
            t0 = time.perf_counter()
            async with s.post(url, data=REQUEST,
                              headers={"Content-Type": "application/json"}) as r:
                await r.read()
                assert r.status == 200, r.status
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _wait_for(client: redis.Redis) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return info["used_cpu_user"] + info["used_cpu_sys"]


def _round(url: str, pid: int, client: redis.Redis, n_latency: int) -> dict:
    gateway0, redis0 = _cpu_seconds(pid), _redis_cpu(client)
    run = asyncio.run(_throughput(url, 16))
    served = run["ok"]
    out = {"rps_c16": run["rps"], "non_2xx": run["non_2xx"],
           "gateway_cpu_us_per_request": 1e6 * (_cpu_seconds(pid) - gateway0) / served,
           "redis_cpu_us_per_request": 1e6 * (_redis_cpu(client) - redis0) / served}
    out["p50_ms_c1"] = asyncio.run(_latency_p50_ms(url, n_latency))
    return out


def main(args) -> int:
    if shutil.which("redis-server") is None:
        print("detgate bench limits needs redis-server (its own, to measure Redis' CPU)")
        return 2
    load_average = os.getloadavg()
    py = sys.executable
    ports: dict[str, int] = {}
    for name in ("redis-server", "upstream", *MODES):
        while (port := procs.free_port()) in ports.values():  # the OS may hand one out twice
            pass
        ports[name] = port
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    redis_url = f"redis://127.0.0.1:{ports['redis-server']}/0"
    children: list[subprocess.Popen] = []
    client = redis.Redis.from_url(redis_url)
    with tempfile.TemporaryDirectory() as state:
        logs = Path(state)

        def start(name: str, args: list[str], ready: str, env: dict | None = None) -> int:
            child = procs.start(args, logs / f"{name}.log", env)
            children.append(child)
            try:
                procs.wait_http(child, urls[name] + ready, 120)
            except (procs.Exited, TimeoutError) as exc:
                raise RuntimeError(f"{name}: {exc}\n"
                                   f"{(logs / f'{name}.log').read_text()[-2000:]}") from None
            return child.pid

        try:
            children.append(procs.start(
                ["redis-server", "--port", str(ports["redis-server"]), "--bind", "127.0.0.1",
                 "--save", "", "--appendonly", "no", "--dir", state], logs / "redis.log"))
            _wait_for(client)
            start("upstream", [py, "-m", "detgate.bench.gateway_servers", "upstream",
                               "--port", str(ports["upstream"])], "/health")
            pids = {}
            for mode in MODES:
                env = {"DETGATE_PORT": str(ports[mode]), "DETGATE_WORKERS": urls["upstream"],
                       "DETGATE_REDIS_URL": redis_url, "DETGATE_API_KEYS": "",
                       "DETGATE_KEY_PREFIX": f"bench-{mode}-{secrets.token_hex(3)}",
                       "DETGATE_STATE_DIR": f"{state}/{mode}"}
                if mode != "none":
                    env |= {"DETGATE_TENANT_LIMITS": LIMITS, "DETGATE_RATE_LIMITS": mode}
                pids[mode] = start(mode, [py, "-m", "detgate.cli", "gateway"], "/readyz", env)
            rounds: dict[str, list[dict]] = {mode: [] for mode in MODES}
            for i in range(args.rounds):
                for mode in MODES:
                    print(f"round {i + 1}/{args.rounds}: {mode} ...", flush=True)
                    rounds[mode].append(_round(urls[mode] + "/v1/chat/completions",
                                               pids[mode], client, args.latency_requests))
        finally:
            client.close()
            for child in reversed(children):
                procs.stop(child)
    summary = _summary(rounds)
    report = {"benchmark": "limits", "date": utc_now(), "commit": git_commit(),
              "device": _device(load_average), "versions": versions(*PACKAGES),
              "request": orjson.loads(REQUEST), "limits": orjson.loads(LIMITS),
              "rounds": rounds, "summary": summary}
    _print(summary)
    data = orjson.dumps(report, option=orjson.OPT_INDENT_2)
    out_dir = REPO / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    (out_dir / f"limits-{stamp}.json").write_bytes(data)
    if args.json:
        Path(args.json).write_bytes(data)
    return 0


def _summary(rounds: dict[str, list[dict]]) -> dict:
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for mode, rs in rounds.items()}
    ratio = lambda key, a, b: med[a][key] / med[b][key]  # noqa: E731
    return {
        "medians": med,
        "gateway_cpu_ratio_redis_to_process": ratio("gateway_cpu_us_per_request", "redis",
                                                     "process"),
        "gateway_cpu_ratio_process_to_none": ratio("gateway_cpu_us_per_request", "process",
                                                    "none"),
        "rps_ratio_redis_to_process": ratio("rps_c16", "redis", "process"),
        "p50_ms_added_redis_over_process": med["redis"]["p50_ms_c1"]
        - med["process"]["p50_ms_c1"],
        "redis_cpu_us_per_request_added": med["redis"]["redis_cpu_us_per_request"]
        - med["process"]["redis_cpu_us_per_request"],
    }


def _print(summary: dict) -> None:
    for mode, m in summary["medians"].items():
        print(f"{mode:>8}: {m['rps_c16']:.0f} req/s at c=16, gateway "
              f"{m['gateway_cpu_us_per_request']:.0f} us CPU/request, redis "
              f"{m['redis_cpu_us_per_request']:.0f} us CPU/request, p50 {m['p50_ms_c1']:.2f} ms")
    print(f"redis vs process: gateway CPU {summary['gateway_cpu_ratio_redis_to_process']:.3f}x, "
          f"req/s {summary['rps_ratio_redis_to_process']:.3f}x, p50 "
          f"{summary['p50_ms_added_redis_over_process']:+.2f} ms, Redis CPU "
          f"{summary['redis_cpu_us_per_request_added']:+.0f} us/request")
