"""`detgate bench gateway`: what the gateway adds, measured side by side in one run.

Three targets share one canned upstream (raw asyncio, see gateway_servers): the upstream
directly, a bare FastAPI passthrough with the same upstream client and one Redis SET, and
the gateway with validation, routing and full recording. For each: latency p50/p99 at one
connection, and requests/s at 16 and 32 connections, with the server's CPU per request.
The targets are measured in `--repeats` rounds, interleaved so that a change in the
machine's other load falls on all of them alike: at one connection their requests take
turns one by one, and at 16 and 32 connections in slices of SLICE_S each, the order rotating
each round. The summary gives the median of each figure over the rounds and each
round's ratios. Then a check that the gateway stored exactly one record per 2xx answer. The
JSON goes to bench/results/ (and --json OUT).

`--profile`: the gateway alone, under cProfile, one round of the same load; the Markdown
summary (gateway_profile.py) goes to bench/results/gateway-profile-<date>.md.
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
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from detgate.contract.provenance import cpu_model, git_commit, utc_now, versions

REQUEST = orjson.dumps({"model": "canned", "max_tokens": 16, "temperature": 0,
                        "messages": [{"role": "user", "content": "Say hello"}]})
HEADERS = {"Content-Type": "application/json"}
LATENCY_REQUESTS = 1000  # per target and round
WARMUP = 100
SLICES, SLICE_S = 4, 0.5  # load per target, concurrency and round: 2 s in 4 turns
THROUGHPUT_S = 4.0  # one target alone (bench limits)
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


async def _latency(urls: dict[str, str]) -> dict:
    """p50/p99 at one connection per target, the targets' requests taking turns, so that a
    change in the machine's other load falls on every target alike."""
    sessions = {name: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
                for name in urls}
    times: dict[str, list[float]] = {name: [] for name in urls}
    try:
        for i in range(WARMUP + LATENCY_REQUESTS):
            for name, url in urls.items():
                t0 = time.perf_counter()
                async with sessions[name].post(url, data=REQUEST, headers=HEADERS) as r:
                    await r.read()
                    assert r.status == 200, (name, r.status)
                if i >= WARMUP:
                    times[name].append(time.perf_counter() - t0)
    finally:
        for session in sessions.values():
            await session.close()
    return {name: _latency_stats(t) for name, t in times.items()}


def _latency_stats(times: list[float]) -> dict:
    times.sort()
    return {"p50_ms": 1e3 * statistics.median(times),
            "p99_ms": 1e3 * times[int(0.99 * len(times)) - 1],
            "mean_ms": 1e3 * statistics.fmean(times), "n": len(times)}


async def _slice(session: aiohttp.ClientSession, url: str, concurrency: int, counts: dict,
                 seconds: float = SLICE_S) -> float:
    """`seconds` of load at `concurrency` connections; its length (answers counted in
    `counts`)."""
    stop = time.perf_counter() + seconds

    async def loop() -> None:
        while time.perf_counter() < stop:
            async with session.post(url, data=REQUEST, headers=HEADERS) as r:
                await r.read()
                counts["ok" if r.status == 200 else "non_2xx"] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    return time.perf_counter() - t0


async def _throughput(url: str, concurrency: int) -> dict:
    """THROUGHPUT_S of load at `concurrency` connections on one target (bench limits)."""
    counts = {"ok": 0, "non_2xx": 0}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        elapsed = await _slice(s, url, concurrency, counts, THROUGHPUT_S)
    return {"rps": counts["ok"] / elapsed, "ok": counts["ok"], "non_2xx": counts["non_2xx"]}


