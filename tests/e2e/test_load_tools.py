"""Load tools people point at vLLM, unchanged, against a real gateway in front of two real
batch_invariant workers of the tiny model (8 sequences each) on the CPU, with Redis:
guidellm 0.8.1 (vLLM's) and aiperf 0.13.0 (NVIDIA's), streaming.

- guidellm's sweep, cut to its first two stages (synchronous, then throughput) and 8 requests
  each: no error, and every request it completed has a complete record (it reports our record
  ids as its response ids), nothing else recorded.
- guidellm's throughput stage as its default sweep runs it, 512 requests at once, cut after
  a few seconds: the gateway admits what the workers take (16 running, 16 queued) and refuses
  the rest at once (503, which guidellm counts as errors and sends again); when guidellm stops
  and cancels what is left, the workers are idle at once, nothing waits in the gateway, no
  worker was ejected, every completed request is recorded complete.
- aiperf, 12 streamed chats 4 at a time, with server token counts per chunk (vLLM's
  `stream_options.continuous_usage_stats`) and `ignore_eos`: no error, 12 complete records
  whose tokens are the ones aiperf counted.

The tools live in a virtual environment of their own (scripts/install-clients.sh; their
pinned dependencies would move detgate's); the tests skip without it. Both run offline, their
synthetic prompts tokenized with the tiny model's own folder: guidellm with HF_HUB_OFFLINE=1;
aiperf without it (its 0.13 offline mode looks a local folder up in the hub's cache and fails),
which a local folder does not need.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import orjson
import pytest
import redis

from detgate.contract.paths import state_dir
from tests.gateway.conftest import _gateway_starter, _start_workers
from tests.gateway.test_gateway_admission import unhandled
from tests.support.worker_metrics import assert_all_work_stopped

VENV = Path(os.environ.get("DETGATE_CLIENTS_VENV", state_dir() / "clients-venv"))


def tool(name: str) -> Path:
    path = VENV / "bin" / name
    if not path.exists():
        pytest.skip(f"{name} is not installed in {VENV}: run scripts/install-clients.sh")
    return path


@pytest.fixture(scope="module")
def workers(tiny_model, tmp_path_factory):
    procs = _start_workers(tiny_model, tmp_path_factory.mktemp("load-workers"),
                           ["batch_invariant"] * 2, ("--max-num-seqs", "8"))
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def gw(workers, redis_url, tmp_path_factory):
    starter = _gateway_starter(redis_url, tmp_path_factory.mktemp("load-gateway"))
    yield next(starter)([w.url for w in workers], env={"DETGATE_QUEUE_FACTOR": "1"})
    next(starter, None)


def records(gw) -> dict[str, dict]:
    """Every full record under the gateway's prefix, by id (refusal summaries left out)."""
    client = redis.Redis.from_url(gw.redis_url)
    try:
        out = {}
        for key in gw.redis_keys():
            if b":rec:" in key and (raw := client.get(key)) is not None:
                rec = orjson.loads(raw)
                if "summary" not in rec:
                    out[rec["id"]] = rec
        return out
    finally:
        client.close()


