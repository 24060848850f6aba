"""Machine variants of one host, and whether a model's answers and fingerprint follow them.

One process per variant of what a process takes only at its start: the CPU kernels' build
(DETGATE_CPU_KERNELS: native AVX2 or portable) and torch's own CPU kernels
(ATEN_CPU_CAPABILITY: default, avx2, avx512: the code torch picks on other CPUs). Inside each
(`python -m detgate.worker.engine.machine_probe FOLDER`), for every mode, dtype and thread
count, the model answers a fixed set of greedy and seeded sampled requests (an in-process
engine, all requests batched together), and each run reports the fingerprint's parts a worker
started so would hash (worker/model/numerics.py; the server adds only its sources, the same
files in every variant) and a SHA-256 over every token id and logprob bit pattern.

The fingerprint follows the numerics when runs of one fingerprint always have one digest
(`violations` finds those that do not). `detgate bench numerics` reports the runs;
tests/worker/test_numerics_machines.py checks them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
from itertools import combinations

# name -> environment of the variant's process.
VARIANTS: dict[str, dict[str, str]] = {
    "native": {},
    "portable+torch-avx2": {"DETGATE_CPU_KERNELS": "baseline", "ATEN_CPU_CAPABILITY": "avx2"},
    "native+torch-default": {"ATEN_CPU_CAPABILITY": "default"},
}
PROMPTS = ["What is the capital of France?", "Tell me about Richard Feynman.",
           "Write a haiku about the sea.", "List three prime numbers."]


def run_variant(folder: str, env: dict[str, str], *, modes: str = "batch_invariant,default",
                dtypes: str = "float32,bfloat16", threads: str = "1,2", max_tokens: int = 12,
                timeout_s: float = 900) -> list[dict]:
    """The runs of one variant process (its stdout's JSON lines) on the checkpoint `folder`."""
    out = subprocess.run(
        [sys.executable, "-m", "detgate.worker.engine.machine_probe", folder, "--modes", modes,
         "--dtypes", dtypes, "--threads", threads, "--max-tokens", str(max_tokens)],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"machine probe {env} failed:\n{out.stderr[-4000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def violations(runs: list[dict], key: str = "fingerprint") -> list[tuple[dict, dict]]:
    """Pairs of runs of one mode and dtype with the same `key` but different bits."""
    return [(a, b) for a, b in combinations(runs, 2)
            if (a["mode"], a["dtype"], a[key]) == (b["mode"], b["dtype"], b[key])
            and a["digest"] != b["digest"]]


def parts_sha256(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _requests(tokenizer, max_tokens: int):
    """Each prompt greedy (the first with its prompt's logprobs: a whole prefill's
    log_softmax), then sampled with a seed (top-p and top-k: the sampler's softmax, sort and
    cumsum, and the generator's draw)."""
    from detgate.worker.engine.offline import Request
    from detgate.worker.engine.sequence import SamplingParams

    out = []
    for i, text in enumerate(PROMPTS):
        ids = tokenizer.encode(text)
        out.append(Request(f"greedy-{i}", ids, SamplingParams(
            max_tokens=max_tokens, logprobs=0, ignore_eos=True,
            prompt_logprobs=0 if i == 0 else None)))
        out.append(Request(f"sampled-{i}", ids, SamplingParams(
            max_tokens=max_tokens, temperature=0.9, top_p=0.9, top_k=50 * (i % 2),
            seed=100 + i, logprobs=0, ignore_eos=True)))
    return out


def digest(completions: dict) -> str:
    """SHA-256 over the ids and the logprobs' bit patterns (a float64 holds an fp32 exactly)."""
    h = hashlib.sha256()
    for rid in sorted(completions):
        c = completions[rid]
        h.update(rid.encode() + struct.pack(f"<{len(c.token_ids)}q", *c.token_ids))
        for values in (c.logprobs, c.prompt_logprobs):
            h.update(b"|" + b"".join(struct.pack("<d", float("nan") if v is None else v)
                                     for v in values))
    return h.hexdigest()


def main(argv: list[str]) -> None:
    """The variant process: one JSON line per (mode, dtype, threads)."""
    import torch

    from detgate.worker.engine.config import EngineConfig
    from detgate.worker.engine.engine import Engine
    from detgate.worker.engine.offline import run
    from detgate.worker.model import numerics
    from detgate.worker.model.loader import load

    p = argparse.ArgumentParser()
    p.add_argument("model", help="a checkpoint folder")
    p.add_argument("--modes", default="batch_invariant,default")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--max-tokens", type=int, default=12)
    args = p.parse_args(argv)
    path = args.model
    cpu = torch.device("cpu")
    for mode in args.modes.split(","):
        for dtype in args.dtypes.split(","):
            loaded = load(path, dtype=dtype, device="cpu", mode=mode)
            reqs = _requests(loaded.tokenizer, args.max_tokens)
            base = loaded.fingerprint_parts
            for threads in map(int, args.threads.split(",")):
                torch.set_num_threads(threads)
                config = EngineConfig(model=str(path), mode=mode, dtype=dtype, num_kv_blocks=64,
                                      self_check=False)
                completions, _ = run(Engine(config, loaded.model, loaded.config), reqs,
                                     arrival_seed=None)
                # What a worker started with this many threads would hash.
                parts = numerics.fingerprint_parts(
                    base["weights_sha256"], base["config_sha256"], base["tokenizer_sha256"],
                    mode, loaded.config.dtype, cpu)
                print(json.dumps({"mode": mode, "dtype": dtype, "threads": threads,
                                  "fingerprint": parts_sha256(parts), "parts": parts,
                                  "machine": numerics.machine(mode, cpu),
                                  "digest": digest(completions)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