def _cpu_seconds(pid: int) -> float:
    """User + system CPU of a process: robust to other load on a shared machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _round(urls: dict[str, str], pids: dict[str, int]) -> dict:
    """One round: latency with the targets taking turns request by request; then at each
    concurrency, SLICES slices of load per target, the targets taking turns slice by slice
    (in the order of `urls`); each server's CPU per request over its slices."""
    latency = await _latency(urls)
    results = {name: {"c1": latency[name]} for name in urls}
    cpu = dict.fromkeys(urls, 0.0)
    for c in CONCURRENCY:
        sessions = {name: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=c))
                    for name in urls}
        counts = {name: {"ok": 0, "non_2xx": 0} for name in urls}
        elapsed = dict.fromkeys(urls, 0.0)
        try:
            for _ in range(SLICES):
                for name, url in urls.items():
                    cpu0 = _cpu_seconds(pids[name])
                    elapsed[name] += await _slice(sessions[name], url, c, counts[name])
                    cpu[name] += _cpu_seconds(pids[name]) - cpu0
        finally:
            for session in sessions.values():
                await session.close()
        for name in urls:
            results[name][f"c{c}"] = {"rps": counts[name]["ok"] / elapsed[name],
                                      **counts[name], "seconds": elapsed[name]}
    for name, result in results.items():
        served = sum(result[f"c{c}"]["ok"] for c in CONCURRENCY)
        result["server_cpu_us_per_request"] = 1e6 * cpu[name] / served
    return results


def _device(load_average: tuple[float, float, float]) -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(),
            "platform": platform.platform(),
            # Other work on the machine widens latency tails; CPU per request is robust to it.
            "load_average_at_start": load_average}


def _records(redis_url: str, prefix: str) -> int:
    import redis

    from detgate.gateway.keys import Keys
    client = redis.Redis.from_url(redis_url)
    try:
        count = client.zcard(Keys(prefix).index("default"))
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i:i + 500])
        return count
    finally:
        client.close()


TARGETS = ("direct", "passthrough", "gateway")
PATH = "/v1/chat/completions"


def _servers(redis_url: str, prefix: str, profile_out: str | None) -> tuple[dict, dict]:
    """Start the upstream, the passthrough and the gateway (under cProfile with
    `profile_out`); their URLs and processes by target name."""
    ports = {name: _free_port() for name in ("upstream", "passthrough", "gateway")}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    py = sys.executable
    procs = {}
    try:
        procs["direct"] = _start([py, "-m", "detgate.bench.gateway_servers", "upstream",
                                  "--port", str(ports["upstream"])], urls["upstream"] + "/health")
        procs["passthrough"] = _start(
            [py, "-m", "detgate.bench.gateway_servers", "passthrough", "--port",
             str(ports["passthrough"]), "--upstream", urls["upstream"], "--redis-url", redis_url,
             "--prefix", prefix], urls["passthrough"] + "/health")
        gateway = [py, "-m", "detgate.cli", "gateway"] if profile_out is None else [
            py, "-m", "detgate.bench.gateway_profile", "--out", profile_out]
        procs["gateway"] = _start(gateway, urls["gateway"] + "/readyz", {
            "DETGATE_PORT": str(ports["gateway"]), "DETGATE_WORKERS": urls["upstream"],
            "DETGATE_REDIS_URL": redis_url, "DETGATE_KEY_PREFIX": prefix,
            "DETGATE_API_KEYS": ""})
    except BaseException:
        _stop(procs)
        raise
    urls["direct"] = urls.pop("upstream")
    return urls, procs


def _stop(procs: dict) -> None:
    for proc in procs.values():
        proc.terminate()
    for proc in procs.values():
        proc.wait(30)


def _served(result: dict) -> int:
    return WARMUP + LATENCY_REQUESTS + sum(result[f"c{c}"]["ok"] for c in CONCURRENCY)


def main(args) -> int:
    load_average = os.getloadavg()
    redis_url = os.environ.get("DETGATE_REDIS_URL", "redis://127.0.0.1:6379/15")
    prefix = f"detgate-bench-{secrets.token_hex(4)}"
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    out_dir = REPO / "bench" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.profile:
        return _profile(redis_url, prefix, out_dir)
    urls, procs = _servers(redis_url, prefix, None)
    rounds: list[dict] = []
    try:
        for r in range(args.repeats):
            order = TARGETS[r % 3:] + TARGETS[:r % 3]
            print(f"round {r + 1}/{args.repeats} ...", flush=True)
            rounds.append(asyncio.run(_round(
                {name: urls[name] + PATH for name in order},
                {name: procs[name].pid for name in order})))
    finally:
        _stop(procs)
    gateway_2xx = sum(_served(results["gateway"]) for results in rounds)
    stored = _records(redis_url, prefix)
    summary = _summary(rounds, gateway_2xx, stored)
    report = {"benchmark": "gateway", "date": utc_now(), "commit": git_commit(),
              "device": _device(load_average), "versions": versions(*PACKAGES),
              "request": orjson.loads(REQUEST), "repeats": args.repeats, "rounds": rounds,
              "summary": summary}
    _print(summary)
    data = orjson.dumps(report, option=orjson.OPT_INDENT_2)
    (out_dir / f"gateway-{stamp}.json").write_bytes(data)
    if args.json:
        Path(args.json).write_bytes(data)
    return 0 if summary["records_match_2xx"] else 1


