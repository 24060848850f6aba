"""`detgate bench engine --host`: the engine's host work per step, the model's arithmetic left out.

On CUDA the host's part of a step (scheduling, step inputs, unpacking the results, the
bookkeeping) is time the GPU waits for, unless asynchronous scheduling launches the next step
ahead. It is the same Python on any machine, so this measures it on the CPU: an engine of the
tiny model decodes B sequences at once and each stage of the host's work is timed directly
(schedule, advance, step inputs, logits rows, collecting the results, resolve, outputs; the
forward, logits and sampling apart). Greedy requests with chosen-token logprobs (what the
gateway asks for) and without logprobs.
Writes JSON with the device, versions and commit to bench/results/ (and to --json OUT).
"""

from __future__ import annotations

import collections
import gc
import statistics
import time
from pathlib import Path

import torch

from detgate.contract.provenance import cpu_model, git_commit, save_result, utc_now, versions
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.engine import Engine
from detgate.worker.engine.sequence import SamplingParams
from detgate.worker.model.loader import load
from detgate.worker.tools.model_source import resolve_model

BATCHES = (64, 256)
STEPS = 40
PROMPT_TOKENS = 100


class StageTimer:
    """Wraps methods of one object so that their time adds up under a stage name."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()

    def wrap(self, owner, name: str, stage: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds[stage] += time.perf_counter() - start

        setattr(owner, name, timed)


def instrumented(engine: Engine) -> StageTimer:
    timer = StageTimer()
    runner = engine.runner
    for owner, name in ((runner, "_forward"), (runner.model, "compute_logits"),
                        (runner.sampler, "sample"), (runner.sampler, "logprobs")):
        timer.wrap(owner, name, "model")
    for owner, name in ((engine.scheduler, "schedule"), (engine.scheduler, "advance"),
                        (engine.scheduler, "resolve"), (runner, "_prepare_inputs"),
                        (runner, "_plan_rows"), (runner, "collect"), (engine, "_outputs")):
        timer.wrap(owner, name, name.strip("_"))
    return timer


def measure(engine: Engine, batch: int, logprobs: int | None) -> dict:
    """Per decode step of `batch` sequences: host ms in total and by stage."""
    params = SamplingParams(max_tokens=STEPS + 2, logprobs=logprobs, ignore_eos=True)
    for i in range(batch):
        engine.add(f"r{i}", [100 + (7 * i + k) % 1500 for k in range(PROMPT_TOKENS)], params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < PROMPT_TOKENS
                                          for s in engine.scheduler.running):
        engine.step()  # prefill, then one decode step for warm-up
    # The engines measured before this one (reference cycles through the timers' wrappers)
    # go now, not in a collection inside a timed step.
    gc.collect()
    timer = instrumented(engine)
    steps, total = 0, 0.0
    for _ in range(STEPS):
        start = time.perf_counter()
        _, stats = engine.step()
        total += time.perf_counter() - start
        steps += 1
        assert stats.num_seqs == batch and stats.num_tokens == batch
    measured = {k: 1e3 * v / steps for k, v in sorted(timer.seconds.items())}
    while engine.has_work():
        engine.step()
    model = measured.pop("model")
    host = sum(measured.values())
    return {"batch": batch, "logprobs": logprobs, "steps": steps, "host_ms_per_step": host,
            "host_us_per_sequence": 1e3 * host / batch, "model_ms_per_step": model,
            # The step's own glue and, on the CPU, the logits rows' gathers: neither stage.
            "other_ms_per_step": 1e3 * total / steps - model - host,
            "stage_ms_per_step": measured}


def main(args) -> int:
    torch.set_num_threads(1)
    config = EngineConfig(model=args.model, mode="batch_invariant", max_num_seqs=max(BATCHES),
                          max_num_batched_tokens=max(BATCHES) * PROMPT_TOKENS,
                          num_kv_blocks=max(BATCHES) * 16)
    loaded = load(Path(resolve_model(config.model)), dtype="float32", device="cpu",
                  mode=config.mode)
    rows = []
    for repeat in range(args.repeats):
        for batch in BATCHES:
            for logprobs in (0, None):
                engine = Engine(config, loaded.model, loaded.config)
                rows.append({"repeat": repeat, **measure(engine, batch, logprobs)})
                r = rows[-1]
                print(f"B={batch:4d} logprobs={logprobs!s:5s} host {r['host_ms_per_step']:6.2f} "
                      f"ms/step ({r['host_us_per_sequence']:5.2f} us/seq), model "
                      f"{r['model_ms_per_step']:6.2f} ms/step", flush=True)
    summary = {}
    for batch in BATCHES:
        for logprobs in (0, None):
            mine = [r for r in rows if r["batch"] == batch and r["logprobs"] == logprobs]
            summary[f"B={batch} logprobs={logprobs}"] = {
                "median_host_ms_per_step": statistics.median(r["host_ms_per_step"] for r in mine),
                "median_stage_ms_per_step": {
                    k: statistics.median(r["stage_ms_per_step"][k] for r in mine)
                    for k in mine[0]["stage_ms_per_step"]}}
    report = {"benchmark": "engine-host", "date": utc_now(), "commit": git_commit(),
              "device": {"type": "cpu", "name": cpu_model(), "torch_threads": 1},
              "versions": versions("torch", "numpy"),
              "workload": {"model": config.model, "prompt_tokens": PROMPT_TOKENS,
                           "decode_steps": STEPS, "batches": BATCHES,
                           "note": "host time = step time - forward, logits and sampling"},
              "summary": summary, "runs": rows}
    out = save_result(report, "engine-host-cpu", args.json)
    print(f"wrote {out}")
    return 0
