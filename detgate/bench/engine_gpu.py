"""The engine experiment of issue 5, in one process: determinism, cost and the trainer check,
both numeric modes side by side, the Engine driven in process (no HTTP server needed).

    # CUDA, qwen3-8b-shape, bf16:
    PYTHONPATH=. python -m detgate.bench.engine_gpu --out OUT_DIR
    # the same code on a CPU:
    PYTHONPATH=. python -m detgate.bench.engine_gpu --device cpu --model tiny --dtype float32 \\
        --small --out OUT_DIR

1. Determinism: N identical temperature-0 requests among random concurrent traffic (arrivals
   vary step by step): unique completions, the most common's count, first divergences, and
   logprobs compared bit for bit.
2. Cost: the source workload (1000 requests, 90-110 output tokens, EOS ignored), every request
   submitted at once, in each mode; wall time, tokens/s and the ratio. With --repeats 2 the
   second pass runs the modes in the other order. Every pass starts with an empty prefix
   cache (its prompts are the same each pass); each records the prompt tokens it found cached
   and its preemptions.
3. Trainer check: teacher-forced scoring (one full forward, no KV reuse) of sampled sequences
   against their sampled logprobs, bit for bit.
A model name that is a preset (tiny, qwen3-8b-shape) is built on the device with random
weights from --seed (worker/tools/random_model.py); a folder is loaded as the worker loads it.
Phases that would start after --deadline seconds are skipped; each phase's failure is recorded and
the next one still runs. Writes OUT_DIR/engine-gpu.json after every phase; prints a table last.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import time
import traceback
from pathlib import Path

import torch

from detgate.bench.report import REFERENCE, environment, summary_table
from detgate.contract.constants import DTYPES, MODES
from detgate.worker.engine import offline as wl
from detgate.worker.engine.config import CUDA_KV_MEMORY_FRACTION, EngineConfig, card_batch_limits
from detgate.worker.engine.engine import Engine
from detgate.worker.model.attention_metadata import AttentionMetadata
from detgate.worker.model.loader import load
from detgate.worker.model.ops import make_ops
from detgate.worker.tools.make_model import PRESETS
from detgate.worker.tools.random_model import load_random

T0 = time.time()
PHASES = ("kernel_check", "build", "warmup", "decode_step", "determinism", "score", "cost",
          "cost_async", "cost_mixed_eager", "cost_eager", "cost_trace", "cost_trace_async")
TRACES = ("cost_trace", "cost_trace_async")  # diagnostics, not run by default
# The cost traces' step classes: decode-only steps by sequences, mixed by tokens (upper bounds)
DECODE_CLASSES = (64, 128, 192, 224, 240, 256, 512, 1024)
MIXED_CLASSES = (512, 1024, 1536, 2048, 4096, 8192)


def log(*parts) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *parts, flush=True)


def _prefetch_weights(text: str) -> str:
    """--prefetch-weight, checked here and parsed in main (the args go into the JSON as given)."""
    from detgate.bench.decode_ab import prefetch_weights

    try:
        prefetch_weights(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m detgate.bench.engine_gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for engine-gpu.json")
    p.add_argument("--model", default="qwen3-8b-shape", help="a preset (random weights) or folder")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--small", action="store_true", help="a few requests (CPU smoke run)")
    p.add_argument("--needles", type=int, default=200)
    p.add_argument("--fillers", type=int, default=300)
    p.add_argument("--needle-tokens", type=int, default=128)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=1, help="cost passes (alternating order)")
    p.add_argument("--score-seqs", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="CUDA: the worker's default for the card (card_batch_limits); CPU: 256")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="CUDA: the worker's default for the card; CPU: 8192")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-mb", type=int, default=None,
                   help="per engine; CUDA: the engines share the KV cache one worker would "
                        "have (85%% of what the models leave free)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--reference", action="store_true",
                   help=f"CUDA: also run {REFERENCE} (default mode with the paged attention "
                        "swapped in: the old fair reference; default mode on CUDA now has it)")
    p.add_argument("--no-reference", action="store_true", help="(the default; kept for old "
                   "command lines)")
    p.add_argument("--deadline", type=float, default=400.0, help="seconds; later phases skip")
    p.add_argument("--phases", default=",".join(p for p in PHASES if p not in TRACES),
                   help="comma-separated subset of: " + ", ".join(PHASES)
                   + " (all but the traces by default)")
    p.add_argument("--capture-width", type=int, default=1024,
                   help="warm-up captures decode graphs up to this context width")
    p.add_argument("--mixed-capture-width", type=int, default=256,
                   help="warm-up captures mixed-step graphs up to this context width")
    p.add_argument("--no-warm-logits", dest="warm_logits", action="store_false",
                   help="warm-up without the eager lm_head at every row count (the control "
                   "for what that part of a worker's warm-up does to the first cost pass)")
    p.add_argument("--table", default="", help="a kernels_proof --tune run's gpu_kernels.json: "
                   "its tuned buckets merged over the shipped matmul table for this run")
    p.add_argument("--prefetch-weight", default="", type=_prefetch_weights,
                   help="NxK:BYTES,...: matmul weight prefetch bytes per row for those "
                   "weights in this run (matmul_triton.PREFETCH_BY_WEIGHT)")
    return p


def from_bench_args(args: argparse.Namespace) -> argparse.Namespace:
    """`detgate bench engine --device cuda ...`: this experiment at its own workload sizes,
    with the model, dtype and engine limits given; JSON next to --json (or bench/results)."""
    ours = build_parser().parse_args(["--out", "bench/results"])
    for name in ("model", "dtype", "max_num_seqs", "max_num_batched_tokens", "block_size",
                 "kv_cache_mb", "enforce_eager"):
        if getattr(args, name, None) is not None:
            setattr(ours, name, getattr(args, name))
    if getattr(args, "json", None):
        ours.out = str(Path(args.json).parent)
    return ours


class Experiment:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.result: dict = {"environment": environment(args.device), "args": vars(args)}
        self.engines: dict[str, Engine] = {}
        self.reference: Engine | None = None
        self.det_reqs: list[wl.Request] = []
        self.det_out: dict[str, dict[str, wl.Completion]] = {}

    def phase(self, name: str, fn) -> None:
        if name not in self.args.phases.split(","):
            return
        if time.time() - T0 > self.args.deadline:
            self.result[name] = {"skipped": f"past the {self.args.deadline:.0f}s deadline"}
            log(f"{name}: skipped (deadline)")
            return
        start = time.time()
        log(f"{name} ...")
        try:
            self.result[name] = fn()
        except Exception:  # recorded; the next phase still runs
            self.result[name] = {"error": traceback.format_exc()}
            log(f"{name} FAILED\n{traceback.format_exc()}")
        self.result.setdefault("phase_seconds", {})[name] = round(time.time() - start, 1)
        self.save()
        log(f"{name} done in {time.time() - start:.1f}s")

    def save(self) -> None:
        (self.out / "engine-gpu.json").write_text(json.dumps(self.result, indent=1, default=str))

    # -- phases ----------------------------------------------------------------------------

    def build(self) -> dict:
        info = {}
        for mode in MODES:
            self.engines[mode], info[mode] = self._engine(mode)
        if self._with_reference:
            self.reference, info[REFERENCE] = self._engine("default", paged_attention=True)
        return info

    @property
    def _with_reference(self) -> bool:
        """--reference on CUDA: a third engine (default mode, our paged attention)."""
        a = self.args
        return a.device == "cuda" and a.reference and not a.no_reference

    def _engine(self, mode: str, paged_attention: bool = False) -> tuple[Engine, dict]:
        a = self.args
        start = time.time()
        if a.model in PRESETS:
            loaded = load_random(a.model, self.out / f"{a.model}-config", seed=a.seed,
                                 device=a.device, mode=mode, dtype=a.dtype)
        else:
            loaded = load(a.model, dtype=a.dtype, device=a.device, mode=mode)
        if paged_attention:  # every layer shares the model's one ops object
            loaded.model.ops.attention = make_ops("batch_invariant").attention
        limits = self._limits(loaded.model)
        config = EngineConfig(
            model=a.model, mode=mode, device=a.device, dtype=a.dtype, block_size=a.block_size,
            enforce_eager=a.enforce_eager, **limits)
        engine = Engine(config, loaded.model, loaded.config)
        self.vocab_size = loaded.config.vocab_size
        return engine, {"seconds": round(time.time() - start, 1),
                        "kv_blocks": engine.runner.num_kv_blocks,
                        "cuda_graphs": engine.runner.graphs is not None,
                        "parameters": sum(p.numel() for p in loaded.model.parameters()),
                        "fingerprint_parts": loaded.fingerprint_parts}

    def _limits(self, model: torch.nn.Module) -> dict:
        """The engines' scheduler limits and KV cache, the same for every engine: what a worker
        on this card takes unless the flags say otherwise (EngineConfig.from_args), except that
        two engines (three with --reference) share the card here, so each gets that share of
        one worker's KV cache: 85% of the memory free once every model is loaded (only the
        first is yet: the others are its size)."""
        if "limits" in self.result:
            return self.result["limits"]
        a = self.args
        limits = card_batch_limits(a.device) if a.device == "cuda" else {
            "max_num_seqs": 256, "max_num_batched_tokens": 8192}
        if a.max_num_seqs is not None:
            limits["max_num_seqs"] = a.max_num_seqs
        if a.max_num_batched_tokens is not None:
            limits["max_num_batched_tokens"] = a.max_num_batched_tokens
        limits["kv_cache_mb"] = a.kv_cache_mb
        if a.kv_cache_mb is None and a.device == "cuda":
            model_bytes = sum(t.numel() * t.element_size()
                              for t in (*model.parameters(), *model.buffers()))
            engines = len(MODES) + self._with_reference
            free, _ = torch.cuda.mem_get_info()
            left = free - (engines - 1) * model_bytes
            limits["kv_cache_mb"] = int(CUDA_KV_MEMORY_FRACTION * left / engines / 2**20)
        self.result["limits"] = limits
        log(f"limits: {limits}")
        return limits

    def warmup(self) -> dict:
        """Compile kernels and capture graphs before anything is timed."""
        info = {}
        small = self.args.small
        reqs = wl.cost_workload(requests=8 if small else 48, prompt=(4, 40 if small else 300),
                                output=(2, 24), vocab_size=self.vocab_size, seed=99)
        # The cost workload's prefill shapes too (two tokens each): a cold kernel variant met
        # during a timed run was seen to add 6 s to it.
        shapes = self.cost_requests(output=(2, 2), seed=98)
        reqs += [dataclasses.replace(r, request_id=f"shape-{r.request_id}") for r in shapes]
        engines = {**self.engines, **({REFERENCE: self.reference} if self.reference else {})}
        cuda = self.args.device == "cuda"
        for mode, engine in engines.items():
            start = time.time()
            graphs, mixed = engine.runner.graphs, engine.runner.mixed_graphs
            if cuda:
                torch.cuda.synchronize()
                before = torch.cuda.memory_reserved()
            # A worker's warm-up (graphs, then the eager lm_head at every row count), at the
            # widths the cost workload needs (longer contexts are captured on first use).
            warmed = engine.runner.warm_up(self.args.capture_width, self.args.mixed_capture_width,
                                           logits=self.args.warm_logits)
            memory = None
            if cuda:
                torch.cuda.synchronize()
                memory = round((torch.cuda.memory_reserved() - before) / 2**20)
            _, stats = wl.run(engine, reqs, arrival_seed=5)
            info[mode] = {**warmed, "graph_failed": bool(graphs and graphs.failed),
                          "mixed_graph_failed": bool(mixed and mixed.failed),
                          "mixed_buckets": mixed.buckets if mixed else None,
                          "warm_up_reserved_mib": memory,
                          "seconds": round(time.time() - start, 1), "steps": stats.steps}
            log(mode, info[mode])
        return info

    def determinism(self) -> dict:
        a = self.args
        self.det_reqs = wl.determinism_workload(
            needles=a.needles, fillers=a.fillers, prompt_len=100 if not a.small else 40,
            needle_tokens=a.needle_tokens, filler_prompt=(4, 400 if not a.small else 60),
            filler_tokens=(1, 160 if not a.small else 20), vocab_size=self.vocab_size,
            seed=a.seed + 1)
        info = {}
        for mode, engine in self.engines.items():
            out, stats = wl.run(engine, self.det_reqs, arrival_seed=a.seed + 2)
            self.det_out[mode] = out
            needles = [out[r.request_id] for r in self.det_reqs if r.request_id.startswith("n")]
            info[mode] = {**wl.determinism_measures(needles), "run": stats.__dict__}
            log(mode, {k: v for k, v in info[mode].items() if k != "first_divergence"})
        return info

    def cost_requests(self, output: tuple[int, int] | None = None,
                      seed: int | None = None) -> list[wl.Request]:
        a = self.args
        return wl.cost_workload(
            requests=a.requests, prompt=(32, 128) if not a.small else (8, 40),
            output=output or ((90, 110) if not a.small else (9, 11)),
            vocab_size=self.vocab_size, seed=a.seed + 3 if seed is None else seed)

    def cost(self) -> dict:
        """The cost workload, each step waiting for the one before (no asynchronous
        scheduling), both modes in alternating order."""
        with self.async_scheduling(False):
            return self._cost()

    def cost_async(self) -> dict:
        """The cost workload with asynchronous scheduling (each step launched before the
        previous step's results are on the host, the default on CUDA): what it buys over
        `cost`."""
        with self.async_scheduling(True):
            return self._cost()

    @contextlib.contextmanager
    def async_scheduling(self, on: bool):
        engines = [*self.engines.values(), *([self.reference] if self.reference else [])]
        try:
            for engine in engines:
                engine.async_scheduling = on
            yield
        finally:
            for engine in engines:
                engine.async_scheduling = engine.config.overlaps_steps

    def _cost(self) -> dict:
        a = self.args
        reqs = self.cost_requests()
        passes = []
        for i in range(a.repeats):
            order = MODES if i % 2 == 0 else MODES[::-1]
            row = {}
            for mode in order:
                self.engines[mode].reset_prefix_cache()  # every pass computes every prompt
                _, stats = wl.run(self.engines[mode], reqs, arrival_seed=None)
                row[mode] = _cost_row(stats)
                log(mode, row[mode])
            row["ratio"] = row["batch_invariant"]["seconds"] / row["default"]["seconds"]
            if self.reference is not None:
                self.reference.reset_prefix_cache()
                _, stats = wl.run(self.reference, reqs, arrival_seed=None)
                row[REFERENCE] = _cost_row(stats)
                log(REFERENCE, row[REFERENCE])
                row["ratio_vs_reference"] = (row["batch_invariant"]["seconds"]
                                             / row[REFERENCE]["seconds"])
            passes.append(row)
        ratios = [p["ratio"] for p in passes]
        return {"requests": len(reqs), "output_tokens": sum(r.params.max_tokens for r in reqs),
                "passes": passes, "ratio_mean": statistics.mean(ratios)}

    def cost_trace(self) -> dict:
        """Where the cost workload's time goes, per mode: each step waits for the one before
        (no asynchronous scheduling, so a step's seconds are its own), steps classed by kind
        and size (decode-only by sequences, mixed by tokens), seconds per class."""
        return self._trace(asynchronous=False)

    def cost_trace_async(self) -> dict:
        """`cost_trace` with asynchronous scheduling: a step's seconds are the wall time of its
        `Engine.step` (launching the next step, then collecting its own), so a class that
        overlaps its host work with the device less well than in the other mode shows up
        here and not in `cost_trace`."""
        return self._trace(asynchronous=True)

    def _trace(self, asynchronous: bool) -> dict:
        reqs = self.cost_requests()
        info: dict = {}
        with self.async_scheduling(asynchronous):
            for mode in MODES:
                trace: list[tuple[int, int, float]] = []
                self.engines[mode].reset_prefix_cache()
                _, stats = wl.run(self.engines[mode], reqs, arrival_seed=None, trace=trace)
                classes: dict[str, list[float]] = {}
                for tokens, seqs, seconds in trace:
                    if tokens == seqs:
                        bound = next((c for c in DECODE_CLASSES if seqs <= c), DECODE_CLASSES[-1])
                        name = f"decode<={bound}"
                    else:
                        bound = next((c for c in MIXED_CLASSES if tokens <= c), MIXED_CLASSES[-1])
                        name = f"mixed<={bound}"
                    classes.setdefault(name, []).append(seconds)
                info[mode] = {"seconds": stats.seconds,
                              "classes": {k: {"steps": len(v), "seconds": round(sum(v), 4),
                                              "ms_per_step": round(1e3 * statistics.mean(v), 3)}
                                          for k, v in sorted(classes.items())}}
                log(mode, info[mode])
        info["seconds_difference"] = {
            k: round(v["seconds"] - info["default"]["classes"].get(k, {}).get("seconds", 0.0), 4)
            for k, v in info["batch_invariant"]["classes"].items()}
        log("batch_invariant - default, seconds per class:", info["seconds_difference"])
        return info

    def cost_eager(self) -> dict:
        """The cost workload again with every step eager: what the CUDA graphs buy."""
        return self._cost_without(decode=True)

    def cost_mixed_eager(self) -> dict:
        """The cost workload with decode-only steps in graphs, mixed steps eager (as before
        mixed-step graphs): what those buy."""
        return self._cost_without(decode=False)

    def _cost_without(self, decode: bool) -> dict:
        engines = [*self.engines.values(), *([self.reference] if self.reference else [])]
        saved = [(engine.runner.graphs, engine.runner.mixed_graphs) for engine in engines]
        try:
            for engine in engines:
                engine.runner.mixed_graphs = None
                if decode:
                    engine.runner.graphs = None
            return self.cost()
        finally:
            for engine, (graphs, mixed) in zip(engines, saved, strict=True):
                engine.runner.graphs, engine.runner.mixed_graphs = graphs, mixed

    def score(self) -> dict:
        """Sampled needles and fillers, scored teacher-forced, all in one batch."""
        info = {}
        for mode, engine in self.engines.items():
            sampled = self.det_out[mode]
            chosen = [r for r in self.det_reqs if sampled[r.request_id].token_ids]
            pairs = wl.score_requests(sampled, chosen, self.args.score_seqs)
            scored, _ = wl.run(engine, [p for p, _ in pairs], arrival_seed=None)
            info[mode] = wl.compare_scores(
                [sampled[r.request_id] for r in chosen[:len(pairs)]],
                [scored[p.request_id] for p, _ in pairs], [n for _, n in pairs])
            log(mode, info[mode])
        return info

    def decode_step(self) -> dict:
        """GPU time of one decode step (graph replay, head and log_softmax) per batch size, every
        sequence 256 tokens long on blocks of its own: the modes' cost without the host's share
        of a step."""
        context, reps = 256, 20
        engines = {**self.engines, **({REFERENCE: self.reference} if self.reference else {})}
        info: dict = {}
        for name, engine in engines.items():
            runner = engine.runner
            nb = context // runner.block_size
            info[name] = {}
            for b in (1, 8, 32, 64, 128, 256):
                if runner.graphs is not None and b <= runner.graphs.batch_sizes[-1] \
                        and b * nb <= runner.num_kv_blocks:
                    info[name][b] = time_decode_step(runner, b, context, reps)
            log(name, "decode step ms:", info[name])
        info["ratio"] = {b: ms / info["default"][b]
                         for b, ms in info["batch_invariant"].items() if b in info["default"]}
        if self.reference is not None:
            info["ratio_vs_reference"] = {b: ms / info[REFERENCE][b]
                                          for b, ms in info["batch_invariant"].items()
                                          if b in info[REFERENCE]}
        return info

    def run(self) -> None:
        if self.args.device == "cuda":
            from detgate.bench.gpu_selfcheck import kernel_check

            self.phase("kernel_check", kernel_check)
        self.phase("build", self.build)
        if len(self.engines) < len(MODES):
            return
        self.phase("warmup", self.warmup)
        if self.args.device == "cuda" and not self.args.enforce_eager:
            self.phase("decode_step", self.decode_step)
        self.phase("determinism", self.determinism)
        if self.det_out:
            self.phase("score", self.score)
        self.phase("cost", self.cost)
        if self.args.device == "cuda":
            self.phase("cost_async", self.cost_async)
        if self.args.device == "cuda" and not self.args.enforce_eager:
            self.phase("cost_mixed_eager", self.cost_mixed_eager)
            self.phase("cost_eager", self.cost_eager)
        self.phase("cost_trace", self.cost_trace)
        if self.args.device == "cuda":
            self.phase("cost_trace_async", self.cost_trace_async)
        self.result["total_seconds"] = round(time.time() - T0, 1)
        self.save()


def _cost_row(stats: wl.RunStats) -> dict:
    mixed_steps = stats.steps - stats.decode_only_steps
    return {**stats.__dict__, "tokens_per_s": stats.generated_tokens / stats.seconds,
            "decode_step_ms": 1e3 * stats.decode_only_seconds / max(stats.decode_only_steps, 1),
            "mixed_steps": mixed_steps,
            "mixed_step_ms": 1e3 * stats.mixed_seconds / max(mixed_steps, 1),
            # Per step, the time not spent waiting for the GPU's results: host work, which the
            # GPU waits for unless asynchronous scheduling launched the next step ahead.
            "not_waiting_ms_per_step": 1e3 * (stats.decode_only_seconds + stats.mixed_seconds
                                              - stats.wait_seconds) / max(stats.steps, 1)}


@torch.inference_mode()
def time_decode_step(runner, batch: int, context: int, reps: int) -> float:
    """ms of one decode step of `batch` sequences of `context` tokens through the runner's
    CUDA graphs; sequence i reads blocks [i * nb, (i + 1) * nb) of the KV cache."""
    dev, bs = runner.device, runner.block_size
    tables = torch.arange(batch * (context // bs), dtype=torch.int32, device=dev)
    tables = tables.view(batch, context // bs)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=dev),
        # Reads any blocks, writes only the padding block: nothing cached is overwritten.
        block_tables=tables,
        slot_mapping=torch.full((batch,), runner.num_kv_blocks * bs, device=dev),
        max_query_len=1, max_seq_len=context)
    ids = torch.randint(100, 1000, (batch,), device=dev)
    pos = torch.full((batch,), context - 1, dtype=torch.int64, device=dev)

    def step() -> None:
        hidden = runner.graphs.forward(ids, pos, meta)
        runner.sampler.log_softmax(runner.model.compute_logits(hidden))

    step()  # captures the graph if it is not there yet
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main(args: argparse.Namespace) -> int:
    if args.small:
        args.needles, args.fillers, args.needle_tokens = 8, 8, 16
        args.requests, args.score_seqs = 24, 6
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu")
        return 2
    if args.table:
        from detgate.bench.decode_ab import tuned_table
        from detgate.kernels import matmul_triton

        table = tuned_table(dict(matmul_triton.TUNED_16BIT), args.table)
        matmul_triton.TUNED_16BIT.update(table)
        matmul_triton.clear_caches()
    if args.prefetch_weight:
        from detgate.bench.decode_ab import prefetch_weights
        from detgate.kernels import matmul_triton

        matmul_triton.PREFETCH_BY_WEIGHT.update(prefetch_weights(args.prefetch_weight))
        matmul_triton.clear_caches()
    experiment = Experiment(args)
    experiment.run()
    kernels_failed = [k for k, v in experiment.result.get("kernel_check", {}).items()
                      if isinstance(v, dict) and not v.get("ok", True)]
    print()
    print(summary_table(experiment.result))
    print("kernels failing the check:", ", ".join(kernels_failed) or "none")
    print("phase seconds:", experiment.result.get("phase_seconds"))
    del experiment
    gc.collect()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(build_parser().parse_args()))
