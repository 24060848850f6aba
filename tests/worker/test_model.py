"""The decoder run directly over a paged KV cache: shapes, agreement with transformers, and the
batch-invariance claims bit for bit (each with its default-mode negative control)."""

from __future__ import annotations

import random

import pytest
import torch

from detgate.kernels.bits import same_bits
from detgate.worker.model.loader import load
from tests.worker.paged_forward import allocate, make_caches, step

_MODELS: dict[tuple[str, str], object] = {}


@pytest.fixture
def get_model(tiny_model):
    def get(mode: str, dtype: str = "float32"):
        key = (mode, dtype)
        if key not in _MODELS:
            _MODELS[key] = load(tiny_model, dtype=dtype, device="cpu", mode=mode).model
        return _MODELS[key]

    return get


def _random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]  # 0-2 are the special tokens


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forward_shapes_and_dtypes(get_model, dtype):
    model = get_model("default", dtype)
    c = model.config
    seqs = allocate([[5, 6, 7], [8] * 20, [9]])
    hidden = step(model, make_caches(model, 8), seqs, [3, 20, 1])
    assert hidden.shape == (24, c.hidden_size) and hidden.dtype == getattr(torch, dtype)
    logits = model.compute_logits(hidden[[2, 22, 23]])
    assert logits.shape == (3, c.vocab_size) and logits.dtype == getattr(torch, dtype)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("mode", ["default", "batch_invariant"])
def test_matches_transformers_qwen3(get_model, tiny_model, mode):
    """Same checkpoint, same logits as the reference implementation (to float tolerance)."""
    transformers = pytest.importorskip("transformers")
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = _random_ids(random.Random(1), 50, ref_model.config.vocab_size)
    model = get_model(mode)
    [seq] = allocate([ids])
    step(model, make_caches(model, 4), [seq], [50])
    with torch.inference_mode():
        ref = ref_model(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(seq.logits[0], ref, rtol=1e-4, atol=1e-4)


def _needle_runs(model, needle: list[int], fillers: list[list[int]], at: int, prompt_len: int):
    """The needle's per-step hidden and logits, alone and at index `at` among the fillers.

    Step 1 prefills every prompt (the needle's first `prompt_len` tokens, each filler's first
    half); the next steps decode one token per sequence, teacher-forced from the given ids.
    """
    decode_steps = len(needle) - prompt_len
    alone = allocate([needle])
    caches = make_caches(model, 64)
    step(model, caches, alone, [prompt_len])
    for _ in range(decode_steps):
        step(model, caches, alone, [1])

    together = allocate(fillers[:at] + [needle] + fillers[at:])
    counts = (
        [len(f) // 2 for f in fillers[:at]] + [prompt_len] + [len(f) // 2 for f in fillers[at:]]
    )
    caches = make_caches(model, 256)
    step(model, caches, together, counts)
    for _ in range(decode_steps):
        step(model, caches, together, [1] * len(together))
    return alone[0], together[at]


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(same_bits(x, y) for x, y in zip(a, b, strict=True))


NEEDLE_PROMPTS = [1, 2, 3, 7, 21]


def _needle_differences(model) -> list[int]:
    """Prompt lengths whose needle did NOT come out bitwise identical alone vs in the batch."""
    rng = random.Random(0)
    vocab = model.config.vocab_size
    fillers = [_random_ids(rng, rng.randrange(10, 120), vocab) for _ in range(12)]
    differing = []
    for prompt_len in NEEDLE_PROMPTS:
        needle = _random_ids(rng, prompt_len + 3, vocab)
        alone, together = _needle_runs(model, needle, fillers, rng.randrange(13), prompt_len)
        hidden_same = _same_bits(alone.hidden, together.hidden)
        logits_same = _same_bits(alone.logits, together.logits)
        if not (hidden_same and logits_same):
            differing.append(prompt_len)
    return differing


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_needle_in_batch_is_bitwise_identical(get_model, dtype):
    assert _needle_differences(get_model("batch_invariant", dtype)) == []


def test_needle_in_batch_differs_in_default_mode(get_model):
    """Negative control: the same workload with plain torch ops shows differences."""
    assert _needle_differences(get_model("default")) != []


# Ways to compute the same 40 tokens: at once, prefill then decode token by token, chunked
# across block boundaries (block size 16) and at them.
SCHEDULES = [[40], [7] + [1] * 33, [16, 5, 19], [30, 10]]


def _schedule_runs(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = _random_ids(random.Random(2), 40, model.config.vocab_size)
    runs = []
    for counts in SCHEDULES:
        seqs = allocate([ids])
        caches = make_caches(model, 4)
        for n in counts:
            step(model, caches, seqs, [n])
        runs.append((torch.cat(seqs[0].hidden), torch.cat(seqs[0].logits)))
    return runs


def test_prefill_chunking_and_decode_are_bitwise_identical(get_model):
    runs = _schedule_runs(get_model("batch_invariant"))
    hidden0, logits0 = runs[0]
    for counts, (hidden, logits) in zip(SCHEDULES, runs, strict=True):
        assert same_bits(hidden, hidden0), counts
        assert same_bits(logits, logits0), counts


def test_prefill_chunking_and_decode_differ_in_default_mode(get_model):
    """Negative control, which also checks the default path's paged-cache attention is right
    (the schedules agree to float tolerance)."""
    runs = _schedule_runs(get_model("default"))
    hidden0, logits0 = runs[0]
    for _, logits in runs[1:]:
        torch.testing.assert_close(logits, logits0, rtol=1e-4, atol=1e-4)
    assert any(not same_bits(hidden, hidden0) for hidden, _ in runs[1:])
