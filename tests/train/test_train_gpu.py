"""The trainer on CUDA in bf16 (skipped without CUDA): its logprobs are the batch_invariant
engine's, bit for bit, with the engine as it serves on a GPU (decode and mixed steps replayed
from CUDA graphs, asynchronous scheduling, the fused q/k norm + rotary + K/V store, Triton
paged attention) under chunked prefill, prefix-cache hits and preemption; on the tiny model
and on a model as wide as Qwen3-8B (two layers, random weights), where a default-mode engine
(cuBLAS, whose kernel follows the batch's row count) must differ (negative control).

    pytest -m gpu tests/train/test_train_gpu.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from detgate.train import Policy
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.engine import Engine
from detgate.worker.model.loader import load
from detgate.worker.tools.make_model import PRESETS
from detgate.worker.tools.random_model import load_random
from tests.train.test_train_grads import model_grads
from tests.train.test_train_logprobs import BUSY, differences, sample

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

WIDE = dataclasses.replace(PRESETS["qwen3-8b-shape"], num_layers=2)


def cuda_engine(loaded, folder, mode: str) -> Engine:
    config = EngineConfig(model=str(folder), mode=mode, device="cuda", dtype="bfloat16",
                          **BUSY)
    return Engine(config, loaded.model, loaded.config)


def test_tiny_trainer_is_the_sampled_bits_on_cuda(tiny_model):
    loaded = load(tiny_model, dtype="bfloat16", device="cuda", mode="batch_invariant")
    run = sample(cuda_engine(loaded, tiny_model, "batch_invariant"))
    policy = Policy.from_pretrained(tiny_model, dtype="bfloat16", device="cuda")
    found = differences(policy, run)
    assert len(found) == 8 and not any(found.values()), found


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """The Qwen3-8B-wide policy (fp32 masters drawn on the GPU) and its folder."""
    folder = tmp_path_factory.mktemp("qwen3-wide")
    loaded = load_random(WIDE, folder, seed=0, device="cuda", mode="batch_invariant",
                         dtype="float32")
    return Policy(loaded, folder, dtype="bfloat16"), folder


@pytest.mark.parametrize("mode", ["batch_invariant", "default"])
def test_qwen3_wide_trainer_is_the_sampled_bits_on_cuda(wide, mode):
    """The engine draws the same weights in bf16 (the masters' rounding); batch_invariant:
    every token equal; default: some differ."""
    policy, folder = wide
    loaded = load_random(WIDE, folder, seed=0, device="cuda", mode=mode, dtype="bfloat16")
    run = sample(cuda_engine(loaded, folder, mode))
    del loaded
    torch.cuda.empty_cache()
    found = differences(policy, run)
    if mode == "batch_invariant":
        assert not any(found.values()), found
    else:
        assert sum(found.values()) > 0


def test_cuda_gradients_match_float64_autograd(tiny_model):
    """As on the CPU (tests/train/test_train_grads.py), with the Triton forward."""
    policy = Policy.from_pretrained(tiny_model, dtype="bfloat16", device="cuda")
    asked = [[5 + i for i in range(17)], [300, 7, 9]]
    completions = [[11, 12, 13, 14], [20, 21]]
    ours = model_grads(policy, asked, completions)
    plain = model_grads(policy.with_mode("default"), asked, completions)
    want = model_grads(policy.with_mode("default", torch.float64), asked, completions)
    for name, g in ours.items():
        err = float((g.double() - want[name]).norm() / want[name].norm())
        plain_err = float((plain[name].double() - want[name]).norm() / want[name].norm())
        assert err < max(1e-4, 1.5 * plain_err), (name, err, plain_err)
