"""CPU kernels: a row's bits never depend on the batch, on every CPU.

One harness, `differing`, compares op(x[i:i+m]) with op(x)[i:i+m] by bit pattern for every row
count m in ROWS at every offset i in OFFSETS. It must find nothing for the kernels, at 1, 2 and
all of the machine's threads, fp32 and bf16, on the reduction lengths of the models the
project ships; and it must find differences for `split_k_matmul`, a control whose K split
depends on the row count (as split-K GEMMs' does), so that no invariance test here can pass
vacuously on a CPU whose arithmetic happens to be invariant. The control is built from the
kernels themselves, whose bits are the same on every CPU, so it fires on every CPU.

Matmuls are swept on the models' K with 67 output columns (a column's order does not depend on
the others; 67 covers a whole column tile, blocks of 4 and single columns), and checked at a
few row counts on their full (K, N).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from detgate import kernels
from detgate.kernels import cpu, reference
from detgate.kernels.bits import same_bits
from detgate.kernels.cpu_ext import load

ROWS = [*range(1, 257), 300, 511, 1000]
OFFSETS = [0, 1, 3, 17]
WIDE_ROWS = [*range(1, 65), 100, 257]  # rows of 49k-152k elements
DTYPES = [torch.float32, torch.bfloat16]

# (K, N) of every matmul of the shipped models: tiny (hidden 256, intermediate 768, 8 q / 2 kv
# heads of 32, vocab 151,936) and SmolLM2-135M (576, 1536, 9 / 3 of 64, vocab 49,152).
TINY = {"qkv": (256, 384), "o": (256, 256), "gate_up": (256, 1536), "down": (768, 256),
        "lm_head": (256, 151936)}
SMOLLM2 = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
           "lm_head": (576, 49152)}
REDUCTION_LENGTHS = sorted({k for k, _ in (*TINY.values(), *SMOLLM2.values())})


def differing(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
              rows=ROWS, offsets=OFFSETS) -> list[tuple[int, int]]:
    """(offset, m) of every slice whose rows differ in bits from the same rows of op(x)."""
    full = op(x)
    return [(i, m) for i in offsets for m in rows
            if i + m <= x.shape[0] and not same_bits(op(x[i:i + m]), full[i:i + m])]


def _inputs(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=gen).to(dtype)


def _weight(k: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)


def split_k_matmul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The negative control: below 16 rows, K is reduced in two halves added afterwards."""
    if a.shape[0] >= 16:
        return cpu.matmul(a, w.t())
    h = a.shape[1] // 2
    return cpu.matmul(a[:, :h], w[:, :h].t()) + cpu.matmul(a[:, h:], w[:, h:].t())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k", REDUCTION_LENGTHS)
def test_matmul_rows_do_not_depend_on_the_batch(k, dtype, threads):
    w = _weight(k, 67, dtype)
    x = _inputs(max(ROWS) + max(OFFSETS), k, dtype, seed=k)
    assert differing(lambda a: kernels.matmul(a, w.t()), x) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("model", "name"), [*(("tiny", n) for n in TINY),
                                             *(("smollm2", n) for n in SMOLLM2)])
def test_matmul_full_model_shapes(model, name, dtype, threads):
    k, n = (TINY if model == "tiny" else SMOLLM2)[name]
    w = _weight(k, n, dtype)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    x = _inputs(120, k, dtype, seed=n)
    rows = [1, 2, 3, 4, 5, 8, 17, 48, 49, 100]
    assert differing(lambda a: kernels.matmul(a, w.t(), bias), x, rows, [0, 17]) == []


def test_split_k_control_finds_differences():
    """The same harness on a kernel that is not invariant: it must find rows that differ."""
    for k, dtype in ((576, torch.float32), (1536, torch.bfloat16)):
        w = _weight(k, 67, dtype)
        x = _inputs(64, k, dtype, seed=3)
        found = differing(lambda a, w=w: split_k_matmul(a, w), x, range(1, 33), [0, 3])
        assert found, f"the control found no difference at K={k}: the harness shows nothing"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h", [32, 64, 256, 576])