def _profile(redis_url: str, prefix: str, out_dir: Path) -> int:
    """One round against the gateway under cProfile; its Markdown summary."""
    from detgate.bench.gateway_profile import summary as profile_summary
    with tempfile.TemporaryDirectory() as tmp:
        stats = str(Path(tmp) / "gateway.prof")
        urls, procs = _servers(redis_url, prefix, stats)
        try:
            print("measuring gateway under cProfile ...", flush=True)
            result = asyncio.run(_round({"gateway": urls["gateway"] + PATH},
                                        {"gateway": procs["gateway"].pid}))["gateway"]
        finally:
            _stop(procs)
        stored = _records(redis_url, prefix)
        title = (f"Gateway profile, {utc_now()[:10]}, commit {git_commit()[:12]}: "
                 f"`detgate bench gateway --profile` on {cpu_model()} ({os.cpu_count()} cores); "
                 f"{stored} records for {_served(result)} 2xx")
        text = profile_summary(stats, _served(result), title)
    day = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    path = out_dir / f"gateway-profile-{day}.md"
    path.write_text(text)
    print(text)
    print(f"written to {path}")
    return 0


def _median(rounds: list[dict], name: str, *path: str) -> float:
    values = []
    for results in rounds:
        value = results[name]
        for part in path:
            value = value[part]
        values.append(value)
    return statistics.median(values)


def _summary(rounds: list[dict], gateway_2xx: int, stored: int) -> dict:
    """Medians over the rounds, and each round's gateway/passthrough ratios."""
    p50 = {k: _median(rounds, k, "c1", "p50_ms") for k in TARGETS}
    p99 = {k: _median(rounds, k, "c1", "p99_ms") for k in TARGETS}
    cpu = {k: _median(rounds, k, "server_cpu_us_per_request") for k in TARGETS}
    out = {
        "rounds": len(rounds),
        "added_p50_ms_vs_direct": {k: p50[k] - p50["direct"] for k in TARGETS[1:]},
        "added_p99_ms_vs_direct": {k: p99[k] - p99["direct"] for k in TARGETS[1:]},
        "gateway_over_passthrough_p50_ms": p50["gateway"] - p50["passthrough"],
        "gateway_over_passthrough_p50_ms_per_round": [
            r["gateway"]["c1"]["p50_ms"] - r["passthrough"]["c1"]["p50_ms"] for r in rounds],
        "c1_p50_ratio_gateway_to_passthrough": p50["gateway"] / p50["passthrough"],
        "gateway_2xx": gateway_2xx, "records_stored": stored,
        "records_match_2xx": gateway_2xx == stored,
        "server_cpu_us_per_request": cpu,
        "cpu_ratio_gateway_to_passthrough": cpu["gateway"] / cpu["passthrough"],
        "cpu_ratio_per_round": [r["gateway"]["server_cpu_us_per_request"]
                                / r["passthrough"]["server_cpu_us_per_request"]
                                for r in rounds],
    }
    for c in CONCURRENCY:
        rps = {k: _median(rounds, k, f"c{c}", "rps") for k in TARGETS}
        out[f"rps_c{c}"] = rps
        out[f"rps_ratio_gateway_to_passthrough_c{c}"] = rps["gateway"] / rps["passthrough"]
        out[f"rps_ratio_per_round_c{c}"] = [r["gateway"][f"c{c}"]["rps"]
                                            / r["passthrough"][f"c{c}"]["rps"] for r in rounds]
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
    print(f"gateway over passthrough at c=1: p50 +{summary['gateway_over_passthrough_p50_ms']:.2f} "
          f"ms (medians of {summary['rounds']} interleaved rounds)")
    print(f"records stored {summary['records_stored']} / gateway 2xx {summary['gateway_2xx']}: "
          f"{'OK' if summary['records_match_2xx'] else 'MISMATCH'}")
