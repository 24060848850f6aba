"""CPU kernels: bitwise batch invariance over the whole row range, accuracy vs the reference,
and negative controls showing that plain torch is not invariant on the same shapes."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import reference

ROW_COUNTS = [*range(1, 65), 100, 257, 1000]
WIDE_ROW_COUNTS = [*range(1, 65), 100]  # for rows of 8k-150k elements: keeps the suite fast
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _weight_view(k: int, n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """b as the engine passes it: the transpose of an nn.Linear weight [N, K], no copy."""
    return (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).t()


@pytest.mark.parametrize(("dtype", "k", "n"), [
    *((dtype, k, n) for dtype in (torch.float32, torch.bfloat16)
      for k, n in ((256, 768), (896, 640), (4096, 256))),
    (torch.float16, 896, 640),
])
def test_matmul_rows_do_not_depend_on_batch_size(dtype, k, n):
    gen = torch.Generator().manual_seed(k + n)
    b = _weight_view(k, n, dtype, gen)
    bias = torch.randn(n, generator=gen).to(dtype)
    a = torch.randn(max(ROW_COUNTS) + 3, k, generator=gen).to(dtype)
    full = kernels.matmul(a[:max(ROW_COUNTS)], b, bias)
    for m in ROW_COUNTS:
        assert torch.equal(kernels.matmul(a[:m], b, bias), full[:m]), f"rows differ at M={m}"
    # A row keeps its bits wherever it sits in the batch.
    for start in (1, 3, 17):
        for m in (1, 5, 13, 40):
            got = kernels.matmul(a[start:start + m], b, bias)
            assert torch.equal(got, full[start:start + m]), f"offset {start}, M={m}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    b = _weight_view(1024, 384, dtype, gen)
    bias = torch.randn(384, generator=gen).to(dtype)
    for m in (1, 7, 33, 300):
        a = torch.randn(m, 1024, generator=gen).to(dtype)
        got = kernels.matmul(a, b, bias)
        assert got.dtype == dtype and got.shape == (m, 384)
        torch.testing.assert_close(got.float(), reference.matmul(a, b, bias).float(),
                                   atol=TOL[dtype] * 10, rtol=TOL[dtype])


def test_plain_torch_mm_is_not_batch_invariant():
    """Negative control: MKL's fp32 GEMM changes a row's bits with the row count, so the
    invariance test above is able to fail."""
    gen = torch.Generator().manual_seed(1)
    b = _weight_view(1024, 512, torch.float32, gen)
    a = torch.randn(64, 1024, generator=gen)
    full = torch.mm(a, b)
    differing = [m for m in range(1, 17) if not torch.equal(torch.mm(a[:m], b), full[:m])]
    assert differing, "torch.mm was invariant at every M: the control shows nothing"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [256, 1024, 8192])
def test_rms_norm_rows_do_not_depend_on_batch_size(dtype, h):
    gen = torch.Generator().manual_seed(h)
    rows = WIDE_ROW_COUNTS if h > 1024 else ROW_COUNTS
    x = (torch.randn(max(rows), h, generator=gen) * 3).to(dtype)
    res = torch.randn(max(rows), h, generator=gen).to(dtype)
    w = (1 + torch.randn(h, generator=gen) / 10).to(dtype)
    full = kernels.rms_norm(x, w, 1e-6)
    full_normed, full_res = kernels.add_rms_norm(x, res, w, 1e-6)
    for m in rows:
        assert torch.equal(kernels.rms_norm(x[:m], w, 1e-6), full[:m]), f"rms_norm M={m}"
        normed, new_res = kernels.add_rms_norm(x[:m], res[:m], w, 1e-6)
        assert torch.equal(normed, full_normed[:m]) and torch.equal(new_res, full_res[:m])
    # 3-d input (tokens x heads x head_dim, as q/k norms use it) normalises each last-dim row.
    x3 = x[:12].reshape(12, h // 128, 128)
    w3 = w[:128]
    assert torch.equal(kernels.rms_norm(x3[:5], w3, 1e-6), kernels.rms_norm(x3, w3, 1e-6)[:5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(50, 1024, generator=gen) * 3).to(dtype)
    res = torch.randn(50, 1024, generator=gen).to(dtype)
    w = (1 + torch.randn(1024, generator=gen) / 10).to(dtype)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6),
                               atol=TOL[dtype], rtol=TOL[dtype])
    normed, new_res = kernels.add_rms_norm(x, res, w, 1e-6)
    ref_normed, ref_res = reference.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(normed, ref_normed, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v", [1000, 151936])
def test_log_softmax_rows_do_not_depend_on_batch_size(dtype, v):
    gen = torch.Generator().manual_seed(v)
    rows = WIDE_ROW_COUNTS if v > 1000 else ROW_COUNTS
    x = (torch.randn(max(rows), v, generator=gen) * 4).to(dtype)
    full = kernels.log_softmax(x)
    assert full.dtype == torch.float32
    for m in rows:
        assert torch.equal(kernels.log_softmax(x[:m]), full[:m]), f"log_softmax M={m}"
    torch.testing.assert_close(full, reference.log_softmax(x), atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a one-thread reduction never splits")
def test_plain_row_sum_is_not_batch_invariant():
    """Negative control: torch splits a single long row across threads, so its sum's bits
    differ from the same row summed inside a batch; the kernels' row sums do not."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8, 151936, generator=gen)
    assert not torch.equal(x[:1].sum(-1), x.sum(-1)[:1])
    w = torch.ones(151936)
    assert torch.equal(kernels.rms_norm(x[:1], w, 1e-6), kernels.rms_norm(x, w, 1e-6)[:1])
