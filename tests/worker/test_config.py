"""EngineConfig.from_args: scheduler limits a worker takes when its flags leave them unset."""

from __future__ import annotations

import argparse

import pytest
import torch

from detgate.worker.cli import add_engine_args
from detgate.worker.engine.config import EngineConfig, cuda_batch_limits

GIB = 2**30


def config(*argv: str) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return EngineConfig.from_args(parser.parse_args(list(argv)))


@pytest.mark.parametrize("memory, name, seqs, tokens", [
    (139.8 * GIB, "NVIDIA H200", 1024, 8192),
    (79.1 * GIB, "NVIDIA H100 80GB HBM3", 1024, 8192),
    (191.5 * GIB, "AMD Instinct MI300X", 1024, 8192),
    (79.2 * GIB, "NVIDIA A100-SXM4-80GB", 256, 2048),  # vLLM keeps A100s at the small limits
    (47.5 * GIB, "NVIDIA L40S", 256, 2048),
    (23.6 * GIB, "NVIDIA GeForce RTX 4090", 256, 2048),
])
def test_cuda_limits_follow_vllm_server_defaults(memory, name, seqs, tokens):
    assert cuda_batch_limits(int(memory), name) == {"max_num_seqs": seqs,
                                                     "max_num_batched_tokens": tokens}


def test_cpu_keeps_the_engine_defaults_and_flags_win():
    assert (config().max_num_seqs, config().max_num_batched_tokens) == (64, 2048)
    given = config("--max-num-seqs", "8", "--max-num-batched-tokens", "512")
    assert (given.max_num_seqs, given.max_num_batched_tokens) == (8, 512)


def test_a_worker_warms_up_unless_told_not_to():
    assert config().warm_up is True
    assert config("--no-warm-up").warm_up is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_worker_takes_its_cards_limits_unless_flags_say():
    card = torch.cuda.get_device_properties(0)
    want = cuda_batch_limits(card.total_memory, card.name)
    got = config("--device", "cuda")
    assert {"max_num_seqs": got.max_num_seqs,
            "max_num_batched_tokens": got.max_num_batched_tokens} == want
    assert config("--device", "cuda", "--max-num-seqs", "32").max_num_seqs == 32
