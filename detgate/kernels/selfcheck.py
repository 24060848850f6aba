"""Startup self-check: the batch-invariant ops, run on a model's own shapes, must give every row
the same bits alone, in a batch, and wherever it sits in the batch.

The invariance follows from how the kernels fix their reduction orders (kernels/cpu.py and the
C++ source say why); this check is the measurement that confirms it on the machine at hand,
before a worker serves answers that claim it. Each op runs on rows 0..R of random input once,
then on every slice x[off:off + m] for the row counts below (every count up to past the
matmul's register blocks, then around its row tiles) at several offsets; any slice whose bits
differ from the same rows of the whole batch is a failure, named by op, shape and dtype.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from detgate import kernels
from detgate.kernels import cpu
from detgate.kernels.attention import paged_attention, store_kv
from detgate.kernels.bits import same_bits
from detgate.kernels.quantised import QuantisedWeight

ROW_COUNTS = (*range(1, 25), 31, 32, 33, 47, 48, 49, 64, 97)
OFFSETS = (0, 1, 3)
# lm_head-sized matmuls are checked on this many of their output columns: a column's order
# does not depend on the others, and the whole head would cost seconds.
MAX_COLUMNS = 512


class SelfCheckError(RuntimeError):
    """An op gave a row other bits in another batch: the worker must not serve."""


@dataclass(frozen=True)
class Check:
    op: str
    shape: str
    width: int  # input row width
    run: Callable[[torch.Tensor], torch.Tensor]  # rows [R, width] -> [R, ...]


def first_difference(check: Check, dtype: torch.dtype, device: torch.device,
                     row_counts=ROW_COUNTS, offsets=OFFSETS) -> str | None:
    """None if every slice has the batch's bits, else which slice differs."""
    gen = torch.Generator().manual_seed(0)
    total = max(row_counts) + max(offsets)
    x = torch.randn(total, check.width, generator=gen).to(device=device, dtype=dtype)
    full = check.run(x)
    for off in offsets:
        for m in row_counts:
            if not same_bits(check.run(x[off:off + m]), full[off:off + m]):
                return f"{m} rows at offset {off} differ from the same rows in a batch of {total}"
    return None


def linear_check(name: str, weight: torch.Tensor) -> Check:
    """x @ weight.T as the engine runs it (weight [N, K], read in place)."""
    w = weight[:MAX_COLUMNS]
    return Check("matmul", f"{name} K={weight.shape[1]} N={weight.shape[0]}", weight.shape[1],
                 lambda x: kernels.matmul(x, w.t()))


def quantised_check(name: str, weight: QuantisedWeight) -> Check:
    """x @ weight.T from the GGUF blocks, as the engine runs it; `first_difference` checks its
    invariance and `quantised_difference` its equality with the fp32 path."""
    w = weight.narrow(0, min(MAX_COLUMNS, weight.shape[0]))
    return Check("matmul_quantised", f"{name} {weight.qtype} K={weight.k} N={weight.shape[0]}",
                 weight.k, lambda x: cpu.matmul_quantised(x, w))


def quantised_difference(check: Check, dequantised: torch.Tensor) -> str | None:
    """None if a quantised check's matmul gives the bits of the fp32 matmul on `dequantised`
    (the same weight [N, K] in fp32) over a batch of every row count's rows."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(max(ROW_COUNTS), check.width, generator=gen)
    w = dequantised[:MAX_COLUMNS]
    if same_bits(check.run(x), kernels.matmul(x, w.t())):
        return None
    return "differs from the fp32 matmul on the dequantised weight"


def model_checks(linears: dict[str, torch.Tensor], hidden: int, head_dim: int,
                 vocab: int | None = None) -> list[Check]:
    """The checks for a decoder: each distinct matmul weight shape, RMSNorm over the hidden
    size and the head dim, SwiGLU's silu * up, and log_softmax over the vocabulary."""
    checks, seen = [], set()
    for name, weight in linears.items():
        if tuple(weight.shape) not in seen:
            seen.add(tuple(weight.shape))
            checks.append(linear_check(name, weight))
            if name.endswith("gate_up_proj"):
                checks.append(Check("silu_and_mul", f"I={weight.shape[0] // 2}",
                                    weight.shape[0], kernels.silu_and_mul))
    for h in sorted({hidden, head_dim}):
        w = torch.ones(h)
        checks.append(Check("rms_norm", f"H={h}", h,
                            lambda x, w=w: kernels.rms_norm(x, w.to(x), 1e-6)))
    if vocab:
        checks.append(Check("log_softmax", f"V={vocab}", vocab, kernels.log_softmax))
    return checks


