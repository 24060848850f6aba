"""A GGUF file (Llama, Qwen2, Qwen3) turned into the Hugging Face style folder the loader reads.

`convert(gguf_path, out)` writes config.json, generation_config.json, tokenizer.json,
tokenizer_config.json (with the chat template) and safetensors shards. Reading and
dequantisation are the `gguf` library's; this module only maps llama.cpp's names back to
Hugging Face's and undoes the one layout change llama.cpp's converter makes: for `llama` it
permutes the rows of q and k (and their biases) from the two-halves RoPE layout to interleaved
pairs. Quantised tensors are stored dequantised as float32, exactly (F16 / BF16 stay as they are);
the loader rounds once more to the serving dtype. The Q8_0 / Q4_0 / Q4_1 tensors are also kept
as they come, their blocks untouched (QUANTISED_FILE: uint8 [rows, row bytes] under the Hugging
Face name, the ggml type in the file's metadata), for the CPU matmul that reads them in place
(worker/model/quantised_weights.py); llama's q/k rows are unpermuted there too, whole rows of
blocks moved, no byte changed.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from detgate.worker.model.config import ModelConfigError
from detgate.worker.model.gguf_tokenizer import GGUFTokenizer, build_tokenizer
from detgate.worker.model.quantised_weights import QUANTISED_FILE

# general.architecture -> the Hugging Face class the decoder implements
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
T = gguf.GGMLQuantizationType
TENSOR_TYPES = (T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1)
# Tensors stored in these types keep their dtype in the folder; the rest become float32.
_NATIVE = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
SHARD_BYTES = 2 << 30

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def read_metadata(reader: gguf.GGUFReader) -> dict[str, Any]:
    """Every key-value field as plain Python (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def architecture(meta: dict[str, Any]) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelConfigError(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")
    return arch


def hf_config(meta: dict[str, Any], tensor_names: set[str], tok: GGUFTokenizer) -> dict[str, Any]:
    """config.json of the model the metadata describes (the keys worker.model.config reads)."""
    arch = architecture(meta)
    key = lambda name, default=None: meta.get(f"{arch}.{name}", default)  # noqa: E731
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise ModelConfigError("partial rotary embeddings (rope.dimension_count < head dim) "
                               "are not supported")
    if "rope_freqs.weight" in tensor_names:
        raise ModelConfigError("per-frequency RoPE factors (rope_freqs.weight) are not supported")
    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ModelConfigError(f"unsupported GGUF rope scaling {scaling!r} (supported: linear)")
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(key("vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": ({"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
                         if scaling == "linear" else None),
        "max_position_embeddings": int(key("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": list(tok.eos_token_ids),
        "torch_dtype": "float32",
    }


def hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER.fullmatch(name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ModelConfigError(f"GGUF tensor {name!r} has no place in the model")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def tensors(reader: gguf.GGUFReader, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every tensor of the file, dequantised by `gguf`."""
    for t in reader.tensors:
        if t.tensor_type not in TENSOR_TYPES:
            raise ModelConfigError(
                f"GGUF tensor {t.name} has unsupported type {t.tensor_type.name} "
                f"(supported: {', '.join(q.name for q in TENSOR_TYPES)})")
        name = hf_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        layer = _LAYER.fullmatch(t.name)
        if config["model_type"] == "llama" and layer and layer.group(2) in ("attn_q", "attn_k"):
            heads = config["num_attention_heads" if layer.group(2) == "attn_q"
                           else "num_key_value_heads"]
            values = unpermute_rope_rows(values, heads)
        dtype = _NATIVE.get(t.tensor_type, torch.float32)
        # A copy: F32 data is a read-only view of the memory-mapped file.
        yield name, torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype)


_QUANTISED = (T.Q8_0, T.Q4_0, T.Q4_1)


def quantised_tensors(reader: gguf.GGUFReader,
                      config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor, str]]:
    """(Hugging Face name, blocks uint8 [rows, row bytes], ggml type name) for every tensor
    stored as Q8_0, Q4_0 or Q4_1."""
    for t in reader.tensors:
        if t.tensor_type not in _QUANTISED:
            continue
        blocks = np.asarray(t.data).reshape(int(t.shape[-1]), -1)  # one row of blocks a row
        layer = _LAYER.fullmatch(t.name)
        if config["model_type"] == "llama" and layer and layer.group(2) in ("attn_q", "attn_k"):
            heads = config["num_attention_heads" if layer.group(2) == "attn_q"
                           else "num_key_value_heads"]
            blocks = unpermute_rope_rows(blocks, heads)
        yield hf_name(t.name), torch.from_numpy(np.array(blocks, dtype=np.uint8)), \
            t.tensor_type.name


def unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of q/k rows: per head, [pairs, 2] back to [2, pairs]."""
    pairs = w.shape[0] // heads // 2
    return w.reshape(heads, pairs, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert(path: Path, out: Path, progress: Callable[[int, int], None] | None = None) -> None:
    """Write `path`'s model into the folder `out` (which must exist and be empty)."""
    reader = gguf.GGUFReader(str(path))
    meta = read_metadata(reader)
    tok = build_tokenizer(meta)
    config = hf_config(meta, {t.name for t in reader.tensors}, tok)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_token_id, "eos_token_id": list(tok.eos_token_ids)}) + "\n")
    tok.tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
        "eos_token": tok.eos_token, "add_bos_token": tok.add_bos_token,
        "chat_template": tok.chat_template, "model_max_length": config["max_position_embeddings"],
    }, indent=2) + "\n")
    _write_shards(tensors(reader, config), len(reader.tensors), out, progress)
    blocks, types = {}, {}
    for name, tensor, qtype in quantised_tensors(reader, config):
        blocks[name], types[name] = tensor, qtype
    if blocks:
        save_file(blocks, str(out / QUANTISED_FILE), metadata=types)


def _write_shards(items: Iterator[tuple[str, torch.Tensor]], total: int, out: Path,
                  progress: Callable[[int, int], None] | None) -> None:
    """Shards of at most SHARD_BYTES, so that a large model is never all in memory at once."""
    shard: dict[str, torch.Tensor] = {}
    files: list[str] = []
    weight_map: dict[str, int] = {}

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        files.append(name)
        shard.clear()

    for done, (name, tensor) in enumerate(items, 1):
        if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > SHARD_BYTES:
            flush()
        shard[name] = tensor
        weight_map[name] = len(files)
        if progress:
            progress(done, total)
    flush()
    if len(files) == 1:
        (out / files[0]).rename(out / "model.safetensors")
        return
    index = {"metadata": {}, "weight_map": {n: files[i] for n, i in sorted(weight_map.items())}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def progress_line(label: str) -> Callable[[int, int], None]:
    """A progress callback: one stderr line, rewritten in place on a terminal; elsewhere (a log
    file) a line now and a line when done."""
    start = time.monotonic()
    tty = sys.stderr.isatty()
    print(f"{label} ...", file=sys.stderr, flush=True)

    def show(done: int, total: int) -> None:
        if tty or done == total:
            print(f"\r{label}: {done}/{total} tensors ({time.monotonic() - start:.1f} s)",
                  end="\n" if done == total else "", file=sys.stderr, flush=True)

    return show
