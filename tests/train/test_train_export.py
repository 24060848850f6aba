"""The mixed-precision rule end to end: fp32 masters, the forward in the serving dtype, and the
exported weights are what a worker loads, so that after an optimizer step a worker on the
saved folder samples with the trainer's logprobs, bit for bit."""

from __future__ import annotations

import asyncio

import httpx
import torch
from safetensors import safe_open

from detgate.kernels.selfcheck import same_bits
from detgate.train import Policy
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.engine import Engine
from detgate.worker.model.loader import load, weight_files
from tests.support.floats import bits
from tests.train.conftest import as_fp32, prompts, run_engine


def checkpoint(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            out |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    return out


def test_serving_state_dict_is_the_checkpoint(tiny_model, policies):
    """Names, shapes and values of the checkpoint's tensors (fp32); in bf16 each rounded as
    the worker's loader rounds it."""
    ckpt = checkpoint(tiny_model)
    for dtype in ("float32", "bfloat16"):
        served = policies(dtype).serving_state_dict()
        assert sorted(served) == sorted(ckpt)  # tied: no lm_head in either
        for name, tensor in ckpt.items():
            assert same_bits(served[name], tensor.to(getattr(torch, dtype))), (dtype, name)
    worker = load(tiny_model, dtype="bfloat16", device="cpu", mode="batch_invariant").model
    served = policies("bfloat16").serving_parameters()  # the Policy's names: model.<worker's>
    for name, param in worker.named_parameters():
        assert same_bits(served[f"model.{name}"].detach(), param.detach()), name
    assert all(p.dtype == torch.float32 for p in policies("bfloat16").parameters())


def adam_step(policy: Policy, asked: list[list[int]], completions: list[list[int]]) -> None:
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    loss = -sum(lp.sum() for lp in policy.completion_logprobs(asked, completions))
    loss.backward()
    optimizer.step()


def test_after_an_optimizer_step_a_worker_on_the_saved_weights_samples_the_trainer_bits(
        tiny_model, tmp_path):
    policy = Policy.from_pretrained(tiny_model, dtype="bfloat16")
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    adam_step(policy, prompts(3, seed=40, lo=3, hi=20), prompts(3, seed=41, lo=2, hi=8))
    changed = [n for n, p in policy.named_parameters() if not same_bits(p.detach(), before[n])]
    assert len(changed) == len(before)  # every master moved, and stayed fp32
    assert all(p.dtype == torch.float32 for p in policy.parameters())

    folder = policy.save_pretrained(tmp_path / "step-1")
    loaded = load(folder, dtype="bfloat16", device="cpu", mode="batch_invariant")
    served = policy.serving_parameters()
    for name, param in loaded.model.named_parameters():
        assert same_bits(param.detach(), served[f"model.{name}"].detach()), name

    engine = Engine(EngineConfig(model=str(folder), mode="batch_invariant", dtype="bfloat16",
                                 chunk_size=7), loaded.model, loaded.config)
    asked = prompts(4, seed=42, lo=3, hi=30)
    run = run_engine(engine, [{str(i): p for i, p in enumerate(asked)}], max_tokens=8)
    samples = [run.samples[str(i)] for i in range(len(asked))]
    trained = policy.completion_logprobs(asked, [s.token_ids for s in samples])
    for lp, s in zip(trained, samples, strict=True):
        assert same_bits(lp.detach(), as_fp32(s.logprobs))

    # Negative control: the weights before the step give other logprobs for those tokens.
    old = Policy.from_pretrained(tiny_model, dtype="bfloat16")
    stale = old.completion_logprobs(asked, [s.token_ids for s in samples])
    assert not all(same_bits(a.detach(), b.detach()) for a, b in zip(stale, trained, strict=True))


def test_a_worker_process_serves_the_saved_folder(tiny_model, tmp_path, start_worker):
    """`detgate worker --model FOLDER` (config, tokenizer and weights from save_pretrained):
    its /v1/score of a sequence is the trainer's, after an update, in bf16."""
    policy = Policy.from_pretrained(tiny_model, dtype="bfloat16")
    adam_step(policy, prompts(2, seed=50, lo=3, hi=20), prompts(2, seed=51, lo=2, hi=8))
    folder = policy.save_pretrained(tmp_path / "step-1")
    proc = start_worker("batch_invariant", extra=("--model", str(folder), "--dtype", "bfloat16"))
    ids = prompts(1, seed=52, lo=30, hi=31)[0]

    async def score() -> list[float]:
        async with httpx.AsyncClient(timeout=120) as client:
            r = await client.post(f"{proc.url}/v1/score", json={
                "model": "step-1", "token_ids": ids, "start": 1})
            assert r.status_code == 200, r.text
            return r.json()["logprobs"]

    want = asyncio.run(score())
    got = policy.token_logprobs(torch.tensor(ids), cu_seqlens=[0, len(ids)])[1:]
    assert bits(got.tolist()) == bits(want)