def attention_difference(hq: int, hkv: int, head_dim: int, dtype: torch.dtype,
                         device: torch.device, block_size: int = 16) -> str | None:
    """A 40-token sequence's prefill, its chunks and its decodes, alone and among other
    sequences' decodes and prefill chunks: None if all agree bit for bit."""
    gen = torch.Generator().manual_seed(1)
    lens = [40, 70, 9, 23, 1]
    blocks_per = [-(-n // block_size) for n in lens]
    k_cache = torch.zeros(sum(blocks_per) + 1, block_size, hkv, head_dim, dtype=dtype,
                          device=device)
    v_cache = torch.zeros_like(k_cache)
    tables, start = [], 1
    for nb in blocks_per:
        tables.append(list(range(start, start + nb)) + [0] * (max(blocks_per) - nb))
        start += nb
    table = torch.tensor(tables, dtype=torch.int32, device=device)
    for i, n in enumerate(lens):
        k, v = (torch.randn(n, hkv, head_dim, generator=gen).to(device=device, dtype=dtype)
                for _ in range(2))
        pos = torch.arange(n, device=device)
        store_kv(k, v, k_cache, v_cache, table[i, pos // block_size].long() * block_size
                 + pos % block_size)
    q = {i: torch.randn(n, hq, head_dim, generator=gen).to(device=device, dtype=dtype)
         for i, n in enumerate(lens)}

    def run(batch: list[tuple[int, int, int]], decode: bool = False) -> list[torch.Tensor]:
        """batch: (sequence, first query position, end) -> each entry's output rows."""
        qs = torch.cat([q[i][s:e] for i, s, e in batch])
        starts = [0]
        for _, s, e in batch:
            starts.append(starts[-1] + e - s)
        out = paged_attention(qs, k_cache, v_cache, table[[i for i, _, _ in batch]],
                              torch.tensor(starts, dtype=torch.int32, device=device),
                              torch.tensor([e for _, _, e in batch], dtype=torch.int32,
                                           device=device), head_dim ** -0.5, decode=decode)
        return [out[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]

    alone = run([(0, 0, 40)])[0]
    others = [(1, 69, 70), (2, 0, 9), (3, 20, 23), (4, 0, 1)]
    for s, e in ((0, 40), (0, 13), (13, 14), (14, 31), (31, 40), (39, 40)):
        for batch in ([(0, s, e)], [*others[:2], (0, s, e), *others[2:]]):
            got = run(batch)[batch.index((0, s, e))]
            if not same_bits(got, alone[s:e]):
                return (f"queries {s}..{e - 1} in a batch of {len(batch)} sequences differ from "
                        "the same positions prefilled alone")
    # A decode step's launch (one query per sequence; on CUDA its own tile height) against
    # the same positions prefilled.
    for pos in (0, 13, 39):
        got = run([(1, 69, 70), (0, pos, pos + 1), (4, 0, 1)], decode=True)[1]
        if not same_bits(got, alone[pos:pos + 1]):
            return (f"position {pos} in a decode step differs from the same position prefilled "
                    "(DETGATE_DECODE_TILE=0 gives decode steps the prefill's tiles)")
    return None


def run(checks: list[Check], dtype: torch.dtype, device: torch.device,
        attention: tuple[int, int, int] | None = None) -> float:
    """Run every check (and the attention check for (Hq, Hkv, head dim)); seconds taken.
    Raises SelfCheckError naming the first op that failed."""
    t0 = time.perf_counter()
    dname = str(dtype).removeprefix("torch.")
    for check in checks:
        diff = first_difference(check, dtype, device)
        if diff:
            raise SelfCheckError(f"{check.op} ({check.shape}, {dname}): {diff}")
    if attention is not None:
        hq, hkv, d = attention
        diff = attention_difference(hq, hkv, d, dtype, device)
        if diff:
            raise SelfCheckError(f"paged_attention (Hq={hq} Hkv={hkv} D={d}, {dname}): {diff}")
    return time.perf_counter() - t0
