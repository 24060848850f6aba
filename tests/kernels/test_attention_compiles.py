"""Every launch variant of the Triton paged attention compiles for Hopper (sm_90) on a machine
without a GPU: Triton's own compiler and its bundled ptxas, as on the card. The interpreter
tests (test_attention_triton.py) check the arithmetic; this checks that each variant the
launcher can pick (fused or split, by split or by group, decode tiles or general ones, all
sequences or one subset of a mixed step, and the combine of each) is a kernel the GPU build
accepts, so that a worker does not first learn of a variant's compile error on the card."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from detgate.kernels import attention_triton as at  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 64)
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
pytestmark = pytest.mark.skipif(not PTXAS.exists() and shutil.which("ptxas") is None,
                                reason="no ptxas in this Triton install")
POINTERS = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
            "out_ptr": "*bf16", "tables_ptr": "*i32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32",
            "ws_ml_ptr": "*fp32", "ws_acc_ptr": "*fp32"}
SUBSETS = {"all": at.ALL.value, "single": at.SINGLE.value, "multi": at.MULTI.value}


def _compile(fn, constants: dict, **options) -> None:
    signature = {name: "constexpr" if name in constants else
                 "fp32" if name == "qk_scale" else POINTERS.get(name, "i32")
                 for name in fn.arg_names}
    triton.compile(ASTSource(fn, signature, constants), target=HOPPER,
                   options={"enable_fp_fusion": False, **options})


@pytest.mark.parametrize(("subset", "launch", "decode"), list(itertools.product(
    SUBSETS, ["fused", "by_split", "by_group"], [False, True])))
def test_attention_kernel_compiles_for_sm90(subset, launch, decode):
    block_m, warps, stages = (at.DECODE_BLOCK_M, at.DECODE_NUM_WARPS, at.DECODE_NUM_STAGES) \
        if decode else (at.BLOCK_M, at.NUM_WARPS, at.NUM_STAGES)
    _compile(at._attn_kernel, dict(
        BLOCK_SIZE=16, HEAD_DIM=128, GROUP=4, GROUP_PAD=4, BLOCK_M=block_m, BLOCK_N=at.BLOCK_N,
        KV_SPLIT=at.KV_SPLIT, KV_GROUP=at.KV_GROUP, SPLIT_PROGRAMS=launch != "fused",
        PER_SPLIT=launch == "by_split", DECODE=decode, SUBSET=SUBSETS[subset],
        PRECISION="tf32", PDL=True), num_warps=warps, num_stages=stages)


@pytest.mark.parametrize(("subset", "per_split"), list(itertools.product(SUBSETS, [False, True])))
def test_combine_kernel_compiles_for_sm90(subset, per_split):
    _compile(at._combine_kernel, dict(
        HQ=32, HEADS=at.COMBINE_HEADS, DIMS=at.COMBINE_DIMS, HEAD_DIM=128, KV_SPLIT=at.KV_SPLIT,
        KV_GROUP=at.KV_GROUP, PER_SPLIT=per_split, SUBSET=SUBSETS[subset], PDL=True),
        num_warps=at.NUM_WARPS)
