"""Paged attention against torch SDPA, side by side in one run: `run(device) -> list[dict]`
(the `attention` rows of `detgate bench kernels`, on CUDA and on the CPU).

CUDA: Qwen3-8B's attention (32 q heads, 8 kv heads, head dim 128, bf16, cache block 16).
- decode: one query per sequence over B x L cached tokens (the decode launch, as the engine's
  decode steps take it: the configuration's BLOCK_N, the decode tile's rows and warps);
  `kv_tb_s` = bytes of K and V read
  per second, against `copy_tb_s`, the device's copy bandwidth (read + write) measured in the
  same run; SDPA reads the same K/V from contiguous tensors (no paging).
- prefill: B fresh prompts of L tokens, causal; SDPA is the flash kernel (K/V expanded to 32
  heads); `ratio` = SDPA time / our time (above 1: we are faster).
Each of our rows names its tile configuration (BLOCK_M, BLOCK_N, warps, stages), launch
shape (fused, split, or auto = what paged_attention picks; all three for the shipped
configuration) and KV split (positions per split, part of the numerics: the shipped
configuration also runs with each of OTHER_KV_SPLITS, auto launch, whose bits differ).
CPU: the tiny model's attention (8 q / 2 kv heads of 32, fp32): our CPU kernel vs the default
mode's padded SDPA over the gathered cache, timed on the host (minimum over interleaved
repetitions); `ratio` = SDPA time / our time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from importlib import import_module

import torch
import torch.nn.functional as F

from detgate.bench.timing import copy_tb_s, events_ms, min_ms_pair
from detgate.kernels.attention_tiles import CONFIGS, FIELDS, SHIPPED, TileConfig, config_name

QWEN3_8B = {"hq": 32, "hkv": 8, "d": 128}
TINY = {"hq": 8, "hkv": 2, "d": 32}
DECODE_SHAPES = [(1, 4096), (16, 4096), (64, 4096), (128, 4096), (32, 8192), (256, 2048),
                 (4, 65536), (1, 256), (64, 256), (256, 256)]
PREFILL_SHAPES = [(1, 1024), (4, 2048), (1, 4096), (1, 8192)]
BLOCK_SIZE = 16
# KV split sizes timed beside the shipped one (kernels/attention_triton.py KV_SPLIT, each a
# divisor of KV_GROUP): larger splits give a short sequence fewer programs and every query
# fewer merges.
OTHER_KV_SPLITS = (1024, 256, 128)


def _cuda_ms(fn: Callable[[], object], reps: int = 5) -> float:
    """Milliseconds per call: median over reps of about 20 ms of back-to-back calls."""
    once = events_ms(lambda _: fn(), 1, 1, warmup=1)
    calls = max(3, min(200, int(20.0 / max(once, 1e-3))))
    return events_ms(lambda _: fn(), calls, reps)


def _paged_inputs(batch: int, seq_len: int, q_len: int, shape: dict, dtype, device: str,
                  gen: torch.Generator) -> dict:
    """A shuffled paged cache holding `batch` sequences of `seq_len` tokens."""
    hq, hkv, d = shape["hq"], shape["hkv"], shape["d"]
    per_seq = -(-seq_len // BLOCK_SIZE)
    num_blocks = batch * per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=gen, device=device,
                          dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    tables = perm.view(batch, per_seq).to(torch.int32)
    qsl = torch.arange(batch + 1, device=device, dtype=torch.int32) * q_len
    lens = torch.full((batch,), seq_len, device=device, dtype=torch.int32)
    q = torch.randn(batch * q_len, hq, d, generator=gen, device=device, dtype=dtype)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables,
            "query_start_loc": qsl, "seq_lens": lens, "scale": d**-0.5}


def _contiguous_kv(inp: dict, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged K/V of each sequence as [B, Hkv, L, D] (what SDPA reads)."""
    tables = inp["block_tables"].long()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        rows = cache[tables].flatten(1, 2)[:, :seq_len]  # [B, L, Hkv, D]
        return rows.transpose(1, 2).contiguous()

    return gather(inp["k_cache"]), gather(inp["v_cache"])


def _with_config(at, config: TileConfig, fn: Callable[[], object]) -> Callable:
    """fn, run with the kernel module's tile constants set to `config`."""
    def call():
        saved = [getattr(at, name) for name in FIELDS]
        _set_tiles(at, config)
        try:
            return fn()
        finally:
            _set_tiles(at, saved)
    return call


