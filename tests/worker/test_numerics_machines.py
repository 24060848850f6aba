"""The fingerprint follows the numerics (worker/model/numerics.py): runs of one fingerprint give
the same bits, and a batch_invariant worker's fingerprint leaves the machine out.

Each variant is a process started as another machine would run
(detgate/worker/engine/machine_probe.py):
the CPU kernels' native AVX2 build or the portable one, torch's own CPU kernels as installed
(AVX-512 on an AVX-512 CPU), as an AVX2 CPU gets them, or its default (no vector ISA); inside,
1 and 2 threads. Every run answers the same greedy and seeded sampled requests; a digest covers
every token id and logprob bit.

- batch_invariant (tiny fp32 and bf16; SmolLM2 fp32 where installed): one fingerprint, one
  digest, across every variant.
- default, the negative control: its bits differ between variants (torch's kernels), its
  fingerprint follows them (and the thread count), and a fingerprint that left those parts out
  would put runs with different bits under one fingerprint: `violations` finds them, so the
  check above cannot pass for want of sensitivity.
"""

from __future__ import annotations

import json

import pytest
import torch

from detgate.kernels.cpu_ext import load
from detgate.worker.engine.machine_probe import VARIANTS, parts_sha256, run_variant, violations


def _runs(model: str, **kwargs) -> list[dict]:
    runs = []
    for name, env in VARIANTS.items():
        runs += [{"variant": name, **r} for r in run_variant(model, env, **kwargs)]
    for r in runs:
        print(r["variant"], r["mode"], r["dtype"], r["threads"], r["fingerprint"],
              r["digest"][:16])
    return runs


@pytest.fixture(scope="module")
def tiny_runs(tiny_model) -> list[dict]:
    return _runs(str(tiny_model), max_tokens=8)


def _of(runs: list[dict], mode: str, dtype: str) -> list[dict]:
    return [r for r in runs if (r["mode"], r["dtype"]) == (mode, dtype)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_bits_and_fingerprint_do_not_depend_on_the_machine(tiny_runs, dtype):
    runs = _of(tiny_runs, "batch_invariant", dtype)
    assert len(runs) == 2 * len(VARIANTS)
    assert len({r["digest"] for r in runs}) == 1, "the answers' bits depend on the variant"
    assert len({r["fingerprint"] for r in runs}) == 1
    # The variants did run as meant: both kernel builds, torch's CPU kernels as installed, as
    # an AVX2 CPU gets them and without a vector ISA (two of them where this CPU's own are the
    # AVX2 ones), 1 and 2 threads.
    machines = [r["machine"] for r in runs]
    assert {m["cpu_kernels"] for m in machines} == {load(b).isa() for b in ("native", "baseline")}
    assert {m["torch_cpu_capability"] for m in machines} == {
        torch.backends.cpu.get_cpu_capability(), "AVX2", "DEFAULT"}
    assert {m["torch_threads"] for m in machines} == {1, 2}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_mode_fingerprint_follows_its_bits(tiny_runs, dtype):
    runs = _of(tiny_runs, "default", dtype)
    assert not violations(runs), "default-mode runs of one fingerprint differ in bits"
    # Its bits do depend on the machine: torch's CPU kernels (log_softmax, SDPA, ...) differ.
    assert len({r["digest"] for r in runs}) > 1
    # The thread count is a part, whether or not these shapes showed a difference.
    by_variant = {}
    for r in runs:
        by_variant.setdefault(r["variant"], set()).add(r["fingerprint"])
    assert all(len(fps) == 2 for fps in by_variant.values())

    # The negative control: a fingerprint blind to the parts that vary between these runs
    # (what a machine-free rule would hash for default mode) joins runs with other bits.
    varying = {k for k in runs[0]["parts"]
               if len({json.dumps(r["parts"][k]) for r in runs}) > 1}
    assert varying, "the runs' fingerprints hash nothing that differs"
    for r in runs:
        r["blind"] = parts_sha256({k: v for k, v in r["parts"].items() if k not in varying})
    assert violations(runs, key="blind"), "the check would not catch a fingerprint that " \
                                          "leaves out what changes bits"


def test_smollm2_batch_invariant_across_machines(smollm2_folder):
    """The real model, fp32: torch's CPU kernels as installed and 1 thread against its AVX2
    ones (its default ones on an AVX2 CPU) and 2 threads, the native kernel build on both (the
    portable one runs SmolLM2 too slowly for the suite: the tiny model covers it above, and
    `detgate bench numerics` runs SmolLM2 on it). One fingerprint, one digest."""
    other = "default" if torch.backends.cpu.get_cpu_capability() == "AVX2" else "avx2"
    runs = []
    for env, threads in (({}, "1"), ({"ATEN_CPU_CAPABILITY": other}, "2")):
        runs += run_variant(str(smollm2_folder), env, modes="batch_invariant",
                            dtypes="float32", threads=threads, max_tokens=8)
    assert len(runs) == 2
    assert runs[0]["machine"]["torch_cpu_capability"] != runs[1]["machine"]["torch_cpu_capability"]
    assert runs[0]["digest"] == runs[1]["digest"]
    assert runs[0]["fingerprint"] == runs[1]["fingerprint"]
