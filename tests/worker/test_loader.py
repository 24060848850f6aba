"""Loading Hugging Face folders: the demo checkpoint round trip, packing of q/k/v and gate/up,
a sharded Llama checkpoint with Llama-3 RoPE scaling checked against transformers, errors, and
the fingerprint parts."""

from __future__ import annotations

import json
import platform
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from detgate.kernels.bits import same_bits
from detgate.worker.model.config import ModelConfigError
from detgate.worker.model.loader import CheckpointError, load
from tests.worker.paged_forward import BLOCK_SIZE, allocate, make_caches, step


def test_round_trip_of_the_demo_checkpoint(tiny_model):
    lm = load(tiny_model, dtype="float32", device="cpu", mode="default")
    c = lm.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "Qwen3ForCausalLM",
        4,
        8,
        2,
        32,
    )
    assert c.qk_norm and c.tie_word_embeddings and c.vocab_size == lm.tokenizer.vocab_size
    assert c.eos_token_ids == tuple(lm.tokenizer.eos_token_ids)
    stored = load_file(tiny_model / "model.safetensors")
    params = dict(lm.model.named_parameters())
    q, k, v = (stored[f"model.layers.1.self_attn.{n}_proj.weight"] for n in "qkv")
    assert same_bits(params["model.layers.1.self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
    gate, up = (stored[f"model.layers.3.mlp.{n}_proj.weight"] for n in ("gate", "up"))
    assert same_bits(params["model.layers.3.mlp.gate_up_proj.weight"], torch.cat([gate, up]))
    assert same_bits(params["model.norm.weight"], stored["model.norm.weight"])
    assert "lm_head.weight" not in params  # tied to the embedding


def test_bfloat16_load(tiny_model):
    lm = load(tiny_model, dtype="bfloat16", device="cpu", mode="default")
    assert all(p.dtype == torch.bfloat16 for p in lm.model.parameters())
    assert lm.config.dtype == torch.bfloat16


def test_sharded_llama_with_rope_scaling_matches_transformers(tiny_model, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, tie_word_embeddings=False, rope_theta=500000.0,
        # original_max_position_embeddings below the test length: the scaling bends some heads
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ref.save_pretrained(tmp_path, max_shard_size="300KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    shutil.copy(tiny_model / "tokenizer.json", tmp_path)

    lm = load(tmp_path, dtype="float32", device="cpu", mode="default")
    assert lm.config.architecture == "LlamaForCausalLM" and not lm.config.qk_norm
    assert lm.config.rope_scaling is not None and lm.config.rope_scaling.rope_type == "llama3"
    assert_matches_reference(lm, ref, num_tokens=300, seed=3)


def test_missing_and_unknown_tensors_are_errors(tiny_model, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / name, tmp_path)
    tensors = load_file(tiny_model / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "layers.2.mlp.up_proj" not in k},
              tmp_path / "model.safetensors")  # fmt: skip
    with pytest.raises(CheckpointError, match="missing"):
        load(tmp_path, dtype="float32", device="cpu", mode="default")
    save_file(
        {**tensors, "model.layers.0.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors"
    )
    with pytest.raises(CheckpointError, match="no place"):
        load(tmp_path, dtype="float32", device="cpu", mode="default")


def test_unsupported_config_is_an_error(tiny_model, tmp_path):
    shutil.copytree(tiny_model, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(
        json.dumps({**config, "architectures": ["GPT2LMHeadModel"]})
    )
    with pytest.raises(ModelConfigError, match="unsupported architectures"):
        load(tmp_path / "m", dtype="float32", device="cpu", mode="default")


def test_fingerprint_parts(tiny_model, tmp_path):
    a = load(tiny_model, dtype="float32", device="cpu", mode="default").fingerprint_parts
    b = load(tiny_model, dtype="bfloat16", device="cpu", mode="batch_invariant").fingerprint_parts
    expected = {"weights_sha256", "config_sha256", "tokenizer_sha256", "mode", "dtype",
                "device", "sources_sha256", "torch", "libc", "isa_class"}
    assert set(a) >= expected and set(b) >= expected
    # Default mode names the machine (MKL, torch's kernels and their threads change its bits);
    # batch_invariant on x86-64 does not (worker/model/numerics.py).
    machine_parts = {"cpu", "cpu_flags_sha256", "torch_cpu_capability", "torch_threads"}
    assert machine_parts <= set(a)
    assert not machine_parts & set(b) or b["isa_class"] == platform.machine()
    assert (a["mode"], a["dtype"], b["mode"], b["dtype"]) == (
        "default",
        "float32",
        "batch_invariant",
        "bfloat16",
    )
    assert a["weights_sha256"] == b["weights_sha256"]
    # Other weights, other fingerprint.
    shutil.copytree(tiny_model, tmp_path / "m")
    tensors = load_file(tiny_model / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, tmp_path / "m" / "model.safetensors")
    c = load(tmp_path / "m", dtype="float32", device="cpu", mode="default").fingerprint_parts
    assert c["weights_sha256"] != a["weights_sha256"] and c["config_sha256"] == a["config_sha256"]


def test_qwen2_with_biases_and_tied_embeddings_matches_transformers(tiny_model, tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(
        vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # q/k/v biases start at zero: make them count
        for layer in ref.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    ref.save_pretrained(tmp_path)
    shutil.copy(tiny_model / "tokenizer.json", tmp_path)

    lm = load(tmp_path, dtype="float32", device="cpu", mode="default")
    assert lm.config.attention_bias and lm.config.tie_word_embeddings
    assert_matches_reference(lm, ref, num_tokens=100, seed=4)


def assert_matches_reference(lm, ref, *, num_tokens: int, seed: int) -> None:
    """Our paged forward over random tokens gives transformers' logits for the same checkpoint."""
    rng = random.Random(seed)
    ids = [rng.randrange(2048) for _ in range(num_tokens)]
    [seq] = allocate([ids])
    step(lm.model, make_caches(lm.model, -(-num_tokens // BLOCK_SIZE) + 1), [seq], [num_tokens])
    with torch.inference_mode():
        expected = ref(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(seq.logits[0], expected, rtol=1e-4, atol=1e-4)
