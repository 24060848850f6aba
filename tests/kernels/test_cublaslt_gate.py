"""Which calls kernels/cublaslt.py even considers (CPU: the gate runs before any CUDA call).

A row count below MIN_ROWS, a dtype cuBLASLt is not asked for, or a check whose operands would
pass VERIFY_MAX_BYTES must leave the call to the Triton kernel without recording anything for
the shape; the GPU tests (test_gpu_cublaslt.py) check what is served."""

from __future__ import annotations

import pytest
import torch

from detgate.kernels import cublaslt


@pytest.fixture()
def gate(monkeypatch):
    monkeypatch.setattr(cublaslt, "ENABLED", True)
    monkeypatch.setattr(cublaslt, "_SHAPES", {})
    monkeypatch.setattr(cublaslt, "MIN_ROWS", 129)  # the default, whatever the environment
    return cublaslt


def _never(x, w):
    raise AssertionError("the reference must not run for a gated-out call")


@pytest.mark.parametrize("m,dtype", [(1, torch.bfloat16), (128, torch.bfloat16),
                                     (512, torch.float32)])
def test_small_row_counts_and_fp32_stay_on_triton(gate, m, dtype):
    w = torch.zeros(64, 32, dtype=dtype)
    assert gate.gemm_for(w, m, _never) is None
    assert not gate._SHAPES


def test_a_check_past_its_memory_cap_is_not_made(gate, monkeypatch):
    n, k, m = 64, 32, 256
    monkeypatch.setattr(gate, "VERIFY_MAX_BYTES", m * (k + 2 * n) * 2 - 1)
    assert gate.gemm_for(torch.zeros(n, k, dtype=torch.bfloat16), m, _never) is None
    assert not gate._SHAPES


def test_switched_off_it_serves_nothing(gate, monkeypatch):
    monkeypatch.setattr(gate, "ENABLED", False)
    assert gate.gemm_for(torch.zeros(64, 32, dtype=torch.bfloat16), 4096, _never) is None
    assert not gate._SHAPES
