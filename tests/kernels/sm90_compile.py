"""Compile every launch variant of the Triton paged attention for Hopper (sm_90) without a GPU,
in a process of its own: `python tests/kernels/sm90_compile.py` prints {variant: error or
null} as JSON. Its own process because `@triton.jit` picks the interpreter or the compiler
when a kernel module is imported (TRITON_INTERPRET), and the interpreter tests import the same
modules in the test process."""

from __future__ import annotations

import itertools
import json
import os
import sys

POINTERS = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
            "out_ptr": "*bf16", "tables_ptr": "*i32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32",
            "ws_ml_ptr": "*fp32", "ws_acc_ptr": "*fp32"}
SUBSETS = ("all", "single", "multi")
LAUNCHES = ("fused", "by_split", "by_group")


def variants() -> list[str]:
    return [f"attn-{s}-{launch}-{'decode' if d else 'general'}"
            for s, launch, d in itertools.product(SUBSETS, LAUNCHES, (False, True))] + \
        [f"combine-{s}-{'by_split' if p else 'by_group'}"
         for s, p in itertools.product(SUBSETS, (False, True))]


def main() -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from detgate.kernels import attention_triton as at

    subset = {"all": at.ALL.value, "single": at.SINGLE.value, "multi": at.MULTI.value}

    def compile_(fn, constants: dict, **options) -> None:
        signature = {name: "constexpr" if name in constants else
                     "fp32" if name == "qk_scale" else POINTERS.get(name, "i32")
                     for name in fn.arg_names}
        triton.compile(ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 64),
                       options={"enable_fp_fusion": False, **options})

    def build(name: str) -> None:
        kind, s, launch, *rest = name.split("-")
        if kind == "combine":
            compile_(at._combine_kernel, dict(
                HQ=32, HEADS=at.COMBINE_HEADS, DIMS=at.COMBINE_DIMS, HEAD_DIM=128,
                KV_SPLIT=at.KV_SPLIT, KV_GROUP=at.KV_GROUP, PER_SPLIT=launch == "by_split",
                SUBSET=subset[s], PDL=True), num_warps=at.NUM_WARPS)
            return
        decode = rest == ["decode"]
        block_m, warps, stages = (at.DECODE_BLOCK_M, at.DECODE_NUM_WARPS,
                                  at.DECODE_NUM_STAGES) if decode else \
            (at.BLOCK_M, at.NUM_WARPS, at.NUM_STAGES)
        compile_(at._attn_kernel, dict(
            BLOCK_SIZE=16, HEAD_DIM=128, GROUP=4, GROUP_PAD=4, BLOCK_M=block_m,
            BLOCK_N=at.BLOCK_N, KV_SPLIT=at.KV_SPLIT, KV_GROUP=at.KV_GROUP,
            SPLIT_PROGRAMS=launch != "fused", PER_SPLIT=launch == "by_split", DECODE=decode,
            SUBSET=subset[s], PRECISION="tf32", PDL=True), num_warps=warps, num_stages=stages)

    errors: dict[str, str | None] = {}
    for name in variants():
        try:
            build(name)
            errors[name] = None
        except Exception as e:  # noqa: BLE001 (reported per variant to the test)
            errors[name] = f"{type(e).__name__}: {e}"[-2000:]
    json.dump(errors, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
