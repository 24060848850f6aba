"""Weight updates of the Qwen3-8B shape on one GPU (bf16, 36 layers, 8.2B parameters, 16 GB),
in process, for an H200; one command, a few minutes with its setup:

    PYTHONPATH=. python -m detgate.bench.weights_gpu --json OUT.json
    # the same as: detgate bench weights --device cuda --json OUT.json
    # its code path on a CPU, in seconds: --preset tiny --device cpu

The engine is built with random weights drawn on the device (worker/tools/random_model.py) and
serves a few greedy requests first, so that its CUDA graphs are captured on those weights.
Then it is updated, each timed from the start of staging to the new weights in place, with the
functions the worker's endpoint runs (WeightStager.stage, Engine.update_weights; the HTTP
request and the engine's inbox add milliseconds, measured by the CPU benchmark):
- first: from a checkpoint written by `detgate make-model` (seed 1); it allocates and pins the
  staging copy, which every later update reuses;
- from disk, cold: the same folder with its pages dropped from the page cache first (fsync +
  POSIX_FADV_DONTNEED), then again warm;
- from tensors in memory, the way push_weights sends a trainer's CUDA tensors: a trainer
  process of its own (seed 2, on the same GPU) shares them over CUDA IPC
  (model/weight_ipc.py) and the engine's process opens, stages and commits them, timed from
  the handles' arrival to the new weights in place, the trainer's time to describe them apart;
  twice (as in an RL loop). Then the same tensors through the file handoff
  (push_weights.write_handoff: /dev/shm when it has room), the write included in its total:
  the way tensors go to a CPU worker or one on another GPU. Both must give the same hash.
Check: after the disk update the engine's greedy tokens and logprob bits equal those of a
fresh engine loaded from that folder (CUDA graphs captured before the update included).
Goals: from disk <= 10 s, from tensors <= 2 s (end to end). Baseline in the same run: the
fresh load of the same folder (what a restart costs in loading alone).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

import torch

from detgate.bench.report import environment
from detgate.contract.compare import logprob_bits
from detgate.contract.provenance import save_result
from detgate.worker.engine import offline as wl
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.engine import Engine
from detgate.worker.model.loader import load, weight_files
from detgate.worker.model.weight_ipc import open_shared, share
from detgate.worker.model.weight_update import WeightStager
from detgate.worker.tools.make_model import PRESETS, checkpoint_tensors, make_model
from detgate.worker.tools.push_weights import write_handoff
from detgate.worker.tools.random_model import load_random

PRESET = "qwen3-8b-shape"
GOALS_S = {"from_disk": 10.0, "from_tensors": 2.0}
T0 = time.time()


def log(*parts) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *parts, flush=True)


def main(args) -> int:
    preset, device = getattr(args, "preset", PRESET), args.device
    dtype = PRESETS[preset].dtype
    report: dict = {"benchmark": "weights-gpu", "preset": preset, "goals_s": GOALS_S,
                    **environment(device)}
    with tempfile.TemporaryDirectory(prefix="detgate-weights-gpu-", dir=args.workdir) as tmp:
        tmp = Path(tmp)
        loaded, eng = _engine(load_random(preset, tmp / "config", seed=0, device=device,
                                          mode="batch_invariant"), device)
        reqs = _requests(loaded.config.vocab_size)
        wl.run(eng, reqs, arrival_seed=None)  # compile, capture graphs on these weights
        log("engine ready")
        t = time.perf_counter()
        make_model(preset, tmp / "disk", seed=1)
        report["setup_write_checkpoint_s"] = time.perf_counter() - t
        log("checkpoint written")
        stager = WeightStager(loaded.model, loaded.config)
        # The first update allocates (and pins) the staging copy, which later ones reuse.
        report["first_update"] = _update(eng, stager, tmp / "disk")
        _drop_from_page_cache(weight_files(tmp / "disk"))
        report["from_disk_cold"] = _update(eng, stager, tmp / "disk")
        report["from_disk_warm"] = _update(eng, stager, tmp / "disk")
        after, _ = wl.run(eng, reqs, arrival_seed=None)
        log("disk updates", report["from_disk_cold"], report["from_disk_warm"])
        t = time.perf_counter()
        fresh_loaded, fresh = _engine(load(tmp / "disk", dtype=dtype, device=device,
                                           mode="batch_invariant"), device)
        report["baseline_fresh_load_s"] = time.perf_counter() - t
        expected, _ = wl.run(fresh, reqs, arrival_seed=None)
        report["check"] = {
            "same_hash_as_fresh_load": report["from_disk_warm"]["weights_sha256"]
            == fresh_loaded.fingerprint_parts["weights_sha256"],
            "same_tokens_and_logprob_bits": _bits(after) == _bits(expected)}
        del fresh, fresh_loaded, expected
        if device == "cuda":
            torch.cuda.empty_cache()
        log("check", report["check"])
        if device == "cuda":
            report["from_tensors_ipc"] = _updates_over_ipc(eng, stager, preset,
                                                           loaded.config.vocab_size)
            log("IPC updates", report["from_tensors_ipc"])
        trainer = _trainer_tensors(PRESETS[preset], loaded.config.vocab_size, device)
        report["from_tensors_file"] = [_update_from_tensors(eng, stager, trainer)
                                       for _ in range(2)]
        log("file updates", report["from_tensors_file"])
    ways = [report[k][-1] for k in ("from_tensors_ipc", "from_tensors_file") if k in report]
    report["check"]["same_hash_ipc_and_file"] = len({w["weights_sha256"] for w in ways}) == 1
    report["meets_goal"] = {
        "from_disk_cold": report["from_disk_cold"]["total_s"] <= GOALS_S["from_disk"],
        "from_disk_warm": report["from_disk_warm"]["total_s"] <= GOALS_S["from_disk"],
        "from_tensors": ways[0]["end_to_end_s"] <= GOALS_S["from_tensors"]}
    report["ratios"] = {"from_disk_warm_over_fresh_load": report["from_disk_warm"]["total_s"]
                        / report["baseline_fresh_load_s"]}
    out = save_result(report, f"weights-{device}-{preset}", args.json)
    log(f"meets goal: {report['meets_goal']}; wrote {out}")
    return 0


def _engine(loaded, device: str) -> tuple:
    # A small KV cache: the trainer's tensors and a fresh engine for the check share the GPU.
    dtype = str(loaded.config.dtype).removeprefix("torch.")
    config = EngineConfig(model=PRESET, device=device, dtype=dtype, max_num_seqs=8,
                          max_num_batched_tokens=2048,
                          kv_cache_mb=4096 if device == "cuda" else 64)
    return loaded, Engine(config, loaded.model, loaded.config)


def _requests(vocab_size: int) -> list[wl.Request]:
    return wl.cost_workload(requests=8, prompt=(16, 200), output=(32, 32),
                            vocab_size=vocab_size, seed=11)


def _bits(out: dict[str, wl.Completion]) -> dict:
    return {rid: (c.token_ids, logprob_bits(c.logprobs)) for rid, c in out.items()}


def _update(eng: Engine, stager: WeightStager, path: Path) -> dict:
    t0 = time.perf_counter()
    staged = stager.stage(path)
    t1 = time.perf_counter()
    eng.update_weights(staged.commit)
    t2 = time.perf_counter()
    return {"stage_s": t1 - t0, "commit_s": t2 - t1, "total_s": t2 - t0,
            "weights_sha256": staged.weights_sha256}


def _update_from_tensors(eng: Engine, stager: WeightStager, tensors: dict) -> dict:
    t0 = time.perf_counter()
    handoff = write_handoff(tensors)
    write_s = time.perf_counter() - t0
    try:
        result = _update(eng, stager, handoff)
    finally:
        handoff.unlink()
    return {**result, "handoff_write_s": write_s, "handoff_dir": str(handoff.parent),
            "end_to_end_s": write_s + result["total_s"]}


def _updates_over_ipc(eng: Engine, stager: WeightStager, preset: str, vocab_size: int,
                      times: int = 2) -> list[dict]:
    """Updates from a trainer process's CUDA tensors, shared over IPC (as push_weights sends
    them to a worker): the trainer describes them, this process opens, stages and commits."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    trainer = ctx.Process(target=_trainer_process, args=(theirs, preset, vocab_size, times))
    trainer.start()
    out = []
    try:
        for _ in range(times):
            specs, share_s = ours.recv()
            t0 = time.perf_counter()
            shared = open_shared(specs, torch.device("cuda"))
            t1 = time.perf_counter()
            staged = stager.stage_shared(shared)
            del shared  # releases the trainer's memory
            t2 = time.perf_counter()
            eng.update_weights(staged.commit)
            t3 = time.perf_counter()
            ours.send("done")
            out.append({"trainer_share_s": share_s, "open_s": t1 - t0, "stage_s": t2 - t1,
                        "commit_s": t3 - t2, "total_s": t3 - t0,
                        "end_to_end_s": share_s + t3 - t0,
                        "weights_sha256": staged.weights_sha256})
    finally:
        trainer.join(60)
    return out