def guidellm(gw, tiny_model: Path, out: Path, *profile: str, output_tokens: int) -> list[dict]:
    """Run guidellm; its benchmarks from the JSON report."""
    args = [str(tool("guidellm")), "run",
            "--backend", f"kind=openai_http,target={gw.url},model={tiny_model.name}",
            "--tokenizer", f"kind=huggingface_auto,model={tiny_model}",
            "--data", f"kind=synthetic_text,prompt_tokens=32,output_tokens={output_tokens}",
            *profile, "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run(args, env=env, cwd=out.parent, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())["benchmarks"]


def test_guidellm_sweep_every_completed_request_is_recorded(gw, tiny_model, tmp_path):
    before = set(records(gw))
    benchmarks = guidellm(gw, tiny_model, tmp_path / "sweep.json",
                          "--profile", "kind=sweep,sweep_size=2,max_concurrency=16",
                          "--constraint", "kind=max_requests,count=8", output_tokens=16)
    assert len(benchmarks) == 2  # synchronous, then throughput
    ids = []
    for b in benchmarks:
        totals = b["metrics"]["request_totals"]
        print(b["config"]["strategy"]["type_"], totals)
        assert (totals["successful"], totals["errored"], totals["incomplete"]) == (8, 0, 0)
        ids += [r["response_id"] for r in b["requests"]["successful"]]
    new = {i: r for i, r in records(gw).items() if i not in before}
    assert set(ids) == set(new) and len(ids) == 16
    for rec in new.values():
        assert rec["status"] == "complete" and rec["request"]["stream"] is True
        (choice,) = rec["choices"]
        assert len(choice["logprobs"]) == len(choice["token_ids"]) > 0


def test_guidellm_512_at_once_then_cancelled_leaves_nothing_running(gw, workers, tiny_model,
                                                                    tmp_path):
    before = set(records(gw))
    (bench,) = guidellm(gw, tiny_model, tmp_path / "burst.json",
                        "--profile", "kind=throughput,max_concurrency=512",
                        "--constraint", "kind=max_duration,seconds=6", output_tokens=1024)
    totals = bench["metrics"]["request_totals"]
    errors = [r["info"]["error"] or "" for r in bench["requests"]["errored"]]
    print(f"guidellm at 512: {totals}; first error: {errors[:1]}")
    # Its errors are the gateway's overload refusals, nothing else.
    assert errors and all("503" in e for e in errors)
    assert totals["incomplete"] >= 16  # what was admitted when guidellm stopped
    stopped = assert_all_work_stopped(gw, [w.url for w in workers])
    new = {i: r for i, r in records(gw).items() if i not in before}
    statuses = [r["status"] for r in new.values()]
    done = {r["response_id"] for r in bench["requests"]["successful"]}
    assert done == {i for i, r in new.items() if r["status"] == "complete"}
    assert set(statuses) <= {"complete", "aborted"}
    # The gateway's own account, not guidellm's (whose totals miss requests its workers had
    # sent as it stopped: 703 arrived where it counted 663): it answered only 200 (streams,
    # then cut by guidellm), 499 (gone while queued) and 503 (refused), never a fault; and
    # only a request that was answered or had left may have an aborted record.
    codes = {code: gw.metric("detgate_requests_total", code=code,
                             endpoint="/v1/chat/completions")
             for code in ("200", "499", "503")}
    assert unhandled(gw) == []
    assert codes["503"] >= totals["errored"]
    assert statuses.count("aborted") <= codes["200"] + codes["499"] - statuses.count("complete")
    print(f"workers idle {stopped:.1f} s after guidellm returned; records: "
          f"{statuses.count('complete')} complete, {statuses.count('aborted')} aborted")


def test_aiperf_streaming_every_request_is_recorded(gw, tiny_model, tmp_path):
    before = set(records(gw))
    out = tmp_path / "aiperf"
    args = [str(tool("aiperf")), "profile", "--model", tiny_model.name, "--url", gw.url,
            "--endpoint-type", "chat", "--streaming", "--tokenizer", str(tiny_model),
            "--request-count", "12", "--concurrency", "4",
            "--prompt-input-tokens-mean", "32", "--prompt-input-tokens-stddev", "0",
            "--prompt-output-tokens-mean", "16", "--prompt-output-tokens-stddev", "0",
            "--extra-inputs", "ignore_eos:true", "--use-server-token-count", "--per-chunk-usage",
            "--ui", "none", "--output-artifact-dir", str(out), "--workers-max", "1",
            "--record-processor-service-count", "1", "--no-server-metrics",
            "--no-gpu-telemetry"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    done = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    print("aiperf:", summary["request_count"], summary["error_summary"])
    assert summary["request_count"]["avg"] == 12
    assert summary["error_summary"] == [] and not summary["was_cancelled"]
    per_request = [json.loads(line) for line in
                   (out / "profile_export.jsonl").read_text().splitlines()]
    assert len(per_request) == 12
    new = {i: r for i, r in records(gw).items() if i not in before}
    assert len(new) == 12
    for rec in new.values():
        assert rec["status"] == "complete" and rec["request"]["stream"] is True
        assert rec["request"]["ignore_eos"] is True
        assert rec["usage"]["completion_tokens"] == 16 == len(rec["choices"][0]["token_ids"])
    counted = sorted(r["metrics"]["usage_completion_tokens"]["value"] for r in per_request)
    assert counted == sorted(r["usage"]["completion_tokens"] for r in new.values())
