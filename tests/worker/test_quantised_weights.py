"""GGUF blocks served as they come (`--weights-format quantised`, quantised_weights.py).

1. Loading: every Linear and the tied head of a Q4_1 GGUF read their blocks, under the fp32
   path's fingerprint; blocks that do not dequantise to the loaded weights stop the load; a
   weight update drops the blocks; elsewhere (default mode, bf16, a folder without blocks) the
   fp32 weights serve.
2. Serving, real processes: answers recorded from concurrent requests (greedy and seeded
   sampled, with logprobs) on a quantised worker replay bit for bit, each request alone, on the
   quantised worker and on an fp32 worker of the same GGUF, under one system_fingerprint.
   The kernels' tests hold the negative control (another reduction order is seen).
"""

from __future__ import annotations

import asyncio

import gguf
import httpx
import pytest
import torch

from detgate.contract.compare import compare_choices
from detgate.contract.constants import ADMIN_TOKEN_ENV
from detgate.gateway.responses import record_choices
from detgate.worker.model import quantised_weights
from detgate.worker.model.gguf_checkpoint import convert
from detgate.worker.model.loader import load
from detgate.worker.model.weights import CheckpointError
from tests.support.procs import Proc, detgate_cmd, free_port
from tests.support.weights import TOKEN, update_worker
from tests.worker.test_gguf import LAYERS, write_gguf

T = gguf.GGMLQuantizationType
PROMPTS = ["the the he", "he the", "t h e", "the he the he the", "eh", "the"]


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_gguf(path, T.Q4_1)
    return path


@pytest.fixture(scope="module")
def q4_folder(q4_gguf, tmp_path_factory):
    out = tmp_path_factory.mktemp("folder")
    convert(q4_gguf, out)
    return out


def _load(folder, fmt: str, mode: str = "batch_invariant", dtype: str = "float32"):
    return load(folder, dtype=dtype, device="cpu", mode=mode, weights_format=fmt)


def test_every_matrix_reads_its_blocks(q4_folder):
    quantised, fp32 = _load(q4_folder, "quantised"), _load(q4_folder, "fp32")
    # qkv, o, gate_up, down per layer, and the tied head
    assert quantised.machine["weights"] == f"quantised: {4 * LAYERS + 1} Q4_1"
    assert fp32.machine["weights"] == "fp32"
    assert quantised.fingerprint_parts == fp32.fingerprint_parts
    model = quantised.model
    assert model.quantised_head is not None
    assert all(layer.mlp.down_proj.quantised is not None for layer in model.model.layers)
    hidden = torch.randn(7, model.config.hidden_size)
    with torch.inference_mode():
        logits = model.compute_logits(hidden)
        assert torch.equal(logits.view(torch.int32),
                           fp32.model.compute_logits(hidden).view(torch.int32))
    quantised_weights.detach(model)  # what a weight update does first
    assert model.quantised_head is None and model.model.layers[0].mlp.down_proj.quantised is None


def test_elsewhere_the_fp32_weights_serve(q4_folder, tiny_model):
    assert _load(q4_folder, "quantised", mode="default").machine["weights"] == "fp32"
    assert _load(q4_folder, "quantised", dtype="bfloat16").machine["weights"] == "fp32"
    assert _load(tiny_model, "quantised").machine["weights"] == "fp32"  # no GGUF blocks
    with pytest.raises(ValueError, match="weights_format"):
        _load(q4_folder, "q4")


def test_blocks_that_are_not_the_weights_stop_the_load(q4_gguf, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    out = tmp_path / "hf"
    out.mkdir()
    convert(q4_gguf, out)
    path = out / quantised_weights.QUANTISED_FILE
    with safe_open(str(path), framework="pt") as f:
        types = f.metadata()
    blocks = load_file(path)
    name = "model.layers.1.mlp.up_proj.weight"
    blocks[name][3, 7] ^= 1  # one quant of one block
    save_file(blocks, str(path), metadata=types)
    with pytest.raises(CheckpointError, match="up_proj"):
        _load(out, "quantised")


async def _ask(url: str, i: int, prompt: str) -> dict:
    body = {"model": "m.gguf", "prompt": prompt, "max_tokens": 6, "logprobs": 0,
            "return_token_ids": True, "ignore_eos": True}
    body |= {"temperature": 0} if i % 2 else {"temperature": 1.0, "seed": 100 + i}
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()


async def _concurrently(url: str) -> list[dict]:
    return list(await asyncio.gather(*(_ask(url, i, p) for i, p in enumerate(PROMPTS))))


@pytest.fixture(scope="module")
def workers(q4_gguf, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    procs = {}
    for fmt in ("quantised", "fp32"):
        port = free_port()
        args = detgate_cmd("worker", "--model", str(q4_gguf), "--mode", "batch_invariant",
                           "--weights-format", fmt, "--port", str(port))
        procs[fmt] = Proc(args, f"http://127.0.0.1:{port}", state / f"{fmt}.log",
                          env={"DETGATE_STATE_DIR": str(state),
                               ADMIN_TOKEN_ENV: TOKEN}).start("/health")
    yield {fmt: p.url for fmt, p in procs.items()}
    for p in procs.values():
        p.stop()


def test_a_quantised_record_replays_bit_for_bit(workers):
    for fmt, url in workers.items():
        card = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert card["machine"]["weights"].startswith(fmt), card["machine"]
    recorded = asyncio.run(_concurrently(workers["quantised"]))
    for fmt, url in workers.items():
        for i, (prompt, original) in enumerate(zip(PROMPTS, recorded, strict=True)):
            replay = asyncio.run(_ask(url, i, prompt))
            assert replay["system_fingerprint"] == original["system_fingerprint"], fmt
            comparison = compare_choices(record_choices(False, original),
                                         record_choices(False, replay))
            assert comparison.match, (fmt, i, comparison)


def test_after_a_weight_update_the_fp32_weights_serve_the_same_bits(workers, q4_folder):
    """A weight update drops the blocks (they stand for the old weights): the worker says so
    on /v1/models, and the same weights, now read as fp32, still answer bit for bit."""
    url = workers["quantised"]
    before = asyncio.run(_concurrently(url))
    r = update_worker(url, q4_folder)
    assert r.status_code == 200, r.text
    assert r.json()["system_fingerprint"] == r.json()["previous_fingerprint"]  # same weights
    card = httpx.get(f"{url}/v1/models").json()["data"][0]
    assert card["machine"]["weights"] == "fp32", card["machine"]
    for i, (prompt, original) in enumerate(zip(PROMPTS, before, strict=True)):
        replay = asyncio.run(_ask(url, i, prompt))
        comparison = compare_choices(record_choices(False, original),
                                     record_choices(False, replay))
        assert comparison.match, (i, comparison)
