"""`detgate bench engine`: the cost of batch invariance, both modes on one workload in one run.

The engine is driven in process (no HTTP): every request of the workload is submitted at once
and the engine steps until all are done, batching them continuously as the server would.
Modes alternate (default, batch_invariant, batch_invariant, default, ...) so that drift in a
shared machine's load hits both alike. Besides wall time, each run's process CPU time is
recorded: on a machine shared with other jobs, wall time also counts the time other processes
held the cores, while CPU time counts only this engine's work (with --threads 1: several
threads spin while waiting for a descheduled sibling, which CPU time counts too). Ratios of
medians for both.
Writes JSON with the device, versions and commit to bench/results/ (and to --json OUT).
"""

from __future__ import annotations

import dataclasses
import platform
import random
import statistics
import time

import torch

from detgate.contract.constants import MODES
from detgate.contract.provenance import git_commit, save_result, utc_now, versions
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.engine import Engine
from detgate.worker.engine.sequence import SamplingParams


def workload(num_requests: int, max_tokens: int, vocab: int, seed: int = 0):
    """Requests of random prompt lengths (16-128 tokens), greedy, with chosen-token logprobs
    (what the gateway asks for on every request), EOS ignored so every run does equal work."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=max_tokens, logprobs=0, ignore_eos=True)
    return [([rng.randrange(3, vocab) for _ in range(rng.randrange(16, 129))], params)
            for _ in range(num_requests)]


def run_once(engine: Engine, requests) -> dict:
    for i, (ids, params) in enumerate(requests):
        engine.add(f"r{i}", ids, params)
    steps = batch_seqs = generated = 0
    start, start_cpu = time.perf_counter(), time.process_time()
    while engine.has_work():
        _, stats = engine.step()
        steps += 1
        batch_seqs += stats.num_seqs
        generated += stats.num_generated
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    prompt = sum(len(ids) for ids, _ in requests)
    return {"wall_s": wall, "cpu_s": cpu, "generated_tokens": generated, "prompt_tokens": prompt,
            "steps": steps, "mean_batch_seqs": batch_seqs / steps,
            "generated_tokens_per_s": generated / wall,
            "total_tokens_per_s": (generated + prompt) / wall}


def build(config: EngineConfig) -> tuple[Engine, str]:
    """The engine for `config`, and what its matmuls read as the worker reports it
    ('quantised: 120 Q4_1, 1 Q8_0' or 'fp32')."""
    from detgate.worker.model.loader import load
    from detgate.worker.tools.model_source import resolve_model

    loaded = load(resolve_model(config.model), dtype=config.dtype, device=config.device,
                  mode=config.mode, weights_format=config.weights_format)
    return Engine(config, loaded.model, loaded.config), loaded.machine["weights"]


def main(args) -> int:
    if args.device == "cuda":  # the GPU experiment: determinism, cost and trainer check
        from detgate.bench import engine_gpu

        return engine_gpu.main(engine_gpu.from_bench_args(args))
    if args.threads:
        torch.set_num_threads(args.threads)
    base = EngineConfig.from_args(args)
    built = {mode: build(dataclasses.replace(base, mode=mode)) for mode in MODES}
    engines = {mode: engine for mode, (engine, _) in built.items()}
    vocab = engines["default"].runner.model_config.vocab_size
    requests = workload(args.requests, args.max_tokens, vocab)
    for engine in engines.values():  # warm up: first calls allocate and pick kernels
        run_once(engine, workload(2, 4, vocab, seed=1))
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for r in range(args.repeats):
        for mode in MODES if r % 2 == 0 else reversed(MODES):
            runs[mode].append(run_once(engines[mode], requests))
            run = runs[mode][-1]
            print(f"{mode:16s} {run['wall_s']:8.2f} s wall {run['cpu_s']:8.2f} s CPU "
                  f"{run['generated_tokens_per_s']:8.1f} generated tokens/s", flush=True)
    summary = {mode: _summary(runs[mode]) for mode in MODES}
    ratio = summary["batch_invariant"]["median_wall_s"] / summary["default"]["median_wall_s"]
    ratio_cpu = summary["batch_invariant"]["median_cpu_s"] / summary["default"]["median_cpu_s"]
    report = {
        "benchmark": "engine", "date": utc_now(),
        "commit": git_commit(), "device": _device(base),
        "versions": versions("torch", "triton", "numpy"),
        "config": {k: v for k, v in dataclasses.asdict(base).items() if k != "mode"},
        "weights": {mode: weights for mode, (_, weights) in built.items()},
        "workload": {"requests": args.requests, "prompt_tokens": "16-128",
                     "max_tokens": args.max_tokens, "sampling": "greedy, logprobs=0, ignore_eos",
                     "repeats": args.repeats, "torch_threads": torch.get_num_threads()},
        "summary": summary, "time_ratio_batch_invariant_over_default": ratio,
        "cpu_time_ratio_batch_invariant_over_default": ratio_cpu,
        "goal": "batch_invariant <= 1.3x default time on CPU", "runs": runs,
    }
    out = save_result(report, f"engine-{base.device}-{base.dtype}", args.json)
    print(f"wrote {out}")
    for mode in MODES:
        s = summary[mode]
        print(f"{mode:16s} median {s['median_wall_s']:.2f} s, "
              f"{s['generated_tokens_per_s']:.1f} generated tokens/s")
    print(f"batch_invariant / default: {ratio:.3f}x wall time, {ratio_cpu:.3f}x CPU time "
          f"(medians)")
    return 0


def _summary(runs: list[dict]) -> dict:
    wall = statistics.median(r["wall_s"] for r in runs)
    return {"median_wall_s": wall, "min_wall_s": min(r["wall_s"] for r in runs),
            "median_cpu_s": statistics.median(r["cpu_s"] for r in runs),
            "generated_tokens_per_s": runs[0]["generated_tokens"] / wall,
            "total_tokens_per_s": (runs[0]["generated_tokens"] + runs[0]["prompt_tokens"]) / wall,
            "mean_batch_seqs": runs[0]["mean_batch_seqs"]}


def _device(config: EngineConfig) -> dict:
    from detgate.worker.model.numerics import device_name

    return {"type": config.device, "name": device_name(torch.device(config.device)),
            "torch_threads": torch.get_num_threads(), "machine": platform.machine()}


