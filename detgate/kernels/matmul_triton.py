"""Batch-invariant matmul in Triton: C[M, N] = A[M, K] @ B[K, N] (+ bias[N]).

Invariant (what makes row i independent of M): every output element is computed by one
program, into one fp32 accumulator, as one chain of matrix instructions over K in increasing
k: wgmma k16 steps for bf16/fp16 on Hopper (mma k16 before it), FMA steps for fp32, which runs
as IEEE fp32, never TF32. There is no split-K and no stream-K. The tile shape (`TileConfig`)
may follow the problem's shape because it decides only which program computes an element and
how many k16 steps one loop iteration issues (BLOCK_K), never the order of those steps: the
per-element chain is the same for every config of a dtype. A config's tail (the tiles after
the persistent grid's full waves, computed as smaller sub-tiles) is one more choice of which
program computes an element, and a weight prefetch before the PDL wait only moves bytes into
L2 earlier. That this holds on the hardware is
checked bitwise, every config against every other on every projection shape, and over
M = 1..8192 with the dispatch in force (tests/kernels/test_gpu_ops.py,
detgate/bench/kernels_proof.py).

Two kernels with the same reduction: a persistent kernel fed by TMA tensor descriptors
(Hopper and later, 16-byte aligned operands; A and C by plain masked loads and stores below
one row tile) and a pointer kernel for everything else. On CUDA the persistent kernel is
launched through `kernels.triton_launch`: the weight's descriptor, the tile choice and the
compiled kernel are kept per weight, so a call costs one allocation and one C launch. From
`cublaslt.MIN_ROWS` rows (129) the fast path may hand a weight's call to a cuBLASLt algorithm
instead, for a row count whose bits this process found equal to this kernel's
(kernels/cublaslt.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from detgate.kernels import cublaslt, pdl
from detgate.kernels.triton_launch import Launcher, Unsupported, raw_stream

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)

@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # k16 steps per loop iteration x 16. Larger BLOCK_K moves more bytes per iteration, which
    # is what decode (tiny M, weights streamed once) is bound by; the step order is unchanged.
    block_k: int = 64
    # Programs per SM for the persistent grid: >1 lets small memory-bound tiles overlap.
    ctas_per_sm: int = 1
    group_m: int = 8
    # A smaller tile (dividing block_m x block_n) for what is left after the grid's full waves:
    # a last wave of a few big tiles leaves most SMs idle; cut into tail_m x tail_n sub-tiles
    # it spreads over all of them (0: no tail). Only which program computes an element changes.
    tail_m: int = 0
    tail_n: int = 0

    @property
    def subtiles(self) -> int:
        """Sub-tiles per tile in the tail (0: no tail)."""
        return (self.block_m // self.tail_m) * (self.block_n // self.tail_n) if self.tail_m else 0


# Hopper, 16-bit operands; shared memory per config stays under the 227 KB a program may use.
CONFIGS_16BIT = {
    "m128n256": TileConfig(128, 256, 8, 3),
    "m128n128": TileConfig(128, 128, 8, 4),
    "m128n128w4": TileConfig(128, 128, 4, 4),
    "m128n128s6": TileConfig(128, 128, 8, 6),
    "m128n64": TileConfig(128, 64, 4, 6),
    "m128n64k128": TileConfig(128, 64, 4, 4, block_k=128),
    "m64n256": TileConfig(64, 256, 4, 4),
    "m64n128": TileConfig(64, 128, 4, 5),
    "m64n128k128": TileConfig(64, 128, 4, 4, block_k=128),
    "m64n64": TileConfig(64, 64, 4, 6, ctas_per_sm=2),
    "m64n64k128": TileConfig(64, 64, 4, 5, block_k=128),
    "m64n64k256": TileConfig(64, 64, 4, 3, block_k=256),
    "m64n32k128": TileConfig(64, 32, 4, 7, block_k=128),
    "m64n32k256": TileConfig(64, 32, 4, 4, block_k=256),
    "m64n16k256": TileConfig(64, 16, 4, 5, block_k=256),
    # Around 256 rows (decode steps of a full batch: compute-bound, 1.4-3 waves of tiles):
    # deeper K steps, more stages, two programs per SM.
    "m128n128k128": TileConfig(128, 128, 8, 3, block_k=128),
    "m128n128k128w4": TileConfig(128, 128, 4, 3, block_k=128),
    "m128n128s5": TileConfig(128, 128, 8, 5),
    "m64n128c2": TileConfig(64, 128, 4, 3, ctas_per_sm=2),
    "m64n256s2c2": TileConfig(64, 256, 4, 2, ctas_per_sm=2),
    "m128n64c2": TileConfig(128, 64, 4, 3, ctas_per_sm=2),
    # 16 rows (a few decoding sequences): mma.sync tiles (wgmma's smallest M is 64), whose A
    # tiles take a quarter of the shared memory: two programs fit an SM, so a launch can start
    # beside its predecessor's last tiles under PDL. The same k16 chain per element (checked
    # against the wgmma tiles by the GPU tests, as for the attention's 16-row decode tile).
    "m16n64k128": TileConfig(16, 64, 4, 5, block_k=128),
    "m16n32k256": TileConfig(16, 32, 4, 4, block_k=256),
    "m16n128k128": TileConfig(16, 128, 4, 3, block_k=128),
    "m16n64k128c2": TileConfig(16, 64, 4, 5, block_k=128, ctas_per_sm=2),
    # With a tail: the tiles after the full waves in halves or quarters.
    "m128n256t64": TileConfig(128, 256, 8, 3, tail_m=64, tail_n=256),
    "m128n256t64n128": TileConfig(128, 256, 8, 3, tail_m=64, tail_n=128),
    "m128n128t64": TileConfig(128, 128, 8, 4, tail_m=64, tail_n=128),
    "m128n128w4t64": TileConfig(128, 128, 4, 4, tail_m=64, tail_n=128),
    "m64n256t128": TileConfig(64, 256, 4, 4, tail_m=64, tail_n=128),
    "m64n128k128t64": TileConfig(64, 128, 4, 4, block_k=128, tail_m=64, tail_n=64),
}
CONFIG_FP32 = TileConfig(64, 64, 4, 3, block_k=32)
CONFIG_INTERPRETER = TileConfig(16, 32, 4, 1, block_k=32)
# Row tiles from which A and C go through TMA descriptors (see `_a_desc`).
DESC_MIN_TILES = 1
# Weight prefetch before the PDL wait (`_prefetch_rows`): bytes of each weight row of its first
# tile a program asks L2 for while its predecessor still runs, up to PREFETCH_MAX_M rows of A
# (decode: the weights are streamed once, and their first bytes need not wait for A). 0: off.
PREFETCH_ROW_BYTES = 1024
PREFETCH_MAX_M = 64
# Per weight (N, K): bytes per row instead of PREFETCH_ROW_BYTES. For a weight whose
# predecessor runs long with the memory bus idle (o_proj after a small batch's attention, a few
# programs bound by latency), its programs could ask for their whole tile while they wait.
PREFETCH_BY_WEIGHT: dict[tuple[int, int], int] = {}

# Fastest config per M bucket, measured on H200 (`python -m detgate.bench.kernels_proof --tune`,
# Qwen3-8B projections, bench/results/kernels-h200-*.json): (N, K) -> ((M upper bound, config
# name), ...) in increasing M; M above the last bound takes the last config.
# From 129 rows (decode steps of 129-256 sequences, the mixed steps' token buckets: every 128 up
# to 2048, then every 256 / 512): `kernels_proof --tune-only --tune-m ...` with the tail configs
# (kernels-tune-h200-2026-12-02-tails.json). Power-of-two buckets had hidden wave cliffs (o_proj
# and down_proj at 1025-1536 rows on 128 x 256 tiles: 144-192 tiles on 132 SMs); tails win
# 2-9% where a last wave of big tiles would leave most SMs idle (down_proj at 1153-1280 rows,
# gate_up_proj at 1281-1408), and lose where sub-tiles run slower than the idle SMs cost.
# 257-1,536 rows of qkv_proj, o_proj and down_proj were tuned again with three sizes spread
# over each 128-row bucket (`--tune-spread 3`, kernels-tune-h200-2026-12-03-mid.json): where a
# bucket's tile count varies, its choice is the best on average, not at the bound alone (the
# earlier bound-only tune of 513-1,024 rows had made the cost workload's mixed steps slower).
# down_proj gains 6-16% from 385 to 1,024 rows (m128n256t64 against m128n128w4 / m128n256).
# Up to 32 rows (kernels-tune-h200-2026-12-03-rows16.json, with the 16-row mma tiles as
# candidates): qkv_proj on 16-row tiles up to 16 rows, gate_up_proj from 2 to 16; in the decode
# step 4.716 / 4.773 ms at 1 / 8 sequences against 4.732 / 4.795 with the table before
# (decode-ab-h200-2026-12-03-rows16.json, alternating in one process): a small gain.
TUNED_16BIT: dict[tuple[int, int], tuple[tuple[int, str], ...]] = {
    # Full decode batches (193-256 rows; kernels-tune-h200-2026-12-02-decode256.json, every 8 to
    # 16 rows): qkv and gate_up on 128 x 128 tiles with five stages (gate_up 83.5 us in graphs
    # at M = 256 against 86.2 with six, 89.4 before; cuBLAS 73.8), m64n256 up to 224 for qkv.
    (6144, 4096): (  # qkv_proj
        (1, "m16n64k128"), (16, "m16n64k128c2"), (64, "m64n64k128"), (128, "m64n128k128"),
        (224, "m64n256"), (248, "m128n128s5"), (256, "m128n128s6"), (384, "m64n256t128"),
        (512, "m128n256t64n128"), (640, "m128n256t64"), (768, "m64n256t128"),
        (1024, "m128n128w4"), (1280, "m128n256"), (1408, "m128n256t64"),
        (1536, "m128n256t64n128"), (1664, "m128n128w4"), (2048, "m128n256"), (2304, "m128n128w4"),
        (2560, "m128n128t64"), (2816, "m128n256"), (3584, "m128n256t64"), (4608, "m128n256"),
        (6144, "m64n256"), (7168, "m128n256t64n128"), (8192, "m128n128t64"),
    ),
    (4096, 4096): (  # o_proj
        (64, "m64n32k256"), (128, "m64n64k128"), (192, "m64n128k128"), (224, "m64n128"),
        (240, "m128n64"), (256, "m64n128k128"), (512, "m64n256"), (768, "m128n256t64"),
        (896, "m128n256t64n128"), (1024, "m128n256"), (1280, "m128n128w4t64"), (1408, "m128n128w4"),
        (1536, "m128n128"), (1664, "m128n128w4t64"), (2048, "m128n256"), (2304, "m128n128w4t64"),
        (2560, "m128n128"), (3072, "m128n256"), (3584, "m128n128w4"), (4096, "m128n256"),
        (4608, "m128n128"), (7168, "m128n256"), (8192, "m64n256"),
    ),
    (24576, 4096): (  # gate_up_proj
        (1, "m64n64k128"), (16, "m16n64k128"), (32, "m64n64k128"), (64, "m64n256"),
        (128, "m64n128k128"), (160, "m64n256t128"),
        (192, "m64n128k128"), (224, "m128n256t64"), (256, "m128n128s5"),
        # 257-1,536 rows: spread tune of 2026-12-04 (kernels-tune-h200-2026-12-04-gate-up.json)
        (384, "m128n256t64n128"), (640, "m128n256"), (768, "m128n256t64"),
        (896, "m128n256t64n128"), (1664, "m128n256t64"), (1792, "m128n256t64n128"),
        (1920, "m128n256"), (2048, "m128n128"), (2304, "m128n256t64"),
        (2560, "m128n256"), (3072, "m128n256t64"), (3584, "m128n256"), (4096, "m64n256"),
        (5120, "m128n256t64n128"), (8192, "m128n256t64"),
    ),
    (4096, 12288): (  # down_proj
        (64, "m64n32k256"), (128, "m64n64k128"), (160, "m64n128"), (192, "m64n128k128"),
        (224, "m64n128"), (256, "m64n128k128"), (384, "m64n256"), (512, "m64n256t128"),
        (1024, "m128n256t64"), (1280, "m128n128w4t64"), (1408, "m64n256"), (1536, "m128n128"),
        (1664, "m128n128w4t64"), (2048, "m128n256"), (2304, "m128n128t64"), (2560, "m128n128w4"),
        (2816, "m128n128w4t64"), (3072, "m64n256"), (3584, "m128n128"), (4096, "m128n256"),
        (4608, "m64n256"), (8192, "m128n256"),
    ),
    (151936, 4096): (  # lm_head
        (1, "m64n128"), (8, "m64n128"), (32, "m64n128"), (64, "m64n128k128"), (128, "m128n128"),
        (256, "m128n256"), (512, "m128n256"), (1024, "m128n256"), (2048, "m128n256"),
        (4096, "m128n256"), (8192, "m128n256"),
    ),
}


@dataclass(frozen=True)
class DeviceInfo:
    num_sms: int
    capability: tuple[int, int]


@functools.cache
def device_info(index: int | None) -> DeviceInfo:
    """Queried once per device: the launch path must not pay for it on every call."""
    if index is None:  # CPU tensors under TRITON_INTERPRET=1
        return DeviceInfo(num_sms=4, capability=(0, 0))
    props = torch.cuda.get_device_properties(index)
    return DeviceInfo(num_sms=props.multi_processor_count, capability=(props.major, props.minor))


Table = tuple[tuple[int, str], ...]  # one weight's (M upper bound, config name), increasing M


def bucket_floor(table: Table, m: int) -> int:
    """Where the bucket holding M starts in `table` (exclusive): the last bound below M, 0 if
    none. A tune that times buckets from M on starts its first one there."""
    return max((upper for upper, _ in table if upper < m), default=0)


def merge_tuned(shipped: Table, tuned: Table) -> Table:
    """One weight's table after a tune of some of its buckets: `tuned` covers M from
    bucket_floor(shipped, its first bound) up to its last bound; below and above that the
    shipped buckets stay (the first one above now starts where `tuned` ends). Neighbouring
    buckets of one config become one."""
    if not tuned:
        return shipped
    low, high = bucket_floor(shipped, tuned[0][0]), tuned[-1][0]
    merged: list[tuple[int, str]] = []
    for upper, name in (*((u, c) for u, c in shipped if u <= low), *tuned,
                        *((u, c) for u, c in shipped if u > high)):
        if merged and merged[-1][1] == name:
            merged.pop()  # one bucket up to this bound
        merged.append((upper, name))
    return tuple(merged)


def pick_config(m: int, n: int, k: int, dtype: torch.dtype, info: DeviceInfo) -> TileConfig:
    """Tile shape from the problem's shape. Any choice is safe for invariance (see module doc);
    this only trades parallelism (enough programs to stream the weights at small M) against
    reuse (large tiles at large M)."""
    if info.capability == (0, 0):
        return CONFIG_INTERPRETER
    if dtype == torch.float32:
        return CONFIG_FP32
    c = CONFIGS_16BIT
    tuned = TUNED_16BIT.get((n, k))
    if tuned:
        return c[next((name for upper, name in tuned if m <= upper), tuned[-1][1])]
    if m <= 64:
        # Memory-bound: the weights are read once. Enough programs to stream them, each moving
        # many bytes per loop iteration (per-iteration latency, not bandwidth, limits a program).
        if triton.cdiv(n, 256) >= info.num_sms // 2:
            return c["m64n256"]
        return c["m64n64k128"] if triton.cdiv(n, 64) >= info.num_sms * 2 // 3 else c["m64n32k256"]
    if m <= 128:
        return c["m64n64k128"]
    if m <= 256:
        return c["m64n128k128"]
    if m <= 512:
        return c["m128n128w4"]
    return c["m128n256"]


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M row-tiles share each column of B while it sits in L2.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _prefetch_rows(first_row, rows, row_stride, nbytes, BLOCK_N: tl.constexpr,
                   THREADS: tl.constexpr):
    """Thread t asks L2 for the first `nbytes` of rows t, t + THREADS, ... below `rows`
    (first_row: the first row's address; one bulk prefetch per row and thread, sm_90). A cache
    hint: nothing is read into registers and no value anywhere changes, only where the later
    loads find their bytes."""
    for j in tl.static_range(0, BLOCK_N, THREADS):
        tl.inline_asm_elementwise(
            """{
            .reg .u32 t;
            .reg .pred p;
            .reg .u64 a;
            mov.u32 t, %tid.x;
            add.u32 t, t, $5;
            setp.lt.u32 p, t, $3;
            mad.wide.u32 a, t, $4, $1;
            @p cp.async.bulk.prefetch.L2.global [a], $2;
            mov.u32 $0, 0;
            }""", "=r,l,r,r,r,r", [first_row, nbytes, rows, row_stride, j],
            dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _tile(a_desc, b_desc, c_desc, bias_ptr, M, N, K, stride_am, off_m, off_n,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          B_IS_NK: tl.constexpr, A_DESC: tl.constexpr, HAS_BIAS: tl.constexpr,
          PRECISION: tl.constexpr):
    """C[off_m : off_m + BLOCK_M, off_n : off_n + BLOCK_N], one program, one accumulator."""
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The K order: chunk 0, 1, ... k_tiles-1, one dot each, into the same accumulator.
    # Out-of-range rows/columns/K are zero-filled by the descriptor or the load mask alike.
    for ki in range(tl.cdiv(K, BLOCK_K)):
        if A_DESC:
            a = a_desc.load([off_m, ki * BLOCK_K])
        else:
            offs_k = ki * BLOCK_K + tl.arange(0, BLOCK_K)
            a = tl.load(a_desc + offs_m[:, None] * stride_am + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        if B_IS_NK:  # noqa: SIM108 (compile time: one branch is compiled)
            b = b_desc.load([off_n, ki * BLOCK_K]).T
        else:
            b = b_desc.load([ki * BLOCK_K, off_n])
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    if A_DESC:
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
    else:
        tl.store(c_desc + offs_m[:, None] * N + offs_n[None, :], acc.to(c_desc.dtype.element_ty),
                 mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M", "num_tiles", "grid_size", "tail_tiles", "prefetch_bytes"])
def _matmul_tma_kernel(a_desc, b_desc, c_desc, a2_desc, b2_desc, c2_desc, bias_ptr, M, N, K,
                       stride_am, num_tiles, grid_size, tail_tiles, w_ptr, stride_wn,
                       prefetch_bytes, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, TAIL_M: tl.constexpr,
                       TAIL_N: tl.constexpr, B_IS_NK: tl.constexpr, A_DESC: tl.constexpr,
                       HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                       PREFETCH: tl.constexpr, THREADS: tl.constexpr, PDL: tl.constexpr):
    if PREFETCH:  # noqa: SIM102 (compile time; the test below is a runtime one)
        # The weights (w_ptr: B as [N, K] rows, the descriptor's memory) are not the
        # predecessor's output: while this program waits for A's producer, L2 can already
        # fetch the start of its first tile's weight rows, a few k-steps' worth.
        if prefetch_bytes > 0:
            _, pid_n0 = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N),
                                     GROUP_M)
            first = pid_n0 * BLOCK_N
            elem: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
            _prefetch_rows((w_ptr + first.to(tl.int64) * stride_wn).to(tl.int64, bitcast=True),
                           tl.minimum(N - first, BLOCK_N), stride_wn * elem, prefetch_bytes,
                           BLOCK_N, THREADS)
    pdl.enter(PDL)  # launched early, waits for A's producer (kernels/pdl.py)
    # A_DESC: A and C are TMA descriptors; otherwise plain pointers (A rows stride_am apart,
    # C rows N apart), read and written with row masks. B is always a descriptor.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Tiles 0 .. num_tiles-1 of the BLOCK_M x BLOCK_N grid (full waves of the persistent grid).
    for tile_id in tl.range(tl.program_id(0), num_tiles, grid_size, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        _tile(a_desc, b_desc, c_desc, bias_ptr, M, N, K, stride_am, pid_m * BLOCK_M,
              pid_n * BLOCK_N, BLOCK_M, BLOCK_N, BLOCK_K, B_IS_NK, A_DESC, HAS_BIAS, PRECISION)
    if TAIL_M > 0:
        # The grid's remaining tiles, each cut into SPLIT_M x SPLIT_N sub-tiles of TAIL_M x
        # TAIL_N (descriptors a2/b2/c2 have those boxes): a last wave that would leave most
        # programs idle is spread over all of them. Sub-tiles of one tile go to consecutive
        # programs. Every element is still one program's one accumulator over the same K chain.
        SPLIT_M: tl.constexpr = BLOCK_M // TAIL_M
        SPLIT_N: tl.constexpr = BLOCK_N // TAIL_N
        for t in tl.range(tl.program_id(0), tail_tiles, grid_size, flatten=True):
            pid_m, pid_n = _tile_coords(num_tiles + t // (SPLIT_M * SPLIT_N), num_pid_m,
                                        num_pid_n, GROUP_M)
            sub = t % (SPLIT_M * SPLIT_N)
            _tile(a2_desc, b2_desc, c2_desc, bias_ptr, M, N, K, stride_am,
                  pid_m * BLOCK_M + (sub // SPLIT_N) * TAIL_M,
                  pid_n * BLOCK_N + (sub % SPLIT_N) * TAIL_N, TAIL_M, TAIL_N, BLOCK_K, B_IS_NK,
                  A_DESC, HAS_BIAS, PRECISION)


@triton.jit
def _matmul_ptr_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K,
                       stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                       PDL: tl.constexpr):
    pdl.enter(PDL)
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N),
                                GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Same K order as the TMA kernel: masked-out elements load as 0 and add exactly nothing.
    for ki in range(tl.cdiv(K, BLOCK_K)):
        k = ki * BLOCK_K + offs_k
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & (k[None, :] < K), other=0.0)
        b = tl.load(b_ptr + k[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=(k[:, None] < K) & (offs_n[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        acc = acc + bias.to(tl.float32)[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _check(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None) -> None:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"matmul wants 2-D operands, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul shapes do not chain: {tuple(a.shape)} @ {tuple(b.shape)}")
    if a.dtype not in _SUPPORTED or b.dtype != a.dtype:
        raise TypeError(f"matmul supports {_SUPPORTED} with equal dtypes, got {a.dtype}, {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"matmul operands on different devices: {a.device}, {b.device}")
    if bias is not None and (bias.shape != (b.shape[1],) or bias.dtype != a.dtype
                             or bias.device != a.device):
        raise ValueError(f"bias must be [{b.shape[1]}] {a.dtype} on {a.device}")


def clear_caches() -> None:
    """Forget the per-weight launch state (after TUNED_16BIT changes)."""
    _WEIGHTS.clear()


def prefetch_bytes(m: int, row_bytes: int, weight: tuple[int, int] | None = None) -> int:
    """Bytes of each weight row (row_bytes long) a program asks L2 for before its PDL wait:
    PREFETCH_ROW_BYTES (PREFETCH_BY_WEIGHT's for a weight (N, K) there), at most the row, a
    multiple of 16 (the bulk prefetch's unit); 0 above PREFETCH_MAX_M rows."""
    if m > PREFETCH_MAX_M:
        return 0
    return min(row_bytes, PREFETCH_BY_WEIGHT.get(weight, PREFETCH_ROW_BYTES)) // 16 * 16


def _prefetches(a: torch.Tensor, b_is_nk: bool) -> bool:
    """Whether a launch may prefetch its weight rows: only where it starts early (PDL), from
    [N, K] weights (rows of K), 16-bit."""
    return b_is_nk and pdl.on(a) and a.element_size() == 2


def _tma_ok(t: torch.Tensor, strides: tuple[int, ...]) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in strides)


def _b_layout(b: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(tensor, is_nk): a transposed nn.Linear weight W.t() is used as W [N, K] without a copy."""
    k, n = b.shape
    if b.stride(0) == 1 and (n == 1 or b.stride(1) >= k):
        return b.t(), True
    if b.stride(1) == 1 and (k == 1 or b.stride(0) >= n):
        return b, False
    return b.contiguous(), False


def _a_desc(m: int, cfg: TileConfig) -> bool:
    """A and C through TMA descriptors from DESC_MIN_TILES row tiles up (measured on H200:
    from one tile on, descriptors beat masked loads by up to 1.5x). Below a tile A is read
    with masked loads: TMA zero-fills rows past M far slower than it streams the weights, and
    a padded copy of A costs a launch. The K order is the same either way."""
    return m >= DESC_MIN_TILES * cfg.block_m


def _operands(a: torch.Tensor, a_stride0: int, bt: torch.Tensor, b_is_nk: bool,
              c: torch.Tensor, cfg: TileConfig, a_desc: bool) -> tuple:
    """The kernel's A, B, C and tail A, B, C arguments: TMA descriptors with the tiles' boxes
    (A and C plain tensors without a_desc); without a tail, the tail's are the main ones."""
    (m, k), n = a.shape, c.shape[1]

    def three(block_m: int, block_n: int) -> tuple:
        b_block = [block_n, cfg.block_k] if b_is_nk else [cfg.block_k, block_n]
        return (TensorDescriptor(a, [m, k], [a_stride0, 1], [block_m, cfg.block_k])
                if a_desc else a,
                TensorDescriptor(bt, list(bt.shape), [bt.stride(0), 1], b_block),
                TensorDescriptor(c, [m, n], [n, 1], [block_m, block_n]) if a_desc else c)

    main = three(cfg.block_m, cfg.block_n)
    return (*main, *(three(cfg.tail_m, cfg.tail_n) if cfg.tail_m else main))


def _waves(m: int, n: int, cfg: TileConfig, max_programs: int) -> tuple[int, int, int]:
    """(tiles computed whole, programs, tail sub-tiles): the full waves of the persistent grid
    take whole tiles; with a tail config the tiles after them are cut into sub-tiles."""
    total = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    grid = min(total, max_programs)
    full = total // grid * grid
    if not cfg.tail_m or full == total:
        return total, grid, 0
    return full, grid, (total - full) * cfg.subtiles


class _Launch:
    """One (weight, tile config, A path) on the fast path: the compiled kernel and every
    argument that depends only on the weight, the bias and the tile choice."""

    def __init__(self, a: torch.Tensor, bt: torch.Tensor, b_is_nk: bool,
                 bias: torch.Tensor | None, cfg: TileConfig, a_desc: bool, info: DeviceInfo):
        m, k = a.shape
        n = bt.shape[0] if b_is_nk else bt.shape[1]
        c = a.new_empty((m, n))
        operands = _operands(a, k, bt, b_is_nk, c, cfg, a_desc)
        on = pdl.on(a)
        self.prefetch = _prefetches(a, b_is_nk)
        self.launcher = Launcher(
            _matmul_tma_kernel, (1,),
            (*operands, bias if bias is not None else c, m, n, k, k, 1, 1, 0, bt, bt.stride(0),
             0, cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.tail_m, cfg.tail_n,
             b_is_nk, a_desc, bias is not None, "ieee" if a.dtype == torch.float32 else "tf32",
             self.prefetch, cfg.num_warps * 32, on),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=on)
        self.weight_args = (bt.data_ptr(), bt.stride(0))
        self.row_bytes = k * bt.element_size()
        # Descriptor parameters in order: A, B, C, A2, B2, C2 (B and B2 only without a_desc).
        first_b = 1 if a_desc else 0
        self.b_args = tuple(self.launcher.descriptor_arg(first_b, operands[1]))
        self.b2_args = tuple(self.launcher.descriptor_arg(first_b + (3 if a_desc else 1),
                                                          operands[4]))
        self.encoders = tuple(self.launcher.encoder(i) for i in (0, 2, 3, 5)) if a_desc else None
        self.config = cfg
        self.max_programs = info.num_sms * cfg.ctas_per_sm
        # (A's address, C's address, M) -> the encoded A, B and C descriptor arguments. An
        # eager loop's activations come back at the same addresses from the caching
        # allocator, so the two per-call encodings are mostly found here; a descriptor is a
        # function of address, shape and tile alone, so a reused address gets the same one.
        self.descriptors: dict[tuple[int, int, int], tuple] = {}

    def operand_args(self, a_ptr: int, c_ptr: int, m: int, n: int, k: int) -> tuple:
        """The launcher's A, B, C, A2, B2, C2 arguments for this call's A and C."""
        if self.encoders is None:  # A and C by plain pointers
            return (a_ptr, *self.b_args, c_ptr, a_ptr, *self.b2_args, c_ptr)
        key = (a_ptr, c_ptr, m)
        args = self.descriptors.get(key)
        if args is None:
            if len(self.descriptors) >= _MAX_DESCRIPTORS:
                self.descriptors.clear()
            enc_a, enc_c, enc_a2, enc_c2 = self.encoders
            args = self.descriptors[key] = (
                *enc_a(a_ptr, [m, k], [k, 1]), *self.b_args, *enc_c(c_ptr, [m, n], [n, 1]),
                *enc_a2(a_ptr, [m, k], [k, 1]), *self.b2_args, *enc_c2(c_ptr, [m, n], [n, 1]))
        return args


class _Weight:
    """What the fast path keeps per weight (and bias): nothing that holds the tensors."""

    def __init__(self, bt: torch.Tensor, b_is_nk: bool, bias: torch.Tensor | None,
                 info: DeviceInfo):
        self.b_is_nk = b_is_nk
        self.n, self.k = bt.shape if b_is_nk else (bt.shape[1], bt.shape[0])
        self.dtype = bt.dtype
        self.device = bt.get_device()
        self.info = info
        self.bias_ptr = bias.data_ptr() if bias is not None else 0
        self.by_m: dict[int, _Plan] = {}
        self.by_config: dict[tuple[TileConfig, bool], _Launch] = {}

    def plan_for(self, a: torch.Tensor, bt: torch.Tensor, bias: torch.Tensor | None,
                 m: int) -> _Plan:
        cfg = pick_config(m, self.n, self.k, self.dtype, self.info)
        key = (cfg, _a_desc(m, cfg))
        launch = self.by_config.get(key)
        if launch is None:
            launch = _Launch(a, bt, self.b_is_nk, bias, cfg, key[1], self.info)
            self.by_config[key] = launch
        plan = self.by_m[m] = _Plan(launch, m, self.n, self.k)
        if self.b_is_nk and bias is None:
            # cuBLASLt where it is faster, once its bits proved equal to this config's here
            plan.gemm = cublaslt.gemm_for(bt, m, lambda x, w: matmul(x, w, config=cfg))
        return plan


class _Plan:
    """One (weight, M): the launch state and the call's arguments that follow from M alone,
    so that a call computes nothing but A's and C's addresses."""

    __slots__ = ("launch", "grid", "tail", "gemm")

    def __init__(self, launch: _Launch, m: int, n: int, k: int):
        self.gemm: cublaslt.Gemm | None = None  # set: this M runs on cuBLASLt instead
        whole, self.grid, sub = _waves(m, n, launch.config, launch.max_programs)
        self.launch = launch
        prefetch = prefetch_bytes(m, launch.row_bytes, (n, k)) if launch.prefetch else 0
        # M, N, K, stride_am, whole tiles, grid, tail sub-tiles, the weight's rows, the bytes of
        # each to prefetch
        self.tail = (m, n, k, k, whole, self.grid, sub, *launch.weight_args, prefetch)


# (weight data_ptr, shape, strides, dtype, bias data_ptr) -> _Weight, or None where the fast
# path does not apply. Keyed by address, not by tensor: an entry holds no reference, and a
# later tensor at the same address with the same shape and strides gets the same descriptor.
_WEIGHTS: dict[tuple, _Weight | None] = {}
_MAX_WEIGHTS = 4096
_MAX_DESCRIPTORS = 64  # per launch state


def _weight_for(key: tuple, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None
                ) -> _Weight | None:
    _check(a, b, bias)
    info = device_info(b.get_device())
    bt, b_is_nk = _b_layout(b)
    ok = (info.capability >= (9, 0) and bt.data_ptr() == b.data_ptr()  # a view, not a copy
          and a.dtype in (torch.bfloat16, torch.float16, torch.float32)
          and _tma_ok(bt, (bt.stride(0),)) and (b.shape[1] * b.element_size()) % 16 == 0
          and (b.shape[0] * b.element_size()) % 16 == 0  # A's rows, K long, TMA-addressable
          and (bias is None or bias.data_ptr() % 16 == 0) and b.shape[0] > 0
          and b.shape[1] > 0)
    if len(_WEIGHTS) >= _MAX_WEIGHTS:
        _WEIGHTS.clear()
    weight = _Weight(bt, b_is_nk, bias, info) if ok else None
    _WEIGHTS[key] = weight
    return weight


def _matmul_fast(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                 host_bound: bool = False) -> torch.Tensor | None:
    """The CUDA launch with per-call host work cut to the bone; None where it does not apply
    (the JIT path below then runs the same kernels)."""
    if a.dim() != 2 or b.dim() != 2:
        return None
    key = (b.data_ptr(), b.shape, b.stride(), b.dtype,
           bias.data_ptr() if bias is not None else 0)
    weight = _WEIGHTS.get(key, False)
    if weight is False:
        weight = _weight_for(key, a, b, bias)
    if weight is None:
        return None
    m, k = a.shape
    a_ptr = a.data_ptr()
    # is_contiguous: A's rows are K apart (K >= 8 here, so its one element stride is 1 too).
    if (k != weight.k or a.dtype != weight.dtype or m == 0 or a_ptr % 16
            or not a.is_contiguous() or a.get_device() != weight.device):
        return None
    plan = weight.by_m.get(m)
    if plan is None:
        bt, _ = _b_layout(b)
        try:
            plan = weight.plan_for(a, bt, bias, m)
        except Unsupported:
            _WEIGHTS[key] = None
            return None
    if plan.gemm is not None and (not host_bound or torch.cuda.is_current_stream_capturing()):
        return plan.gemm(a, raw_stream(weight.device))
    c = a.new_empty((m, weight.n))
    c_ptr = c.data_ptr()
    launch, n = plan.launch, weight.n
    launch.launcher(plan.grid, 1, 1, raw_stream(weight.device),
                    *launch.operand_args(a_ptr, c_ptr, m, n, k), weight.bias_ptr or c_ptr,
                    *plan.tail)
    return c


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
           config: TileConfig | None = None, a_desc: bool | None = None,
           host_bound: bool = False) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) -> [M, N] in a's dtype; rows independent of M.

    `host_bound`: the caller launches eagerly, one op at a time (set_batch_invariant_mode): the
    Triton launch serves every M, cuBLASLt only inside a CUDA graph capture. Such a forward
    waits on its host at small batches (transformers' Qwen3, 8B widths, at batch 8: 2.95 ms of
    device time with and without the mode, 4.4-5.0 ms of wall time), so cuBLASLt's faster
    device time buys nothing there: on one H100 that model in the mode ran 1.08-1.10x its time
    without the mode at batch 8 with the Triton launch, 1.14-1.17x with cuBLASLt, and the same
    at batch 1 and 64 either way (bench/results/kernels-eager-h100-2026-12-07-host-bound-ab.json).
    The bits are the same whichever serves (cublaslt.py).
    `config` overrides the tile choice and `a_desc` the A path (benchmarks and invariance
    checks only: both go through the JIT launch)."""
    if config is None and a_desc is None and a.is_cuda:
        out = _matmul_fast(a, b, bias, host_bound)
        if out is not None:
            return out
    _check(a, b, bias)
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0:
        out = torch.zeros((m, n), dtype=a.dtype, device=a.device)
        return out + bias if bias is not None else out
    if a.stride(1) != 1 or (m > 1 and a.stride(0) < k):
        a = a.contiguous()
    a_stride0 = a.stride(0) if m > 1 else k
    bt, b_is_nk = _b_layout(b)
    info = device_info(a.device.index if a.device.type == "cuda" else None)
    cfg = config or pick_config(m, n, k, a.dtype, info)
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    use_tma = (info.capability >= (9, 0) or info.capability == (0, 0)) and \
        _tma_ok(a, (a_stride0,)) and _tma_ok(bt, (bt.stride(0),)) and \
        (n * a.element_size()) % 16 == 0
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    bias_arg = bias if bias is not None else c
    launch = pdl.options(a)
    if use_tma:
        desc = _a_desc(m, cfg) if a_desc is None else a_desc
        whole, grid, sub = _waves(m, n, cfg, info.num_sms * cfg.ctas_per_sm)
        prefetch = _prefetches(a, b_is_nk)
        _matmul_tma_kernel[(grid,)](
            *_operands(a, a_stride0, bt, b_is_nk, c, cfg, desc), bias_arg, m, n, k, a_stride0,
            whole, grid, sub, bt, bt.stride(0),
            prefetch_bytes(m, k * a.element_size(), (n, k)) if prefetch else 0,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            TAIL_M=cfg.tail_m, TAIL_N=cfg.tail_n, B_IS_NK=b_is_nk, A_DESC=desc,
            HAS_BIAS=bias is not None, PRECISION=precision, PREFETCH=prefetch,
            THREADS=cfg.num_warps * 32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **launch)
    else:
        stride_bk, stride_bn = (bt.stride(1), bt.stride(0)) if b_is_nk else bt.stride()
        grid = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        _matmul_ptr_kernel[(grid,)](
            a, bt, c, bias_arg, m, n, k, a_stride0, 1, stride_bk, stride_bn, n, 1,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
            HAS_BIAS=bias is not None, PRECISION=precision,
            num_warps=cfg.num_warps, num_stages=min(cfg.num_stages, 4), **launch)
    return c
