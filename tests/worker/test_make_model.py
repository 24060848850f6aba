"""`detgate make-model`: byte-identical files from the same seed, sharded writing, the presets'
shapes, the padded tokenizer of qwen3-8b-shape, and a random model that still says something."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from detgate.kernels.bits import same_bits
from detgate.worker.model.loader import load
from detgate.worker.model.tokenizer import Tokenizer
from detgate.worker.tools import make_model as mm
from detgate.worker.tools.train_tokenizer import corpus_text
from tests.worker.paged_forward import allocate, make_caches, step


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_same_seed_same_bytes(tiny_model, tmp_path):
    mm.make_model("tiny", tmp_path / "a", seed=0)
    assert _files(tmp_path / "a") == _files(tiny_model)  # the fixture ran the CLI, seed 0
    mm.make_model("tiny", tmp_path / "b", seed=1)
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a["model.safetensors"] != b["model.safetensors"]
    assert {k: v for k, v in a.items() if k != "model.safetensors"} == {
        k: v for k, v in b.items() if k != "model.safetensors"
    }


def test_sharded_write_loads_the_same_weights(tiny_model, tmp_path, monkeypatch):
    small = dataclasses.replace(mm.PRESETS["tiny"], shard_bytes=2 << 20)
    monkeypatch.setitem(mm.PRESETS, "tiny", small)
    mm.make_model("tiny", tmp_path, seed=0)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3 and not (tmp_path / "model.safetensors").exists()
    sharded = load(tmp_path, dtype="float32", device="cpu", mode="default").model.state_dict()
    single = load(tiny_model, dtype="float32", device="cpu", mode="default").model.state_dict()
    assert sharded.keys() == single.keys()
    assert all(same_bits(sharded[k], single[k]) for k in single)


def test_qwen3_8b_shape_is_the_real_configuration():
    p = mm.PRESETS["qwen3-8b-shape"]
    config = mm.hf_config(p, 151936, 2)
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size",
                                   "vocab_size", "rope_theta", "tie_word_embeddings",
                                   "max_position_embeddings", "torch_dtype")} == {
        "hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 12288,
        "vocab_size": 151936, "rope_theta": 1e6, "tie_word_embeddings": False,
        "max_position_embeddings": 40960, "torch_dtype": "bfloat16",
    }  # fmt: skip
    # Qwen3-8B's published parameter count.
    assert sum(math.prod(t.shape) for t in mm.checkpoint_tensors(p, 151936)) == 8_190_735_360


def test_qwen3_8b_shape_tokenizer_is_padded_to_the_vocabulary(tmp_path):
    vocab_size, eos_ids = mm.write_tokenizer(tmp_path, mm.PRESETS["qwen3-8b-shape"])
    tok = Tokenizer.from_folder(tmp_path)
    assert vocab_size == tok.vocab_size == 151936
    trained = mm.PRESETS["qwen3-8b-shape"].tokenizer_vocab
    assert max(tok.encode(corpus_text())) < trained  # padding is never encoded
    words = [tok.id_to_token(i) for i in range(trained, vocab_size, 997)]
    assert all(w.startswith(" ") and len(w) == 7 for w in words) and len(set(words)) == len(words)
    assert tok.decode(tok.encode("the river")) == "the river"


def test_resolve_model_makes_a_preset_once(tmp_path, monkeypatch):
    from detgate.worker.tools.model_source import resolve_model

    monkeypatch.setenv("DETGATE_STATE_DIR", str(tmp_path))
    folder = resolve_model("tiny")
    assert folder.parent == tmp_path / "models" and (folder / "config.json").exists()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert resolve_model(str(folder)) == folder
    assert [p.name for p in (tmp_path / "models").iterdir()] == [folder.name]  # no leftovers
    with pytest.raises(FileNotFoundError):
        resolve_model("no-such-model")


def test_random_weights_decode_varied_tokens_with_peaked_logprobs(tiny_model):
    """Greedy decoding wanders over many tokens, and logprobs are far from uniform."""
    lm = load(tiny_model, dtype="float32", device="cpu", mode="default")
    ids = lm.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the lighthouse."}])
    [seq] = allocate([ids + [0] * 40])
    caches = make_caches(lm.model, 8)
    step(lm.model, caches, [seq], [len(ids)])
    chosen = []
    for _ in range(40):
        logprobs = lm.model.ops.log_softmax(seq.logits[-1][-1:])[0]
        token = int(logprobs.argmax())
        chosen.append((token, float(logprobs[token])))
        seq.token_ids[seq.cached] = token
        step(lm.model, caches, [seq], [1])
    tokens = [t for t, _ in chosen]
    mean_logprob = sum(lp for _, lp in chosen) / len(chosen)
    assert len(set(tokens)) >= 15
    assert -4.0 < mean_logprob < -0.3 and math.log(1 / lm.config.vocab_size) < -7
