"""Where one engine step's GPU time goes, per numeric mode (CUDA): a decode-only step and a step
that mixes prefill chunks and decodes, eager and replayed from the runner's CUDA graphs, and
the eager step's kernels summed by kind (matmul, attention, norm, other) under torch.profiler.

    PYTHONPATH=. python -m detgate.bench.step_profile --out OUT_DIR [--model qwen3-8b-shape]

Step shapes: decode_1 / decode_64 / decode_256 = that many sequences of 256 tokens (the decode
step goals); mixed_1018 = 250 decodes (context 200) + 6 prompts of 128 tokens prefilled at once
(1018 tokens); mixed_1250 = 240 decodes (context 150) + 10 prompts of 101 tokens (the slowest
class of mixed steps at 256 sequences); decode_1000 and mixed_8192 = the cost workload's steps at
a big card's limits (1,024 sequences, 8,192 tokens): 1,000 decodes of 160 tokens of context
(their middle), and 892 decodes (context 120) + 73 prompts of 100 tokens. K/V are written into
the padding block only; keys are read from blocks of their own. Besides the forward, each step's
head as the engine runs it eagerly after the graph (lm_head on the sampled rows, argmax, the
chosen token's logprob and rank: `head_ms`, of which `lm_head_ms`), with its kernels by kind.
Writes OUT_DIR/step-profile.json.

With programmatic dependent launch (kernels/pdl.py) a kernel of ours starts before its
predecessor ends and waits inside: the profiler counts that wait as the kernel's time, so the
per-kind sums overlap (their total exceeds the step). Compare the modes by graph_ms, or run with
DETGATE_PDL=0 for sums that add up.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from detgate.bench.report import environment
from detgate.contract.constants import MODES
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.engine import Engine
from detgate.worker.model.attention_metadata import AttentionMetadata
from detgate.worker.tools.random_model import load_random

KINDS = (("attention", ("attn", "combine", "store_kv")),
         ("matmul", ("matmul", "gemm", "nvjet", "cutlass", "sm90", "cublas", "splitk")),
         ("norm", ("rms_norm", "row_sum")),
         ("fused_pointwise", ("qkv_kernel", "silu_and_mul", "rotary")),
         ("log_softmax", ("log_softmax", "softmax")))


STEPS = {"decode_1": (1, 256, 0, 0), "decode_64": (64, 256, 0, 0),
         "decode_256": (256, 256, 0, 0), "mixed_1018": (250, 200, 6, 128),
         "mixed_1250": (240, 150, 10, 101), "decode_1000": (1000, 160, 0, 0),
         "mixed_8192": (892, 120, 73, 100)}
MAX_NUM_SEQS = 1024  # room for decode_1000 (graphs serve up to max_num_seqs - 1 sequences)


def kind(name: str) -> str:
    low = name.lower()
    return next((k for k, keys in KINDS if any(x in low for x in keys)), "other")


def step_inputs(runner, decodes: int, context: int, prompts: int, prompt_len: int):
    """ids, positions, meta of `decodes` one-token sequences of `context` tokens followed by
    `prompts` whole prompts of `prompt_len` tokens; sequence i reads its own blocks."""
    dev, bs = runner.device, runner.block_size
    lens = [context] * decodes + [prompt_len] * prompts
    qlens = [1] * decodes + [prompt_len] * prompts
    width = -(-max(lens) // bs)
    tables = torch.arange(len(lens) * width, dtype=torch.int32, device=dev).view(len(lens), width)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32,
                       device=dev)
    t = sum(qlens)
    pos = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, qlens, strict=True)])
    meta = AttentionMetadata(
        query_start_loc=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        block_tables=tables, slot_mapping=torch.full((t,), runner.num_kv_blocks * bs, device=dev),
        max_query_len=max(qlens), max_seq_len=max(lens))
    ids = torch.randint(100, 1000, (t,), device=dev)
    return ids, pos.to(dev), meta


def time_ms(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@torch.inference_mode()
def profile_mode(mode: str, model: str, out: Path) -> dict:
    loaded = load_random(model, out / f"{model}-config", seed=0, device="cuda", mode=mode)
    engine = Engine(EngineConfig(model=model, mode=mode, device="cuda", dtype="bfloat16",
                                 max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=8192,
                                 kv_cache_mb=32 * 1024), loaded.model, loaded.config)
    runner = engine.runner
    info = {}
    for name, shape in STEPS.items():
        info[name] = measure(runner, *step_inputs(runner, *shape))
        row = info[name]
        print(mode, name, {k: v for k, v in row.items() if k not in ("top_kernels", "head")},
              flush=True)
        for ms, n, k in row["top_kernels"]:
            print(f"    {ms:8.3f} ms  x{n:<5} {k}", flush=True)
        print("  head", {k: v for k, v in row["head"].items() if k != "top_kernels"}, flush=True)
        for ms, n, k in row["head"]["top_kernels"]:
            print(f"    {ms:8.3f} ms  x{n:<5} {k}", flush=True)
    return info


def measure(runner, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> dict:
    graphs = runner.graphs if meta.max_query_len == 1 else runner.mixed_graphs

    def eager() -> torch.Tensor:
        return runner.model(ids, pos, meta, runner.kv_caches)

    def graph():
        assert graphs.forward(ids, pos, meta) is not None

    hidden = eager()
    # The rows that sample: each sequence's last scheduled token.
    rows = (meta.query_start_loc[1:] - 1).long()

    def lm_head():
        runner.model.compute_logits(hidden[rows])

    def head():  # ModelRunner.launch after the forward, greedy, logprobs=0
        logits = runner.model.compute_logits(hidden[rows])
        sampled = runner.sampler.sample(logits, [])
        runner.sampler.logprobs(logits, sampled, num_top=0, with_rank=True)

    row = {"tokens": int(ids.shape[0]), "sampled_rows": int(rows.shape[0]),
           "eager_ms": time_ms(eager), "graph_ms": time_ms(graph),
           "head_ms": time_ms(head), "lm_head_ms": time_ms(lm_head)}
    row.update(kernels(eager))
    row["head"] = kernels(head)
    return row


def kernels(fn) -> dict:
    """One run of fn under torch.profiler: its kernels' GPU ms by kind, their total, the number
    of launches and the top kernels."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = {}
    top = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us <= 0 or e.key.startswith("cuda") or e.key.startswith("Memcpy"):
            continue
        by_kind[kind(e.key)] = by_kind.get(kind(e.key), 0.0) + us / 1e3
        top.append((us / 1e3, e.count, e.key[:90]))
    return {"kernel_ms_by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items())},
            "kernel_ms_total": round(sum(by_kind.values()), 3),
            "launches": sum(n for _, n, _ in top),
            "top_kernels": [[round(ms, 3), n, k] for ms, n, k in sorted(top, reverse=True)[:12]]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-8b-shape")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"environment": environment("cuda"), "args": vars(args)}
    start = time.time()
    for mode in MODES:
        result[mode] = profile_mode(mode, args.model, out)
        gc.collect()
        torch.cuda.empty_cache()
    result["seconds"] = round(time.time() - start, 1)
    (out / "step-profile.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