def _trainer_process(conn, preset: str, vocab_size: int, times: int) -> None:
    tensors = _trainer_tensors(PRESETS[preset], vocab_size, "cuda")
    torch.cuda.synchronize()
    for _ in range(times):
        t = time.perf_counter()
        specs = share(tensors)
        conn.send((specs, time.perf_counter() - t))
        conn.recv()  # the tensors stay alive until the update has read them


def _trainer_tensors(preset, vocab_size: int, device: str) -> dict[str, torch.Tensor]:
    """A state dict on the device as a trainer holds it, under the checkpoint's names."""
    gen = torch.Generator(device=device).manual_seed(2)
    dtype = getattr(torch, preset.dtype)
    return {t.name: torch.randn(t.shape, generator=gen, device=device, dtype=dtype)
            * (t.std or 0.1) + (1.0 if t.std == 0.0 else 0.0)
            for t in checkpoint_tensors(preset, vocab_size)}


def _drop_from_page_cache(files: list[Path]) -> None:
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m detgate.bench.weights_gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, help="write the result JSON here")
    p.add_argument("--preset", default=PRESET, choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--workdir", default=None,
                   help="where the 16 GB checkpoint is written (default: the temp dir)")
    return p


if __name__ == "__main__":
    raise SystemExit(main(build_parser().parse_args()))
