"""`detgate bench drift`: how long a drift report takes on N records (the goal: 1,000 in under a
minute against tiny workers), beside the time the same gateway took to serve those requests
in the first place, in the same run.

Real processes: two tiny workers (batch_invariant = fingerprint A, default = B), one gateway in
front of A alone that makes the N records (the baseline: N requests, C at a time), and a second
gateway on the same Redis prefix in front of both that runs `detgate drift`'s requests (A -> A:
drift 0; A -> B: the negative control) with C replays at a time.
"""

from __future__ import annotations

import asyncio
import os
import platform
import secrets
import sys
import tempfile
import time
from pathlib import Path

import httpx

from detgate import procs
from detgate.audit.drift import DriftRequest, fetch, merge
from detgate.contract.constants import REDIS_URL
from detgate.contract.provenance import cpu_model, git_commit, save_result, utc_now, versions
from detgate.procs import free_port

PACKAGES = ("fastapi", "uvicorn", "redis", "httpx", "orjson", "torch")


def register_args(p) -> None:
    p.add_argument("--records", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per record")
    p.add_argument("--concurrency", type=int, default=16, help="requests / replays at once")
    p.add_argument("--json", default=None, help="also write the result JSON here")


def _start(args: list[str], url: str, log: Path, env: dict[str, str]):
    popen = procs.start(args, log, env)
    procs.wait_http(popen, url, timeout=300)
    return popen


def _gateway(workers: list[str], redis_url: str, prefix: str, state: Path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    return url, _start([sys.executable, "-m", "detgate.cli", "gateway"], url + "/readyz",
                       state / f"gateway-{port}.log",
                       {"DETGATE_PORT": str(port), "DETGATE_WORKERS": ",".join(workers),
                        "DETGATE_REDIS_URL": redis_url, "DETGATE_KEY_PREFIX": prefix,
                        "DETGATE_API_KEYS": "", "DETGATE_STATE_DIR": str(state),
                        "DETGATE_MAX_DRIFT_CONCURRENCY": "64"})


async def _make_records(url: str, n: int, max_tokens: int, concurrency: int) -> float:
    """Seconds to serve n completions (greedy and seeded sampled), `concurrency` at a time."""
    todo = iter(range(n))

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            for i in todo:
                sampling = {"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0}
                r = await http.post("/v1/completions", json={
                    "model": "tiny", "prompt": f"record {i}: the quick brown fox",
                    "max_tokens": max_tokens, **sampling})
                r.raise_for_status()

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - t0


def _fingerprint(url: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "fp",
                                                  "max_tokens": 1}, timeout=60)
    return r.json()["system_fingerprint"]


def _drift(gateway: str, a: str, b: str, concurrency: int) -> dict:
    request = DriftRequest(a, b, None, None, 0, concurrency)
    t0 = time.perf_counter()
    report = merge([fetch(gateway, None, request, timeout_s=900)])
    seconds = time.perf_counter() - t0
    s = report["summary"]
    return {"seconds": seconds, "records": s["records"], "identical": s["identical"],
            "identical_share": s["identical_share"], "errors": s["errors"],
            "logprob_mse_mean": s["logprob_mse_mean"], "gateway_duration_s": report["duration_s"]}


def main(args) -> int:
    redis_url = os.environ.get("DETGATE_REDIS_URL", REDIS_URL)
    prefix = f"detgate-bench-drift-{secrets.token_hex(4)}"
    state = Path(tempfile.mkdtemp(prefix="detgate-bench-drift-"))
    started = []
    try:
        workers = []
        for mode in ("batch_invariant", "default"):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            started.append(_start(
                [sys.executable, "-m", "detgate.cli", "worker", "--model", "tiny", "--mode", mode,
                 "--port", str(port)], url + "/health", state / f"worker-{mode}.log",
                {"DETGATE_STATE_DIR": str(state)}))
            workers.append(url)
        fp_a, fp_b = (_fingerprint(w) for w in workers)
        maker, popen = _gateway(workers[:1], redis_url, prefix, state)
        started.append(popen)
        print(f"making {args.records} records on {fp_a} ...", flush=True)
        serve_s = asyncio.run(_make_records(maker, args.records, args.max_tokens,
                                            args.concurrency))
        gateway, popen = _gateway(workers, redis_url, prefix, state)
        started.append(popen)
        runs = {}
        for name, to in (("same_fingerprint", fp_a), ("default_mode", fp_b)):
            print(f"drift {fp_a} -> {to} ...", flush=True)
            runs[name] = _drift(gateway, fp_a, to, args.concurrency)
    finally:
        for popen in reversed(started):
            procs.stop(popen, timeout=30)
        _delete_prefix(redis_url, prefix)
    report = {
        "benchmark": "drift", "date": utc_now(), "commit": git_commit(),
        "device": {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform()},
        "versions": versions(*PACKAGES),
        "workload": {"records": args.records, "max_tokens": args.max_tokens,
                     "concurrency": args.concurrency, "model": "tiny",
                     "fingerprints": {"a_batch_invariant": fp_a, "b_default": fp_b}},
        "baseline_serve_s": serve_s, "runs": runs,
        "ratio_to_serving": {k: v["seconds"] / serve_s for k, v in runs.items()},
    }
    for name, r in runs.items():
        print(f"{name}: {r['records']} records in {r['seconds']:.1f} s "
              f"({r['seconds'] / serve_s:.2f}x serving them: {serve_s:.1f} s), identical "
              f"{r['identical']}, errors {r['errors']}")
    print(f"saved {save_result(report, 'drift-cpu-tiny', args.json)}")
    return 0


def _delete_prefix(redis_url: str, prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i:i + 500])
    finally:
        client.close()