def _set_tiles(at, values) -> None:
    for name, value in zip(FIELDS, values, strict=True):
        setattr(at, name, value)


def _variants(at) -> list[tuple[TileConfig, int]]:
    """(tile configuration, KV split) pairs to time: every configuration at the shipped split,
    the shipped configuration at each other split."""
    return [*((c, at.KV_SPLIT) for c in CONFIGS), *((SHIPPED, s) for s in OTHER_KV_SPLITS)]


def _with_split(at, kv_split: int, fn: Callable[[], object]) -> Callable:
    """fn, run with the kernel module's KV split set to `kv_split`."""
    def call():
        saved, at.KV_SPLIT = at.KV_SPLIT, kv_split
        try:
            return fn()
        finally:
            at.KV_SPLIT = saved
    return call


def _cuda_rows() -> list[dict]:
    at = import_module("detgate.kernels.attention_triton")
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy = copy_tb_s()
    rows: list[dict] = [{"op": "copy_bandwidth", "tb_s": copy}]
    for batch, seq_len in DECODE_SHAPES:
        inp = _paged_inputs(batch, seq_len, 1, QWEN3_8B, torch.bfloat16, "cuda", gen)
        k, v = _contiguous_kv(inp, batch, seq_len)
        q4 = inp["q"].view(batch, 1, QWEN3_8B["hq"], QWEN3_8B["d"]).transpose(1, 2)
        sdpa_ms = _cuda_ms(lambda q4=q4, k=k, v=v: F.scaled_dot_product_attention(
            q4, k, v, enable_gqa=True))
        kv_bytes = 2 * k.numel() * k.element_size()
        del k, v
        for config, kv_split in _variants(at):
            launches = (("auto", None), ("fused", False), ("split", True))
            shipped = config == SHIPPED and kv_split == at.KV_SPLIT
            for launch, split in launches if shipped else launches[:1]:
                call = functools.partial(at.paged_attention, **inp, decode=True,
                                         split_programs=split)
                ms = _cuda_ms(_with_split(at, kv_split, _with_config(at, config, call)))
                rows.append({"op": "attention_decode", "batch": batch, "context": seq_len,
                             "config": config_name(config), "launch": launch,
                             "kv_split": kv_split,
                             "ours_ms": ms, "sdpa_ms": sdpa_ms, "ratio": sdpa_ms / ms,
                             "kv_tb_s": kv_bytes / (ms * 1e-3) / 1e12,
                             "sdpa_kv_tb_s": kv_bytes / (sdpa_ms * 1e-3) / 1e12,
                             "fraction_of_copy": kv_bytes / (ms * 1e-3) / 1e12 / copy})
        del inp
    for batch, seq_len in PREFILL_SHAPES:
        inp = _paged_inputs(batch, seq_len, seq_len, QWEN3_8B, torch.bfloat16, "cuda", gen)
        k, v = _contiguous_kv(inp, batch, seq_len)
        group = QWEN3_8B["hq"] // QWEN3_8B["hkv"]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q4 = inp["q"].view(batch, seq_len, QWEN3_8B["hq"], QWEN3_8B["d"]).transpose(1, 2)
        q4 = q4.contiguous()
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            sdpa_ms = _cuda_ms(lambda q4=q4, k=k, v=v: F.scaled_dot_product_attention(
                q4, k, v, is_causal=True))
        del k, v
        flops = 4 * batch * QWEN3_8B["hq"] * QWEN3_8B["d"] * seq_len * (seq_len + 1) / 2
        for config, kv_split in _variants(at):
            call = functools.partial(at.paged_attention, **inp)
            ms = _cuda_ms(_with_split(at, kv_split, _with_config(at, config, call)))
            rows.append({"op": "attention_prefill", "batch": batch, "seq_len": seq_len,
                         "config": config_name(config), "launch": "auto", "kv_split": kv_split,
                         "ours_ms": ms, "sdpa_ms": sdpa_ms, "ratio": sdpa_ms / ms,
                         "ours_tflop_s": flops / (ms * 1e-3) / 1e12,
                         "sdpa_tflop_s": flops / (sdpa_ms * 1e-3) / 1e12})
        del inp
    return rows


