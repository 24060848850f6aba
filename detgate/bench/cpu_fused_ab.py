"""A/B of the CPU engine's one-call RMSNorm, residual add + RMSNorm and rotary (fp32) against
the torch compositions they replaced (the same bits: tests/kernels/test_cpu_fused_pointwise.py),
in one process (CPU).

    PYTHONPATH=. python -m detgate.bench.cpu_fused_ab [--threads 1,2] [--rounds 6]

One batch_invariant engine on SmolLM2-135M's quantised GGUF blocks, 16 requests of 64 greedy
tokens (detgate/bench/engine.py's workload); per thread count the two variants alternate for
`--rounds` rounds (their order flipped every round), so drift of a shared machine falls on
both. What the fusion saves is host work between compiled calls, which no thread count
shortens: the share that limits how a worker scales from one core to many. Saves the JSON
with device, versions and commit under bench/results/ (medians and every round).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from detgate.bench.engine import build, run_once, workload
from detgate.contract.provenance import cpu_model, git_commit, save_result, utc_now, versions
from detgate.kernels import cpu
from detgate.worker.engine.config import EngineConfig
from detgate.worker.model import ops as model_ops

FUSED = (cpu.rms_norm, cpu.add_rms_norm, model_ops.BatchInvariantOps.rotate)
# The rotary module's torch ops: default mode's rotate
COMPOSED = (cpu.rms_norm_composed, cpu.add_rms_norm_composed, model_ops.DefaultOps.rotate)


def _use(fns) -> None:
    cpu.rms_norm, cpu.add_rms_norm, model_ops.BatchInvariantOps.rotate = fns


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    engine, weights = build(EngineConfig(model="smollm2-135m-instruct", mode="batch_invariant",
                                         device="cpu", dtype="float32",
                                         weights_format="quantised"))
    vocab = engine.runner.model_config.vocab_size
    requests = workload(16, 64, vocab)
    results = {}
    try:
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            run_once(engine, workload(2, 4, vocab, seed=1))  # warm up at this thread count
            walls: dict[str, list[float]] = {"composed": [], "fused": []}
            for r in range(args.rounds):
                order = (("composed", COMPOSED), ("fused", FUSED))
                for name, fns in order if r % 2 == 0 else order[::-1]:
                    _use(fns)
                    walls[name].append(run_once(engine, requests)["wall_s"])
            median = {n: statistics.median(v) for n, v in walls.items()}
            results[threads] = {"median_wall_s": median, "rounds_wall_s": walls,
                                "fused_over_composed": median["fused"] / median["composed"]}
            print(f"{threads} thread(s): composed {median['composed']:.3f} s, fused "
                  f"{median['fused']:.3f} s ({median['fused'] / median['composed']:.3f}x)",
                  flush=True)
    finally:
        _use(FUSED)
    report = {"benchmark": "cpu-fused-ab", "date": utc_now(), "commit": git_commit(),
              "device": {"type": "cpu", "name": cpu_model()},
              "versions": versions("torch", "numpy"),
              "workload": {"model": "smollm2-135m-instruct", "weights": weights,
                           "requests": 16, "max_tokens": 64, "rounds": args.rounds,
                           "sampling": "greedy, logprobs=0, ignore_eos"},
              "variants": {"composed": "torch ops around the compiled inv_rms; rotary module",
                           "fused": "one compiled call each (kernels/cpu.py)"},
              "results": results}
    print(f"wrote {save_result(report, 'cpu-fused-ab-smollm2', args.json)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
