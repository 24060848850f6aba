"""`detgate bench engine --structured`: the cost of grammar-constrained decoding, one engine
running one workload unconstrained and under a JSON-schema grammar, interleaved in one run.

Every request of the constrained runs has its own grammar state; each step's masks are
computed on the host while the forward runs (engine/model_runner.py) and applied to the
logits rows. A grammar may end a request early, so the cost is compared per generated token
and per engine step (medians of wall and CPU time). Writes JSON with the device, versions
and commit to bench/results/ (and to --json OUT).
"""

from __future__ import annotations

import dataclasses
import statistics

import torch

from detgate.bench.engine import _device, run_once, workload
from detgate.contract.provenance import git_commit, save_result, utc_now, versions
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.constraint import Constraint
from detgate.worker.engine.engine import Engine

# Long enough that most requests use all their tokens: a list of records with free text.
SCHEMA = {"type": "array", "minItems": 16, "items": {
    "type": "object", "properties": {"name": {"type": "string"},
                                     "tags": {"type": "array", "items": {"type": "string"}},
                                     "score": {"type": "number"}, "ok": {"type": "boolean"}},
    "required": ["name", "tags", "score", "ok"], "additionalProperties": False}}
KINDS = ("unconstrained", "json_schema")


def main(args) -> int:
    from detgate.worker.model.grammar import GrammarCompiler, library_version
    from detgate.worker.model.loader import load
    from detgate.worker.tools.model_source import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig.from_args(args)
    loaded = load(resolve_model(config.model), dtype=config.dtype, device=config.device,
                  mode=config.mode)
    engine = Engine(config, loaded.model, loaded.config)
    grammar = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size).json_schema(SCHEMA)
    constraint = Constraint(grammar, 0, tuple(loaded.config.eos_token_ids))
    plain = workload(args.requests, args.max_tokens, loaded.config.vocab_size)
    loads = {"unconstrained": plain,
             "json_schema": [(ids, dataclasses.replace(p, constraint=constraint))
                             for ids, p in plain]}
    for reqs in loads.values():  # warm up
        run_once(engine, reqs[:2])
    runs: dict[str, list[dict]] = {k: [] for k in KINDS}
    for r in range(args.repeats):
        for kind in KINDS if r % 2 == 0 else reversed(KINDS):
            run = run_once(engine, loads[kind])
            runs[kind].append(run)
            print(f"{kind:14s} {run['wall_s']:7.2f} s wall {run['cpu_s']:7.2f} s CPU "
                  f"{run['generated_tokens']:6d} tokens {run['steps']:5d} steps", flush=True)
    summary = {k: _summary(runs[k]) for k in KINDS}
    base, cons = summary["unconstrained"], summary["json_schema"]
    report = {
        "benchmark": "engine_structured", "date": utc_now(), "commit": git_commit(),
        "device": _device(config), "versions": {**versions("torch", "numpy", "xgrammar"),
                                                "grammar_library": library_version()},
        "config": dataclasses.asdict(config),
        "workload": {"requests": args.requests, "prompt_tokens": "16-128",
                     "max_tokens": args.max_tokens, "schema": SCHEMA, "repeats": args.repeats,
                     "torch_threads": torch.get_num_threads()},
        "summary": summary,
        "ratio_per_step_wall": cons["median_wall_s_per_step"] / base["median_wall_s_per_step"],
        "ratio_per_token_wall": cons["median_wall_s_per_token"] / base["median_wall_s_per_token"],
        "ratio_per_token_cpu": cons["median_cpu_s_per_token"] / base["median_cpu_s_per_token"],
        "goal": "constrained <= 1.2x the unconstrained step", "runs": runs,
    }
    out = save_result(report, f"engine-structured-{config.device}-{config.dtype}", args.json)
    print(f"wrote {out}")
    print(f"json_schema / unconstrained: {report['ratio_per_step_wall']:.3f}x per step, "
          f"{report['ratio_per_token_wall']:.3f}x per token (wall), "
          f"{report['ratio_per_token_cpu']:.3f}x per token (CPU)")
    return 0


def _summary(runs: list[dict]) -> dict:
    def med(key: str, per: str) -> float:
        return statistics.median(r[key] / r[per] for r in runs)

    return {"median_wall_s_per_step": med("wall_s", "steps"),
            "median_wall_s_per_token": med("wall_s", "generated_tokens"),
            "median_cpu_s_per_token": med("cpu_s", "generated_tokens"),
            "generated_tokens": [r["generated_tokens"] for r in runs],
            "steps": [r["steps"] for r in runs]}
