"""`detgate bench kernels --eager` (CUDA): the kernels as users call them (host cost included)
against torch, and the host cost of `kernels.set_batch_invariant_mode()` on a Hugging Face
model, in one run.

    detgate bench kernels --eager --json OUT.json [--skip-model | --model-only] [--profile]

- matmul: `kernels.matmul(x, W.t())` against `F.linear(x, W)` (cuBLAS) on the same bf16
  inputs, Qwen3-8B projections, M = 1..8192. "eager": CUDA events around CALLS back-to-back
  calls after WARMUP, rotating weight copies (so the host must keep up with the GPU, as in an
  eager forward); median of REPEATS. "graph": the same calls replayed from a CUDA graph
  (`timing.graph_ms`: launch cost out). Ratio = torch time / ours: above 1 we are
  faster. Each row also says whether `kernels.matmul` is bitwise invariant over every M of
  the list.
- rms_norm, add_rms_norm, log_softmax: the same eager timing.
- model: transformers' Qwen3 (8B widths, LAYERS layers, bf16, random weights, 64-token
  sequences), eager forward with and without the mode at batch 1 / 8 / 64, timed in ROUNDS
  alternating rounds (host time drifts between runs), and whether row 0 is bit-identical
  across batch sizes (with the mode it must be; without, the control).
- profile (--profile): where the host time of a batch-1 forward goes, with and without the
  mode: torch.profiler's ops by self CPU time, and cProfile's Python functions by own time
  (batch 1 and 8); and where a batch-8 forward's device time goes: kernels by self device
  time.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from detgate import kernels
from detgate.bench import kernels_gpu as bench
from detgate.bench.timing import events_ms, graph_ms
from detgate.kernels import rmsnorm_triton
from detgate.kernels.bits import same_bits

WARMUP, CALLS, REPEATS = 5, 30, 5
LAYERS, SEQ = 4, 64
MODEL_BATCHES = (1, 8, 64)


def eager_us(call: Callable[[int], object], copies: int) -> float:
    """Microseconds per call: CALLS eager calls between two CUDA events, median of REPEATS."""
    return 1000 * events_ms(lambda i: call(i % copies), CALLS, REPEATS, warmup=WARMUP)


def _pair(ours: Callable, ref: Callable, copies: int, out_bytes: int) -> dict:
    row = {"eager_ours_us": eager_us(ours, copies), "eager_torch_us": eager_us(ref, copies),
           "graph_ours_us": 1000 * graph_ms(ours, copies, out_bytes),
           "graph_torch_us": 1000 * graph_ms(ref, copies, out_bytes)}
    row["eager_ratio"] = row["eager_torch_us"] / row["eager_ours_us"]
    row["graph_ratio"] = row["graph_torch_us"] / row["graph_ours_us"]
    return row


def matmul_rows(m_values=bench.M_VALUES) -> list[dict]:
    rows = []
    for name, (n, k) in bench.MATMUL_SHAPES.items():
        weights = bench.matmul_weights(n, k)
        x = torch.randn(max(m_values), k, device="cuda", dtype=torch.bfloat16)
        full = kernels.matmul(x, weights[0].t())
        for m in m_values:
            a = x[:m]
            row = {"op": "matmul", "shape": name, "n": n, "k": k, "m": m,
                   **_pair(lambda i, a=a, ws=weights: kernels.matmul(a, ws[i].t()),
                           lambda i, a=a, ws=weights: F.linear(a, ws[i]), len(weights), m * n * 2),
                   "bitwise_equal_to_full_batch": same_bits(
                       kernels.matmul(a, weights[0].t()), full[:m])}
            rows.append(row)
            print(f"matmul {name:<13} M={m:<5} eager {row['eager_ratio']:5.2f}x "
                  f"({row['eager_ours_us']:8.1f} vs {row['eager_torch_us']:8.1f} us)  graph "
                  f"{row['graph_ratio']:5.2f}x  invariant {row['bitwise_equal_to_full_batch']}",
                  flush=True)
        del weights, x, full
        torch.cuda.empty_cache()
    return rows


def norm_rows(m_values=(1, 8, 64, 512, 4096)) -> list[dict]:
    rows = []
    w = torch.randn(bench.HIDDEN, device="cuda", dtype=torch.bfloat16)
    for m in m_values:
        nbytes = m * bench.HIDDEN * 2
        xs = bench.randn_copies(m, bench.HIDDEN, torch.bfloat16, 2 * nbytes)
        rs = bench.randn_copies(m, bench.HIDDEN, torch.bfloat16, 2 * nbytes)
        c = len(xs)
        rows.append({"op": "rms_norm", "m": m, **_pair(
            lambda i, xs=xs: rmsnorm_triton.rms_norm(xs[i], w, bench.EPS),
            lambda i, xs=xs: bench.torch_rms_norm(xs[i], w, bench.EPS), c, nbytes)})
        rows.append({"op": "add_rms_norm", "m": m, **_pair(
            lambda i, xs=xs, rs=rs: rmsnorm_triton.add_rms_norm(xs[i], rs[i], w, bench.EPS),
            lambda i, xs=xs, rs=rs: bench.torch_add_rms_norm(
                xs[i], rs[i], w, bench.EPS), c, 2 * nbytes)})
    for m in m_values[:4]:
        nbytes = m * bench.VOCAB * 4
        xs = bench.randn_copies(m, bench.VOCAB, torch.float32, 2 * nbytes)
        rows.append({"op": "log_softmax", "m": m, **_pair(
            lambda i, xs=xs: kernels.log_softmax(xs[i], -1),
            lambda i, xs=xs: torch.log_softmax(xs[i], -1), len(xs), nbytes)})
    for r in rows:
        print(f"{r['op']:<13} M={r['m']:<5} eager {r['eager_ratio']:5.2f}x "
              f"({r['eager_ours_us']:7.1f} vs {r['eager_torch_us']:7.1f} us)  graph "
              f"{r['graph_ratio']:5.2f}x", flush=True)
    return rows


# An eager forward at small batches is bound by host time, which drifts (clocks, other
# processes): the two modes are timed in alternating rounds, each a median of FORWARDS.
ROUNDS, FORWARDS = 5, 10


def _forward_ms(model, ids: torch.Tensor) -> tuple[list[float], list[float]]:
    """Milliseconds of one eager forward (without the mode, in the mode), per round: ROUNDS
    alternating rounds, each the median of FORWARDS forwards after 3 warm-ups."""
    plain, mode = [], []
    for _ in range(ROUNDS):
        plain.append(events_ms(lambda _: model(ids), 1, FORWARDS, warmup=3))
        with kernels.set_batch_invariant_mode():
            mode.append(events_ms(lambda _: model(ids), 1, FORWARDS, warmup=3))
    return plain, mode


def _row0_identical(model, ids: torch.Tensor) -> dict[int, bool]:
    alone = model(ids[:1]).logits[0]
    return {b: same_bits(model(ids[:b]).logits[0], alone) for b in (2, 8, 64)}


def _host_profile(model, ids: torch.Tensor, forwards: int = 20) -> dict[str, str]:
    """Text tables of where a forward's host time goes: aten ops (torch.profiler, self CPU
    time) and Python functions (cProfile, own time), each over `forwards` forwards."""
    model(ids)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(forwards):
            model(ids)
    torch.cuda.synchronize()
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(forwards):
        model(ids)
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    return {"aten_ops": ops, "python": text.getvalue()}


def _device_profile(model, ids: torch.Tensor, forwards: int = 10) -> dict:
    """Where a forward's device time goes: kernels by self device time (torch.profiler) over
    `forwards` forwards, and the mean device milliseconds per forward."""
    model(ids)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(forwards):
            model(ids)
        torch.cuda.synchronize()
    events = prof.key_averages()
    # Kernels only: an op's own row repeats the device time of the kernels it launched.
    device_us = sum(e.self_device_time_total for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"device_ms_per_forward": device_us / forwards / 1e3,
            "kernels": events.table(sort_by="self_device_time_total", row_limit=25)}


def profile_rows(model, ids: torch.Tensor) -> dict:
    """Host profiles at batch 1 and 8 and device profiles at batch 8, without and in the
    mode."""
    out = {}
    for in_mode in (False, True):
        mode = "in_mode" if in_mode else "without_mode"
        with kernels.set_batch_invariant_mode(in_mode):  # enabled=False: a no-op
            for batch, key in ((1, mode), (8, f"batch8_{mode}")):
                tables = out[key] = _host_profile(model, ids[:batch])
                print(f"--- host profile, batch {batch}, {mode}\n{tables['aten_ops']}\n"
                      f"{tables['python']}", flush=True)
            device = out[f"device_batch8_{mode}"] = _device_profile(model, ids[:8])
        print(f"--- device profile, batch 8, {mode}: {device['device_ms_per_forward']:.3f} ms "
              f"of device time per forward\n{device['kernels']}", flush=True)
    return out


def model_rows(profile: bool = False) -> dict:
    import transformers

    config = transformers.Qwen3Config(
        hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, num_hidden_layers=LAYERS, vocab_size=151936,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (max(MODEL_BATCHES), SEQ), device="cuda")
    result = {"model": f"Qwen3 (8B widths, {LAYERS} layers, bf16, random), {SEQ}-token rows",
              "transformers": transformers.__version__,
              "attn_implementation": model.config._attn_implementation, "batches": []}

    with torch.inference_mode():
        for b in MODEL_BATCHES:
            plain_rounds, mode_rounds = _forward_ms(model, ids[:b])
            plain, mode = statistics.median(plain_rounds), statistics.median(mode_rounds)
            result["batches"].append({"batch": b, "forward_ms_without_mode": plain,
                                      "forward_ms_in_mode": mode, "overhead": mode / plain,
                                      "rounds_ms_without_mode": plain_rounds,
                                      "rounds_ms_in_mode": mode_rounds})
            print(f"model batch {b:<3} without mode {plain:7.2f} ms  in mode {mode:7.2f} ms  "
                  f"({mode / plain:.2f}x)", flush=True)
        with kernels.set_batch_invariant_mode():
            result["row0_bit_identical_in_mode"] = _row0_identical(model, ids)
        result["row0_bit_identical_without_mode"] = _row0_identical(model, ids)
        if profile:
            result["host_profile"] = profile_rows(model, ids)
    print("row 0 identical in mode:", result["row0_bit_identical_in_mode"],
          "without:", result["row0_bit_identical_without_mode"], flush=True)
    del model
    torch.cuda.empty_cache()
    return result


def run(skip_model: bool = False, model_only: bool = False, profile: bool = False) -> dict:
    result = {**bench.environment(), "timing": {
        "eager": f"CUDA events around {CALLS} back-to-back eager calls after {WARMUP} "
                 f"warm-ups, median of {REPEATS}, rotating weight copies (host cost included)",
        "graph": "median CUDA-graph replay of back-to-back calls (timing.graph_ms)",
        "model": f"one eager forward between CUDA events, median of {FORWARDS} after 3 warm-ups, "
                 f"without and in the mode alternately, median of {ROUNDS} such rounds"}}
    result["matmul"] = [] if model_only else matmul_rows()
    result["norms"] = [] if model_only else norm_rows()
    if not skip_model:
        result["model"] = model_rows(profile)
    misses = [f"{r['shape']} M={r['m']}: eager {r['eager_ratio']:.2f}x"
              for r in result["matmul"] if r["eager_ratio"] < 0.8]
    result["summary"] = {
        "eager_matmul_below_0.8": misses,
        "matmul_not_invariant": [f"{r['shape']} M={r['m']}" for r in result["matmul"]
                                 if not r["bitwise_equal_to_full_batch"]],
        "model_overhead": {b["batch"]: round(b["overhead"], 3)
                           for b in result.get("model", {}).get("batches", [])}}
    print("summary:", json.dumps(result["summary"]), flush=True)
    return result


def main(args) -> int:
    if not torch.cuda.is_available():
        print("the eager kernel benchmark needs a CUDA device")
        return 2
    result = run(skip_model=args.skip_model, model_only=args.model_only, profile=args.profile)
    bench.write_json(result, args.json)
    return 0
