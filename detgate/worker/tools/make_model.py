"""`detgate make-model`: write a Hugging Face style checkpoint with random weights from a seed.

Presets:
- `tiny`: a 4-layer Qwen3-style model (hidden 256, 8 q / 2 kv heads of 32, tied embeddings)
  with a real byte-level BPE tokenizer trained from worker/data/corpus.txt; the demo and test model.
- `qwen3-8b-shape`: the real Qwen3-8B configuration in bfloat16 (8.2B parameters, ~16 GB),
  written shard by shard. Its tokenizer is the tiny one with the vocabulary padded to the
  model's 151,936 rows: each padding id is a BPE vocabulary entry that no merge produces, so
  encoding never yields it, and it decodes to a made-up word so random completions stay readable.

Every tensor is drawn from its own generator seeded by (seed, tensor name): the files depend only
on the preset and the seed, never on write order, and are identical across runs and machines.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from detgate.worker.tools.train_tokenizer import SPECIAL_TOKENS, chat_template, train_bpe

# Std of the logits at initialisation: wide enough that greedy decoding wanders across the
# vocabulary and logprobs sit well away from uniform, narrow enough that it is not one-hot.
LOGIT_STD = 3.0
# Gain of the projections that write into the residual stream. With tied embeddings, a layer
# output not much larger than the input embedding leaves the last token's own embedding
# dominant and greedy decoding repeats it; at 10x (measured over seeds and prompts) greedy runs
# of 60 tokens hold 25-40 distinct tokens.
RESIDUAL_GAIN = 10.0


@dataclass(frozen=True)
class Preset:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int | None  # None: the trained tokenizer's size
    tokenizer_vocab: int
    max_position_embeddings: int
    rope_theta: float
    tie_word_embeddings: bool
    dtype: str
    shard_bytes: int


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        "tiny",
        hidden_size=256,
        intermediate_size=768,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        vocab_size=None,
        tokenizer_vocab=2048,
        max_position_embeddings=2048,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        dtype="float32",
        shard_bytes=1 << 30,
    ),
    "qwen3-8b-shape": Preset(
        "qwen3-8b-shape",
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        tokenizer_vocab=2048,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
        dtype="bfloat16",
        shard_bytes=4 << 30,
    ),
}


def main(args) -> int:
    if args.preset not in PRESETS:
        raise SystemExit(f"unknown preset {args.preset!r}; choose one of: {', '.join(PRESETS)}")
    out = Path(args.out) if args.out else default_folder(args.preset, args.seed)
    make_model(args.preset, out, args.seed)
    print(out)
    return 0


def default_folder(preset: str, seed: int = 0) -> Path:
    from detgate.contract.paths import state_dir

    return state_dir() / "models" / f"{preset}-seed{seed}"


def make_model(preset_name: str, out: Path, seed: int) -> None:
    preset = PRESETS[preset_name]
    out.mkdir(parents=True, exist_ok=True)
    vocab_size, eos_ids = write_tokenizer(out, preset)
    _write_json(out / "config.json", hf_config(preset, vocab_size, eos_ids[0]))
    _write_weights(out, preset, vocab_size, seed)


def write_tokenizer(out: Path, preset: Preset) -> tuple[int, list[int]]:
    """tokenizer.json, tokenizer_config.json and generation_config.json; returns the model's
    vocabulary size and its eos ids (<|im_end|> first)."""
    tokenizer = train_bpe(preset.tokenizer_vocab)
    vocab_size = preset.vocab_size or tokenizer.get_vocab_size()
    tokenizer_json = _pad_vocab(json.loads(tokenizer.to_str()), vocab_size)
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False, indent=1))
    eos_ids = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "additional_special_tokens": SPECIAL_TOKENS[1:],
            "model_max_length": preset.max_position_embeddings,
            "chat_template": chat_template(),
        },
    )
    _write_json(out / "generation_config.json", {"eos_token_id": eos_ids})
    return vocab_size, eos_ids


def hf_config(p: Preset, vocab_size: int, eos_id: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": p.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": p.tie_word_embeddings,
        "torch_dtype": p.dtype,
        "bos_token_id": None,
        "eos_token_id": eos_id,
    }


@dataclass(frozen=True)
class CheckpointTensor:
    name: str
    shape: tuple[int, ...]
    std: float  # 0: a norm weight, drawn around 1


def checkpoint_tensors(p: Preset, vocab_size: int) -> Iterator[CheckpointTensor]:
    """The checkpoint's tensors under their Hugging Face names, in file order."""
    h, d = p.hidden_size, p.head_dim
    yield CheckpointTensor("model.embed_tokens.weight", (vocab_size, h), LOGIT_STD / math.sqrt(h))
    for i in range(p.num_layers):
        pre = f"model.layers.{i}"
        yield CheckpointTensor(f"{pre}.input_layernorm.weight", (h,), 0.0)
        yield CheckpointTensor(
            f"{pre}.self_attn.q_proj.weight", (p.num_heads * d, h), 1 / math.sqrt(h)
        )
        yield CheckpointTensor(
            f"{pre}.self_attn.k_proj.weight", (p.num_kv_heads * d, h), 1 / math.sqrt(h)
        )
        yield CheckpointTensor(
            f"{pre}.self_attn.v_proj.weight", (p.num_kv_heads * d, h), 1 / math.sqrt(h)
        )
        yield CheckpointTensor(f"{pre}.self_attn.q_norm.weight", (d,), 0.0)
        yield CheckpointTensor(f"{pre}.self_attn.k_norm.weight", (d,), 0.0)
        yield CheckpointTensor(
            f"{pre}.self_attn.o_proj.weight",
            (h, p.num_heads * d),
            RESIDUAL_GAIN / math.sqrt(p.num_heads * d),
        )
        yield CheckpointTensor(f"{pre}.post_attention_layernorm.weight", (h,), 0.0)
        yield CheckpointTensor(
            f"{pre}.mlp.gate_proj.weight", (p.intermediate_size, h), 1 / math.sqrt(h)
        )
        yield CheckpointTensor(
            f"{pre}.mlp.up_proj.weight", (p.intermediate_size, h), 1 / math.sqrt(h)
        )
        yield CheckpointTensor(
            f"{pre}.mlp.down_proj.weight",
            (h, p.intermediate_size),
            RESIDUAL_GAIN / math.sqrt(p.intermediate_size),
        )
    yield CheckpointTensor("model.norm.weight", (h,), 0.0)
    if not p.tie_word_embeddings:
        yield CheckpointTensor("lm_head.weight", (vocab_size, h), LOGIT_STD / math.sqrt(h))


