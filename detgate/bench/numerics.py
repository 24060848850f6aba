"""`detgate bench numerics`: do a worker's answers and fingerprint follow the machine variants
this host can take (threads, the CPU kernels' build, torch's CPU kernels)? The variants and the
check are detgate/worker/engine/machine_probe.py's; this runs them all and saves the table.
Expected: batch_invariant on x86-64, one fingerprint and one digest for all variants; default
mode, other digests under other fingerprints.
"""

from __future__ import annotations

import os

from detgate.contract.provenance import cpu_model, git_commit, save_result, utc_now, versions
from detgate.worker.engine.machine_probe import PROMPTS, VARIANTS, run_variant, violations


def main(args) -> int:
    from detgate.worker.tools.model_source import resolve_model

    folder = str(resolve_model(args.model))
    threads = ",".join(str(t) for t in sorted({1, 2, os.cpu_count() or 1}))
    runs = []
    for name, env in VARIANTS.items():
        print(f"variant {name} ({env or 'as installed'}) ...", flush=True)
        for r in run_variant(folder, env, modes=args.modes, dtypes=args.dtypes,
                             threads=threads, max_tokens=args.max_tokens):
            runs.append({"variant": name, "env": env, **r})
            print(f"  {r['mode']:<15} {r['dtype']:<8} {r['threads']} threads  "
                  f"{r['fingerprint'][:16]}  {r['digest'][:16]}", flush=True)
    summary = {}
    for mode in args.modes.split(","):
        for dtype in args.dtypes.split(","):
            mine = [r for r in runs if (r["mode"], r["dtype"]) == (mode, dtype)]
            summary[f"{mode}/{dtype}"] = {
                "runs": len(mine), "fingerprints": len({r["fingerprint"] for r in mine}),
                "digests": len({r["digest"] for r in mine}),
                "same_fingerprint_different_bits": len(violations(mine))}
    for key, s in summary.items():
        print(f"{key}: {s['runs']} runs, {s['fingerprints']} fingerprints, {s['digests']} "
              f"distinct answers, {s['same_fingerprint_different_bits']} pairs of one "
              "fingerprint with different bits")
    report = {"benchmark": "numerics", "date": utc_now(), "commit": git_commit(),
              "device": {"cpu": cpu_model(), "cores": os.cpu_count()},
              "versions": versions("torch"),
              "workload": {"model": args.model, "prompts": len(PROMPTS),
                           "requests": 2 * len(PROMPTS), "max_tokens": args.max_tokens,
                           "threads": threads, "variants": VARIANTS},
              "runs": runs, "summary": summary}
    path = save_result(report, "numerics-cpu", args.json)
    print(f"saved {path}")
    return 0