def _cpu_rows() -> list[dict]:
    from detgate.kernels.attention_cpu import paged_attention
    from detgate.worker.model.attention_metadata import AttentionMetadata
    from detgate.worker.model.ops import _padded_sdpa

    gen = torch.Generator().manual_seed(0)
    rows = []
    for op, batch, seq_len, q_len in (("attention_decode", 16, 512, 1),
                                      ("attention_decode", 64, 256, 1),
                                      ("attention_prefill", 4, 256, 256)):
        inp = _paged_inputs(batch, seq_len, q_len, TINY, torch.float32, "cpu", gen)
        meta = AttentionMetadata(query_start_loc=inp["query_start_loc"],
                                 seq_lens=inp["seq_lens"], block_tables=inp["block_tables"],
                                 slot_mapping=torch.zeros(batch * q_len, dtype=torch.long),
                                 max_query_len=q_len, max_seq_len=seq_len)
        ms, sdpa_ms = min_ms_pair(
            lambda inp=inp: paged_attention(**inp),
            lambda inp=inp, meta=meta: _padded_sdpa(inp["q"], inp["k_cache"], inp["v_cache"],
                                                    meta, inp["scale"]))
        rows.append({"op": op, "batch": batch, "context": seq_len, "q_len": q_len,
                     "ours_ms": ms, "sdpa_ms": sdpa_ms, "ratio": sdpa_ms / ms,
                     "threads": torch.get_num_threads()})
    return rows


def run(device: str | torch.device) -> list[dict]:
    """Benchmark rows for `device` ("cuda" or "cpu")."""
    return _cuda_rows() if torch.device(device).type == "cuda" else _cpu_rows()


def split_ab(layouts: list[tuple[int, int]], rounds: int) -> dict:
    """The shipped tiles under each (KV split, KV group) layout (attention_triton.KV_SPLIT,
    KV_GROUP: part of the numerics, so each layout has its own bits), auto launch, on the
    prefill shapes and on decodes of short and long contexts; layouts alternate within each
    round, medians of the rounds."""
    at = import_module("detgate.kernels.attention_triton")
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = [("attention_prefill", b, n, n) for b, n in PREFILL_SHAPES] + \
        [("attention_decode", b, n, 1) for b, n in DECODE_SHAPES]
    times: dict[tuple, list[float]] = {}
    for op, batch, seq_len, q_len in cases:
        inp = _paged_inputs(batch, seq_len, q_len, QWEN3_8B, torch.bfloat16, "cuda", gen)
        call = functools.partial(at.paged_attention, **inp, decode=q_len == 1)
        for r in range(rounds):
            for kv_split, kv_group in layouts[r % len(layouts):] + layouts[:r % len(layouts)]:
                saved, at.KV_GROUP = at.KV_GROUP, kv_group
                try:
                    ms = _cuda_ms(_with_split(at, kv_split, call))
                finally:
                    at.KV_GROUP = saved
                times.setdefault((op, batch, seq_len, kv_split, kv_group), []).append(ms)
        del inp
    rows = [{"op": op, "batch": b, "seq_len": n, "kv_split": s, "kv_group": g,
             "ms": sorted(v)[len(v) // 2], "rounds_ms": v}
            for (op, b, n, s, g), v in times.items()]
    return {"rows": rows, "timing": "eager calls between CUDA events, median of the rounds "
                                    "(each round the median of 5 batches of calls)"}


def main() -> int:
    import argparse
    import json
    from pathlib import Path

    from detgate.bench.report import environment

    p = argparse.ArgumentParser(description="KV split and group sizes, A/B on the GPU "
                                            "(split_ab)")
    p.add_argument("--layouts", default="1024:1024,64:1024,64:64",
                   help="KV_SPLIT:KV_GROUP pairs (positions; the group a multiple of the split)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    result = {"environment": environment("cuda"), "args": vars(args),
              **split_ab([tuple(int(x) for x in v.split(":")) for v in args.layouts.split(",")],
                         args.rounds)}
    Path(args.json).write_text(json.dumps(result, indent=1))
    for row in result["rows"]:
        print("{op:18s} {batch:4d} x {seq_len:5d} split {kv_split:5d} group {kv_group:5d} "
              "{ms:8.4f} ms"
              .format(**row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