# Random draws are split into blocks of rows of about this many values, each from its own
# generator, so big tensors are drawn by all cores at once and the bytes still depend only on
# (seed, tensor name, block index).
_DRAW_BLOCK = 1 << 24


def _draw(
    t: CheckpointTensor, seed: int, dtype: torch.dtype, pool: ThreadPoolExecutor
) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=dtype)
    rows = out.view(t.shape[0], -1)
    step = max(1, _DRAW_BLOCK // rows.shape[1])

    def fill(block: int) -> None:
        digest = hashlib.sha256(f"{seed}:{t.name}:{block}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        dest = rows[block * step : (block + 1) * step]
        values = torch.randn(dest.shape, generator=gen, dtype=torch.float32)
        dest.copy_(1.0 + 0.1 * values if t.std == 0.0 else values * t.std)

    list(pool.map(fill, range(-(-rows.shape[0] // step))))
    return out


def _write_weights(out: Path, p: Preset, vocab_size: int, seed: int) -> None:
    """One file for small models; shards of at most `shard_bytes` plus an index otherwise.
    Only one shard is in memory at a time."""
    dtype = getattr(torch, p.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    tensors_list = list(checkpoint_tensors(p, vocab_size))
    shards: list[list[CheckpointTensor]] = [[]]
    size = 0
    for t in tensors_list:
        nbytes = math.prod(t.shape) * itemsize
        if shards[-1] and size + nbytes > p.shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        for fname, shard in zip(names, shards, strict=True):
            tensors = {t.name: _draw(t, seed, dtype, pool) for t in shard}
            save_file(tensors, out / fname, {"format": "pt"})
            del tensors
    if len(shards) > 1:
        total = sum(math.prod(t.shape) * itemsize for t in tensors_list)
        weight_map = {
            t.name: fname for fname, shard in zip(names, shards, strict=True) for t in shard
        }
        _write_json(
            out / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )


_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


def _pad_vocab(tokenizer_json: dict, vocab_size: int) -> dict:
    """Give ids past the trained vocabulary a BPE entry each (no merge produces them)."""
    vocab: dict[str, int] = tokenizer_json["model"]["vocab"]
    n_taken = 1 + max([*vocab.values(), *(t["id"] for t in tokenizer_json["added_tokens"])])
    syllables = [c + v for c in _CONSONANTS for v in _VOWELS]
    next_word = 0
    for token_id in range(n_taken, vocab_size):
        while True:  # three syllables: 343,000 words, skipping any the corpus already made
            a, rest = divmod(next_word, len(syllables) ** 2)
            b, c = divmod(rest, len(syllables))
            word = "Ġ" + syllables[a] + syllables[b] + syllables[c]
            next_word += 1
            if word not in vocab:
                break
        vocab[word] = token_id
    return tokenizer_json


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