def test_rms_norm_rows_do_not_depend_on_the_batch(h, dtype, threads):
    w = (1 + torch.randn(h, generator=torch.Generator().manual_seed(h)) / 10).to(dtype)
    x = _inputs(max(ROWS) + max(OFFSETS), h, dtype, seed=h) * 3
    res = _inputs(x.shape[0], h, dtype, seed=h + 1)
    assert differing(lambda a: kernels.rms_norm(a, w, 1e-6), x) == []
    both = torch.cat([x, res], dim=1)  # add_rms_norm's two inputs side by side, for slicing
    assert differing(lambda a: torch.cat(kernels.add_rms_norm(a[:, :h], a[:, h:], w, 1e-5), 1),
                     both) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("i", [768, 1536])
def test_silu_and_mul_rows_do_not_depend_on_the_batch(i, dtype, threads):
    """Pointwise (no reduction), so two offsets suffice: the vectorised body and the padded
    last block must agree wherever a row starts."""
    x = _inputs(max(ROWS) + max(OFFSETS), 2 * i, dtype, seed=i) * 4
    assert differing(kernels.silu_and_mul, x, offsets=[0, 17]) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("v", [49152, 151936])
def test_log_softmax_rows_do_not_depend_on_the_batch(v, dtype, threads):
    x = _inputs(max(WIDE_ROWS) + 3, v, dtype, seed=v) * 4
    assert differing(kernels.log_softmax, x, WIDE_ROWS, [0, 3]) == []


@pytest.mark.parametrize("v", [1000, 49152])
def test_softmax_rows_do_not_depend_on_the_batch(v, threads):
    """The sampler's softmax (one row at a time there, but any batch here)."""
    x = _inputs(max(WIDE_ROWS) + 3, v, torch.float32, seed=v + 1) * 4
    assert differing(cpu.softmax, x, WIDE_ROWS, [0, 3]) == []
    torch.testing.assert_close(cpu.softmax(x[:5]), torch.softmax(x[:5].double(), -1).float(),
                               atol=1e-9, rtol=1e-5)
    edges = torch.tensor([[0.0, -200.0, float("-inf"), 3.0, 88.0]])
    torch.testing.assert_close(cpu.softmax(edges), torch.softmax(edges, -1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ops_match_the_reference(dtype):
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    w = _weight(576, 960, dtype)
    a = _inputs(33, 576, dtype, seed=5)
    torch.testing.assert_close(kernels.matmul(a, w.t()).float(),
                               reference.matmul(a, w.t()).float(), atol=tol * 10, rtol=tol)
    x = _inputs(33, 3072, dtype, seed=6) * 4
    gate, up = x.double().chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_and_mul(x).double(),
                               (gate * torch.sigmoid(gate) * up).to(dtype).double(),
                               atol=tol * 10, rtol=tol)
    x = _inputs(50, 576, dtype, seed=8) * 3
    res = _inputs(50, 576, dtype, seed=9)
    weight = (1 + _inputs(1, 576, torch.float32, seed=10)[0] / 10).to(dtype)
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6),
                               reference.rms_norm(x, weight, 1e-6), atol=tol, rtol=tol)
    normed, new_res = kernels.add_rms_norm(x, res, weight, 1e-6)
    ref_normed, ref_res = reference.add_rms_norm(x, res, weight, 1e-6)
    assert same_bits(new_res, ref_res)
    torch.testing.assert_close(normed, ref_normed, atol=tol, rtol=tol)
    # q/k norms: [tokens, heads, head_dim], each last-dim row on its own.
    x3 = x[:12].reshape(12, 9, 64)
    assert same_bits(kernels.rms_norm(x3[:5], weight[:64], 1e-6),
                     kernels.rms_norm(x3, weight[:64], 1e-6)[:5])
    logits = _inputs(7, 49152, dtype, seed=7) * 4
    torch.testing.assert_close(kernels.log_softmax(logits), reference.log_softmax(logits),
                               atol=1e-4, rtol=1e-5)


def test_float16_matmul_is_widened_and_invariant():
    w = _weight(576, 67, torch.float16)
    x = _inputs(60, 576, torch.float16, seed=11)
    assert differing(lambda a: kernels.matmul(a, w.t()), x, range(1, 50), [0, 3]) == []
    torch.testing.assert_close(kernels.matmul(x, w.t()).float(),
                               reference.matmul(x, w.t()).float(), atol=2e-2, rtol=2e-3)


