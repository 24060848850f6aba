"""A/B of the decode step's GPU time between variants of its kernels, in one process (CUDA).

    PYTHONPATH=. python -m detgate.bench.decode_ab --out OUT_DIR [--rounds 3]

One batch_invariant engine on the random-weight model; per variant and batch size, the decode
step (every layer, lm_head and log_softmax, every sequence `--context` tokens long on blocks of
its own) is captured into a CUDA graph of its own and replayed; variants take turns within a
round, rounds repeat in rotated order, so drift of the machine falls on every variant alike.
Variants: the general launch of the paged attention (`general`), the decode launch (program
i = sequence i) with the prefill's 64-row tiles (`decode_rows64`) and with its own tiles
(`decode`, kernels/attention_tiles.py DECODE), picked through the step's max_query_len as the
engine picks it; `--tiles m16n64w4s3,...` adds decode launches with other tiles (rows, BLOCK_N,
warps, stages); `--prefetch 0,2048,...` adds the decode variant with each matmul weight
prefetch (bytes per weight row, kernels/matmul_triton.py PREFETCH_ROW_BYTES; 0: none);
`--prefetch-weight 4096x4096:8192,...` adds the decode variant with one weight's (N x K: o_proj
here) prefetch set apart (matmul_triton.PREFETCH_BY_WEIGHT);
`--table FILE` adds the decode variant with the matmul tile table of a `kernels_proof --tune`
run (its gpu_kernels.json) merged over the shipped one; `--kv-split 128,256,...` adds the decode
variant with each attention KV split size (kernels/attention_triton.py KV_SPLIT: positions per
split, part of the numerics, so its bits differ from the shipped split's; a context longer
than a split runs the split launch at small batches; `64/4`: that split with the split launch
taken below 4 programs per SM instead of attention_triton.SPLIT_PROGRAMS_BELOW; each a
divisor of KV_GROUP). Writes
OUT_DIR/decode-ab.json (median ms per variant and batch, every round's).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import torch

from detgate.bench.report import environment
from detgate.kernels import attention_triton, matmul_triton
from detgate.kernels.attention_tiles import DECODE, SHIPPED, TileConfig, config_name
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.cuda_graphs import capture_graph
from detgate.worker.engine.engine import Engine
from detgate.worker.model.attention_metadata import AttentionMetadata
from detgate.worker.tools.random_model import load_random

# name -> (whether the step's attention takes the decode launch, the decode tiles: rows, BLOCK_N,
# warps, stages; None: the prefill's)
DECODE_SHIPPED = (DECODE[0], SHIPPED[1], *DECODE[1:])
VARIANTS: dict[str, tuple[bool, TileConfig | None]] = {
    "general": (False, None), "decode_rows64": (True, None), "decode": (True, DECODE_SHIPPED)}
BATCHES = (1, 8, 64, 128, 256)


def step_inputs(runner, batch: int, context: int, decode: bool):
    dev, bs = runner.device, runner.block_size
    nb = context // bs
    tables = torch.arange(batch * nb, dtype=torch.int32, device=dev).view(batch, nb)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=dev),
        block_tables=tables,
        slot_mapping=torch.full((batch,), runner.num_kv_blocks * bs, device=dev),
        # max_query_len is what selects the decode launch (ops._paged); 2 keeps the general one
        max_query_len=1 if decode else 2, max_seq_len=context)
    ids = torch.randint(100, 1000, (batch,), device=dev)
    pos = torch.full((batch,), context - 1, dtype=torch.int64, device=dev)
    return ids, pos, meta


@torch.inference_mode()
def time_variant(runner, batch: int, context: int, decode: bool, reps: int) -> float:
    ids, pos, meta = step_inputs(runner, batch, context, decode)

    def step():
        hidden = runner.model(ids, pos, meta, runner.kv_caches)
        return runner.sampler.log_softmax(runner.model.compute_logits(hidden))

    graph, _ = capture_graph(step, pool=None)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) / reps


def tuned_table(shipped: dict, path: str) -> dict:
    """The shipped TUNED_16BIT with a kernels_proof --tune run's buckets merged in (the
    shipped ones kept below and above the Ms it timed: matmul_triton.merge_tuned)."""
    tuned = json.loads(Path(path).read_text())["explore"]["table"]
    table = dict(shipped)
    for key, entries in tuned.items():
        n, k = (int(x) for x in key.split(","))
        table[(n, k)] = matmul_triton.merge_tuned(
            shipped.get((n, k), ()), tuple((int(m), str(c)) for m, c in entries))
    return table


def prefetch_weight(value: str) -> tuple[tuple[int, int], int]:
    """'NxK:BYTES' -> ((N, K), bytes per row): a matmul_triton.PREFETCH_BY_WEIGHT entry."""
    match = re.fullmatch(r"(\d+)x(\d+):(\d+)", value)
    if not match:
        raise ValueError(f"{value!r} is not NxK:BYTES")
    n, k, row_bytes = (int(x) for x in match.groups())
    return (n, k), row_bytes


def prefetch_weights(text: str) -> dict[tuple[int, int], int]:
    """'NxK:BYTES,...' -> PREFETCH_BY_WEIGHT entries."""
    return dict(prefetch_weight(value) for value in filter(None, text.split(",")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="qwen3-8b-shape")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--tiles", default="", help="tile configs for more decode variants")
    p.add_argument("--prefetch", default="", help="matmul weight prefetch bytes per row, for "
                   "more decode variants")
    p.add_argument("--prefetch-weight", default="", help="NxK:BYTES,...: a decode variant "
                   "per entry with that weight's prefetch bytes per row")
    p.add_argument("--table", default="", help="kernels_proof's gpu_kernels.json: add the "
                   "decode variant with its tuned matmul table")
    p.add_argument("--kv-split", default="", help="attention KV split sizes (multiples of "
                   "BLOCK_N), for more decode variants")
    args = p.parse_args()
    variants = dict(VARIANTS)
    shipped_table = dict(matmul_triton.TUNED_16BIT)
    tables = {"decode_table": tuned_table(shipped_table, args.table)} if args.table else {}
    for name in tables:
        variants[name] = VARIANTS["decode"]
        args.variants += f",{name}"
    shipped_prefetch = matmul_triton.PREFETCH_ROW_BYTES
    prefetch: dict[str, int] = {}  # variant -> matmul weight prefetch bytes, if not shipped's
    for value in filter(None, args.prefetch.split(",")):
        name = f"decode_pf{int(value)}"
        variants[name], prefetch[name] = VARIANTS["decode"], int(value)
        args.variants += f",{name}"
    shipped_by_weight = dict(matmul_triton.PREFETCH_BY_WEIGHT)
    by_weight: dict[str, dict[tuple[int, int], int]] = {}  # variant -> PREFETCH_BY_WEIGHT
    try:
        entries = [prefetch_weight(v) for v in filter(None, args.prefetch_weight.split(","))]
    except ValueError as e:
        p.error(f"--prefetch-weight: {e}")
    for (n, k), row_bytes in entries:
        name = f"decode_pf{n}x{k}_{row_bytes}"
        variants[name] = VARIANTS["decode"]
        by_weight[name] = {**shipped_by_weight, (n, k): row_bytes}
        args.variants += f",{name}"
    shipped_split = attention_triton.KV_SPLIT
    shipped_below = attention_triton.SPLIT_PROGRAMS_BELOW
    kv_split: dict[str, int] = {}  # variant -> attention KV split, if not shipped's
    split_below: dict[str, int] = {}  # variant -> SPLIT_PROGRAMS_BELOW, if not shipped's
    for value in filter(None, args.kv_split.split(",")):
        size, _, below = value.partition("/")
        if int(size) % SHIPPED[1] or attention_triton.KV_GROUP % int(size):
            p.error(f"--kv-split: {size} is not a multiple of BLOCK_N ({SHIPPED[1]}) and a "
                    f"divisor of KV_GROUP ({attention_triton.KV_GROUP})")
        name = f"decode_kv{int(size)}" + (f"_below{int(below)}" if below else "")
        variants[name], kv_split[name] = VARIANTS["decode"], int(size)
        if below:
            split_below[name] = int(below)
        args.variants += f",{name}"
    for name in filter(None, args.tiles.split(",")):
        config = tuple(int(x) for x in re.findall(r"\d+", name))
        if len(config) != 4 or config_name(config) != name:
            p.error(f"--tiles: {name!r} is not m<BLOCK_M>n<BLOCK_N>w<warps>s<stages>")
        variants[f"decode_{name}"] = (True, config)
        args.variants += f",decode_{name}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.variants.split(",")
    loaded = load_random(args.model, out / f"{args.model}-config", seed=0, device="cuda",
                         mode="batch_invariant")
    engine = Engine(EngineConfig(model=args.model, mode="batch_invariant", device="cuda",
                                 dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=8192,
                                 kv_cache_mb=16 * 1024), loaded.model, loaded.config)
    runner = engine.runner
    runs: dict[str, dict[int, list[float]]] = {n: {b: [] for b in BATCHES} for n in names}
    start = time.time()
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            decode, tiles = variants[name]
            at = attention_triton
            at.DECODE_TILE = tiles is not None
            rows, at.BLOCK_N, warps, stages = tiles or DECODE_SHIPPED
            at.KV_SPLIT = kv_split.get(name, shipped_split)
            at.SPLIT_PROGRAMS_BELOW = split_below.get(name, shipped_below)
            at.DECODE_BLOCK_M, at.DECODE_NUM_WARPS, at.DECODE_NUM_STAGES = rows, warps, stages
            table = tables.get(name, shipped_table)
            if table != matmul_triton.TUNED_16BIT:
                matmul_triton.TUNED_16BIT.clear()
                matmul_triton.TUNED_16BIT.update(table)
                matmul_triton.clear_caches()  # the plans keep their tile choice
            row_bytes = prefetch.get(name, shipped_prefetch)
            weights = by_weight.get(name, shipped_by_weight)
            if (row_bytes != matmul_triton.PREFETCH_ROW_BYTES
                    or weights != matmul_triton.PREFETCH_BY_WEIGHT):
                matmul_triton.PREFETCH_ROW_BYTES = row_bytes
                matmul_triton.PREFETCH_BY_WEIGHT.clear()
                matmul_triton.PREFETCH_BY_WEIGHT.update(weights)
                matmul_triton.clear_caches()  # the plans keep the prefetch bytes
            for b in BATCHES:
                runs[name][b].append(time_variant(runner, b, args.context, decode, args.reps))
            print(f"round {r} {name:22s}",
                  " ".join(f"{b}:{runs[name][b][-1]:.3f}" for b in BATCHES), flush=True)
    median = {n: {b: statistics.median(v) for b, v in runs[n].items()} for n in names}
    print("\nmedian ms", " ".join(f"B={b:<6}" for b in BATCHES))
    for n in names:
        print(f"{n:22s}", " ".join(f"{median[n][b]:8.3f}" for b in BATCHES))
    result = {"environment": environment("cuda"), "args": vars(args),
              "variants": {n: variants[n] for n in names},
              "prefetch_row_bytes": {n: prefetch.get(n, shipped_prefetch) for n in names},
              "prefetch_by_weight": {n: {f"{nk[0]}x{nk[1]}": v for nk, v in
                                         by_weight.get(n, shipped_by_weight).items()}
                                     for n in names},
              "kv_split": {n: kv_split.get(n, shipped_split) for n in names},
              "split_programs_below": {n: split_below.get(n, shipped_below) for n in names},
              "matmul_tables": {n: {f"{nk[0]},{nk[1]}": v for nk, v in t.items()}
                                for n, t in tables.items()},
              "median_ms": median, "runs": runs,
              "timing": "CUDA graph of one decode step (layers, lm_head, log_softmax) per "
                        "variant and batch, replayed reps times between CUDA events",
              "seconds": round(time.time() - start, 1)}
    (out / "decode-ab.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
