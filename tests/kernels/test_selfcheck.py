"""The startup self-check: passes on the kernels, names the op, shape and dtype of a failure,
and a batch_invariant worker refuses to start when its model's check fails."""

from __future__ import annotations

import pytest
import torch

from detgate import kernels
from detgate.kernels import selfcheck
from tests.kernels.test_cpu_invariance import split_k_matmul


def test_same_bits_tells_signed_zeros_and_keeps_nans():
    assert not selfcheck.same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert selfcheck.same_bits(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert selfcheck.same_bits(torch.tensor([1.5], dtype=torch.bfloat16),
                               torch.tensor([1.5], dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernels_pass_on_a_models_shapes(dtype):
    gen = torch.Generator().manual_seed(0)
    linears = {"qkv_proj": torch.randn(960, 576, generator=gen).to(dtype),
               "gate_up_proj": torch.randn(3072, 576, generator=gen).to(dtype),
               "lm_head": torch.randn(49152, 576, generator=gen).to(dtype)}
    checks = selfcheck.model_checks(linears, hidden=576, head_dim=64, vocab=49152)
    assert {c.op for c in checks} == {"matmul", "silu_and_mul", "rms_norm", "log_softmax"}
    assert selfcheck.run(checks, dtype, torch.device("cpu"), attention=(9, 3, 64)) >= 0


def test_a_failure_names_op_shape_and_dtype():
    w = torch.randn(67, 576, generator=torch.Generator().manual_seed(1))
    control = selfcheck.Check("matmul", "control K=576 N=67", 576,
                              lambda x: split_k_matmul(x, w))
    with pytest.raises(selfcheck.SelfCheckError, match=r"matmul \(control K=576 N=67, float32\)"
                       r": \d+ rows at offset 0 differ"):
        selfcheck.run([control], torch.float32, torch.device("cpu"))


def test_worker_check_refuses_a_model_whose_kernels_are_not_invariant(tiny_model, monkeypatch):
    """The worker's check on the tiny model passes, and fails (naming the CPU) once a split-K
    matmul stands in for the kernel: a fault no real worker can produce on demand."""
    from detgate.worker.model.invariance_check import check
    from detgate.worker.model.loader import load

    loaded = load(tiny_model, dtype="float32", device="cpu", mode="batch_invariant")
    assert check(loaded) >= 0
    monkeypatch.setattr(kernels, "matmul", lambda a, b, bias=None: split_k_matmul(a, b.t()))
    with pytest.raises(selfcheck.SelfCheckError, match="self-check failed on .*matmul"):
        check(loaded)


def test_no_compiler_says_what_to_install(monkeypatch):
    from detgate.kernels import cpu_ext

    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(cpu_ext.shutil, "which", lambda name: None)
    with pytest.raises(cpu_ext.BuildError, match="needs a C.. compiler.*apt-get install g\\+\\+"):
        cpu_ext._load.__wrapped__("native")