def test_exp_and_silu_at_the_edges():
    """exp's range ends (0 below -104, inf above 88.72, NaN through) and silu's tails."""
    g = torch.tensor([-1e30, -200.0, -104.0, -88.0, -1e-30, -0.0, 0.0, 1e-30, 88.0, 89.0,
                      1e30, float("inf"), float("-inf"), float("nan")])
    out = kernels.silu_and_mul(torch.cat([g, torch.ones_like(g)])[None])[0]
    gd = g.double()
    want = torch.nn.functional.silu(gd).float()
    finite = g.isfinite() & (g.abs() < 1e29)
    torch.testing.assert_close(out[finite], want[finite], atol=1e-37, rtol=1e-6)
    # silu(inf) = inf; silu(-inf) = -inf / inf and silu(nan) are NaN, as in torch.
    assert out[-3] == float("inf") and out[-2].isnan() and out[-1].isnan()
    row = torch.tensor([[0.0, -200.0, float("-inf"), 3.0]])
    torch.testing.assert_close(kernels.log_softmax(row), torch.log_softmax(row, -1))


def test_builds_give_the_same_bits():
    """The AVX2 + FMA build and the portable one (a scalar fmaf on x86) agree bit for bit on
    every op: the instruction set changes speed only. Trivially true where they are one."""
    native, baseline = load("native"), load("baseline")
    gen = torch.Generator().manual_seed(9)
    a = torch.randn(37, 1536, generator=gen)
    for wdtype in DTYPES:
        w = (torch.randn(70, 1536, generator=gen) / 40).to(wdtype)
        assert same_bits(native.matmul(a, w), baseline.matmul(a, w)), wdtype
    x = torch.randn(9, 49157, generator=gen) * 5
    assert same_bits(native.log_softmax(x), baseline.log_softmax(x))
    assert same_bits(native.softmax(x), baseline.softmax(x))
    assert same_bits(native.inv_rms(x, 1e-6), baseline.inv_rms(x, 1e-6))
    y = torch.randn(9, 3078, generator=gen) * 5
    assert same_bits(native.silu_and_mul(y), baseline.silu_and_mul(y))
    for d, cache_dtype in ((64, torch.float32), (20, torch.bfloat16)):  # 20: a partial vf8
        q = torch.randn(20, 6, d, generator=gen)
        cache = [torch.randn(4, 16, 2, d, generator=gen).to(cache_dtype) for _ in range(2)]
        tables = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
        args = (q, *cache, tables, torch.tensor([0, 20], dtype=torch.int32),
                torch.tensor([50], dtype=torch.int32), d ** -0.5)
        assert same_bits(native.paged_attention(*args), baseline.paged_attention(*args)), d
    h = torch.randn(11, 581, generator=gen) * 3
    r, w = torch.randn_like(h), torch.randn(581, generator=gen)
    assert same_bits(native.rms_norm(h, w, 1e-6), baseline.rms_norm(h, w, 1e-6))
    assert all(same_bits(n, b) for n, b in zip(native.add_rms_norm(h, r, w, 1e-6),
                                               baseline.add_rms_norm(h, r, w, 1e-6),
                                               strict=True))
    pos = torch.tensor([0, 5, 99, 3], dtype=torch.int64)
    tables = [torch.randn(100, 21, generator=gen) for _ in range(2)]
    x = torch.randn(4, 3, 42, generator=gen)
    assert same_bits(native.rotary(pos, x, *tables), baseline.rotary(pos, x, *tables))


def test_one_element_reductions():
    """K = 1 (a rotary embedding's outer product through bmm) and one-wide rows, whatever
    their strides."""
    gen = torch.Generator().manual_seed(12)
    a, b = torch.randn(5, 1, generator=gen), torch.randn(1, 7, generator=gen)
    assert same_bits(kernels.matmul(a, b), a * b)  # one product, no sum: exact
    x = torch.randn(4, 1, generator=gen)
    assert same_bits(kernels.log_softmax(x), torch.zeros(4, 1))
    torch.testing.assert_close(kernels.rms_norm(x, torch.ones(1), 1e-6),
                               reference.rms_norm(x, torch.ones(1), 1e-6))
