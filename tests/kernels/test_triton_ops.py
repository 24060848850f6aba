"""The Triton kernels (matmul, rms_norm, add_rms_norm, log_softmax) on small shapes.

Without CUDA they run under Triton's interpreter (TRITON_INTERPRET=1, set before the kernel
modules are imported) on CPU tensors; with CUDA, natively. Each kernel must match a float64
reference and be bitwise batch-invariant: a row computed inside a batch of any size equals the
same row computed alone.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from detgate.kernels import log_softmax_triton as ls_mod  # noqa: E402
from detgate.kernels import matmul_triton as mm_mod  # noqa: E402
from detgate.kernels import reference  # noqa: E402
from detgate.kernels import rmsnorm_triton as rn_mod  # noqa: E402
from detgate.kernels.bits import same_bits  # noqa: E402
from tests.kernels.interpreter_dot import fixed_order_dot  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.fixture(autouse=True, scope="module")
def _interpreter_bf16():
    """Triton 3.6's interpreter keeps bf16 as raw uint16: tl.dot multiplies those integers and
    fp32 -> bf16 casts truncate. Give it the GPU's semantics: dot on the (exact) fp32 values,
    casts rounding to nearest even."""
    if ON_GPU:
        yield
        return
    builder = interpreter.InterpreterBuilder
    original_dot, original_cast = builder.create_dot, builder.cast_impl

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32),
                                        tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16),
                                            tl.bfloat16)
        return original_cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl
    yield
    builder.create_dot, builder.cast_impl = original_dot, original_cast


def test_runs_interpreted_without_cuda():
    if not ON_GPU:
        assert isinstance(mm_mod._matmul_tma_kernel, interpreter.InterpretedFunction)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=_gen(seed)).to(dtype).to(DEVICE)


def _linear_case(m, n, k, dtype, seed):
    """A [m, k], a weight [n, k] and a bias [n] for a linear layer, from seeds seed..seed+2."""
    return (_randn(m, k, dtype=dtype, seed=seed), _randn(n, k, dtype=dtype, seed=seed + 1),
            _randn(n, dtype=dtype, seed=seed + 2))


@pytest.fixture
def fixed_dot():
    """The GPU's dot natively; under the interpreter one with a fixed order per element
    (numpy's would give other bits by tile shape alone)."""
    with contextlib.nullcontext() if ON_GPU else fixed_order_dot():
        yield


# ---------------------------------------------------------------------------------- matmul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b_layout", ["linear_weight_t", "row_major"])
def test_matmul_matches_reference_and_is_batch_invariant(dtype, b_layout):
    m, n, k = 37, 48, 96
    a = _randn(m, k, dtype=dtype, seed=1)
    w = _randn(n, k, dtype=dtype, seed=2)
    bias = _randn(n, dtype=dtype, seed=3)
    b = w.t() if b_layout == "linear_weight_t" else w.t().contiguous()
    out = mm_mod.matmul(a, b, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    assert _rel_err(out, reference.matmul(a, b, bias)) < TOL[dtype]
    for rows in range(1, m + 1):
        assert same_bits(mm_mod.matmul(a[:rows], b, bias), out[:rows]), rows
    # a row alone, from the middle of the batch
    assert same_bits(mm_mod.matmul(a[20:21], b, bias), out[20:21])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_tail_subtiles_give_the_bits_of_whole_tiles(dtype, fixed_dot):
    # 3 x 3 tiles of 32 x 32 on the interpreter's 4 "SMs": 8 whole (two full waves), the last
    # one cut into four 16 x 16 sub-tiles spread over the programs; its lower half lies past M.
    m, n, k = 70, 96, 64
    a, w, bias = _linear_case(m, n, k, dtype, seed=31)
    whole = mm_mod.TileConfig(32, 32, 4, 1, block_k=32)
    tail = mm_mod.TileConfig(32, 32, 4, 1, block_k=32, tail_m=16, tail_n=16)
    sms = mm_mod.device_info(torch.cuda.current_device() if ON_GPU else None).num_sms
    assert mm_mod._waves(m, n, tail, sms)[2] > 0 or ON_GPU  # the tail path runs
    ref = mm_mod.matmul(a, w.t(), bias, config=whole)
    out = mm_mod.matmul(a, w.t(), bias, config=tail)
    assert _rel_err(out, reference.matmul(a, w.t(), bias)) < TOL[dtype]
    assert same_bits(out, ref)
    for rows in (1, 33, 64, 69):
        assert same_bits(mm_mod.matmul(a[:rows], w.t(), bias, config=tail), ref[:rows]), rows
    if not ON_GPU and dtype == torch.float32:
        # Control: the comparison sees a change of the K chain (16-wide dots summed into the
        # accumulator instead of 32-wide ones; the GPU's k16 MMA chain is the same for both).
        # fp32 output keeps the accumulator's bits; bf16 rounds such differences away here.
        chunked = mm_mod.TileConfig(32, 32, 4, 1, block_k=16, tail_m=16, tail_n=16)
        assert not same_bits(mm_mod.matmul(a, w.t(), bias, config=chunked), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_a_by_descriptor_or_by_pointer_gives_the_same_bits(dtype):
    # Below DESC_MIN_TILES row tiles A is read with masked loads (no padded copy), from there
    # through a TMA descriptor: the K order is the same, so the bits are too, on every M.
    m, n, k = 4 * mm_mod.CONFIG_INTERPRETER.block_m + 3, 40, 64
    a, w, bias = _linear_case(m, n, k, dtype, seed=21)
    by_desc = mm_mod.matmul(a, w.t(), bias, a_desc=True)
    assert same_bits(mm_mod.matmul(a, w.t(), bias, a_desc=False), by_desc)
    assert _rel_err(by_desc, reference.matmul(a, w.t(), bias)) < TOL[dtype]
    for rows in (1, 15, 16, 17, m - 4, m - 3, m):
        assert same_bits(mm_mod.matmul(a[:rows], w.t(), bias), by_desc[:rows]), rows


def test_tuned_table_names_configs_in_increasing_buckets():
    for shape, entries in mm_mod.TUNED_16BIT.items():
        bounds = [m for m, _ in entries]
        assert bounds == sorted(set(bounds)), shape
        assert all(name in mm_mod.CONFIGS_16BIT for _, name in entries), shape


def test_matmul_uses_linear_weight_without_copy():
    w = _randn(64, 32, dtype=torch.bfloat16, seed=4)
    used, is_nk = mm_mod._b_layout(w.t())
    assert is_nk and used.data_ptr() == w.data_ptr() and used.shape == w.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_unaligned_shapes_take_pointer_path_with_same_bits(dtype):
    # K = 6 bf16 (12-byte rows) cannot be a TMA descriptor: the pointer kernel serves it.
    m, n, k = 19, 20, 6 if dtype == torch.bfloat16 else 5
    a = _randn(m, k, dtype=dtype, seed=5)
    b = _randn(k, n, dtype=dtype, seed=6)
    out = mm_mod.matmul(a, b)
    assert _rel_err(out, reference.matmul(a, b)) < TOL[dtype]
    for rows in (1, 2, 7, 16, 19):
        assert same_bits(mm_mod.matmul(a[:rows], b), out[:rows])


def test_matmul_fp32_is_ieee_not_tf32():
    # TF32 keeps 10 mantissa bits: the error would be ~5e-4; IEEE fp32 stays under 1e-6.
    a = _randn(32, 256, dtype=torch.float32, seed=7)
    b = _randn(256, 32, dtype=torch.float32, seed=8)
    assert _rel_err(mm_mod.matmul(a, b), reference.matmul(a, b)) < 1e-5


def test_matmul_rejects_bad_inputs():
    a = _randn(4, 8, dtype=torch.float32, seed=9)
    with pytest.raises(ValueError):
        mm_mod.matmul(a, _randn(7, 4, dtype=torch.float32, seed=9))
    with pytest.raises(TypeError):
        mm_mod.matmul(a, _randn(8, 4, dtype=torch.bfloat16, seed=9))
    with pytest.raises(ValueError):
        mm_mod.matmul(a, _randn(8, 4, dtype=torch.float32, seed=9),
                      _randn(5, dtype=torch.float32, seed=9))


def test_matmul_degenerate_shapes():
    a = _randn(3, 0, dtype=torch.float32, seed=10)
    b = _randn(0, 4, dtype=torch.float32, seed=10)
    bias = _randn(4, dtype=torch.float32, seed=11)
    assert same_bits(mm_mod.matmul(a, b, bias), bias.expand(3, 4))
    assert mm_mod.matmul(_randn(0, 8, dtype=torch.float32, seed=1),
                         _randn(8, 4, dtype=torch.float32, seed=1)).shape == (0, 4)


# -------------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference_and_is_batch_invariant(dtype):
    x = _randn(2, 9, 96, dtype=dtype, seed=12)
    w = _randn(96, dtype=dtype, seed=13)
    out = rn_mod.rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert _rel_err(out, reference.rms_norm(x, w, 1e-6)) < TOL[dtype]
    flat = x.reshape(-1, 96)
    full = out.reshape(-1, 96)
    for rows in (1, 2, 5, 17, 18):
        assert same_bits(rn_mod.rms_norm(flat[:rows], w, 1e-6), full[:rows])
    assert same_bits(rn_mod.rms_norm(flat[11:12], w, 1e-6), full[11:12])


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_fuses_the_residual(dtype):
    x = _randn(13, 80, dtype=dtype, seed=14)
    res = _randn(13, 80, dtype=dtype, seed=15)
    w = _randn(80, dtype=dtype, seed=16)
    out, new_res = rn_mod.add_rms_norm(x, res, w, 1e-5)
    assert same_bits(new_res, x + res)  # the sum in x's dtype, bit for bit
    assert _rel_err(out, reference.rms_norm(x + res, w, 1e-5)) < TOL[dtype]
    for rows in (1, 4, 13):
        o, r = rn_mod.add_rms_norm(x[:rows], res[:rows], w, 1e-5)
        assert same_bits(o, out[:rows]) and same_bits(r, new_res[:rows])


def test_rms_norm_rejects_bad_inputs():
    x = _randn(3, 8, dtype=torch.float32, seed=17)
    with pytest.raises(ValueError):
        rn_mod.rms_norm(x, _randn(7, dtype=torch.float32, seed=17), 1e-6)
    with pytest.raises(TypeError):
        rn_mod.rms_norm(x, _randn(8, dtype=torch.bfloat16, seed=17), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_sum_matches_reference_and_is_batch_invariant(dtype, monkeypatch):
    monkeypatch.setattr(rn_mod, "ROW_SUM_BLOCK", 32)  # several chunks per row
    x = _randn(9, 100, dtype=dtype, seed=24)
    out = rn_mod.row_sum(x)
    assert out.dtype == torch.float32 and out.shape == (9,)
    assert _rel_err(out, x.double().sum(-1)) < 1e-5
    for rows in (1, 2, 5, 9):
        assert same_bits(rn_mod.row_sum(x[:rows]), out[:rows])
    assert same_bits(rn_mod.row_sum(x[4:5]), out[4:5])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length", [100, 128])
def test_row_mean_is_the_sum_times_the_reciprocal(dtype, length, monkeypatch):
    """row_sum(mean=True) folds torch's CUDA division by a scalar (a multiply by the fp32
    reciprocal, then the cast to the input's dtype) into the sum's launch: the same bits."""
    monkeypatch.setattr(rn_mod, "ROW_SUM_BLOCK", 32)
    x = _randn(9, length, dtype=dtype, seed=25)
    mean = rn_mod.row_sum(x, mean=True)
    assert mean.dtype == dtype and mean.shape == (9,)
    total = rn_mod.row_sum(x)
    inv = torch.tensor(np.float32(1.0) / np.float32(length), device=DEVICE)
    assert same_bits(mean.view(BITS[dtype]), (total * inv).to(dtype).view(BITS[dtype]))
    if ON_GPU:  # what the general path of set_batch_invariant_mode's mean computes
        assert same_bits(mean.view(BITS[dtype]), (total / length).to(dtype).view(BITS[dtype]))
    for rows in (1, 4):
        assert same_bits(rn_mod.row_sum(x[:rows], mean=True), mean[:rows])


# ----------------------------------------------------------------------------- log_softmax


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_softmax_matches_reference_and_is_batch_invariant(dtype, monkeypatch):
    # Small steps and chunks so that both online combinations run: V = 224 is 3.5 chunks of
    # 64 positions, each read in two steps of 32.
    monkeypatch.setattr(ls_mod, "BLOCK", 32)
    monkeypatch.setattr(ls_mod, "CHUNK", 64)
    x = (_randn(11, 224, dtype=torch.float32, seed=18) * 8).to(dtype)
    out = ls_mod.log_softmax(x)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert (out - reference.log_softmax(x)).abs().max().item() < 1e-5
    for rows in (1, 3, 8, 11):
        assert same_bits(ls_mod.log_softmax(x[:rows]), out[:rows])


def test_log_softmax_masked_logits_and_other_dims(monkeypatch):
    monkeypatch.setattr(ls_mod, "BLOCK", 16)
    monkeypatch.setattr(ls_mod, "CHUNK", 32)
    x = _randn(4, 100, dtype=torch.float32, seed=19)
    x[:, :40] = float("-inf")  # whole leading chunks masked out
    out = ls_mod.log_softmax(x)
    assert torch.isneginf(out[:, :40]).all()
    assert torch.allclose(out, torch.log_softmax(x, -1), atol=1e-6)
    x[3] = float("-inf")  # a row of -inf only: NaN, as torch gives
    assert torch.isnan(ls_mod.log_softmax(x)[3]).all() and torch.log_softmax(x, -1)[3].isnan().all()
    y = _randn(6, 5, 3, dtype=torch.float32, seed=20)
    assert torch.allclose(ls_mod.log_softmax(y, dim=1), torch.log_softmax(y, 1), atol=1e-6)
