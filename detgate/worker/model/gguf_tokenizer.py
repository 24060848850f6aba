"""A GGUF file's tokenizer, rebuilt from its metadata as a `tokenizers` byte-level BPE.

A GGUF carries no tokenizer.json: the vocabulary (`tokenizer.ggml.tokens`), the merges, the
token types and the special ids are metadata, and `tokenizer.ggml.pre` names the pre-tokenizer
llama.cpp applies before BPE. The split for each name is llama.cpp's (llama-vocab.cpp), so that
prompt token ids are the ones the model was trained on: for `smollm` that includes splitting
every digit apart, as SmolLM2's own tokenizer.json does.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from detgate.worker.model.config import ModelConfigError

# llama_token_type values of `tokenizer.ggml.token_type`
CONTROL = 3
USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> how text is split before BPE
_GPT2 = "gpt2"  # GPT-2's regex (ByteLevel's own)
_DIGITS_GPT2 = "digits+gpt2"  # every digit apart, then GPT-2's regex
PRE_TOKENIZERS: dict[str, str] = {
    "default": _GPT2, "gpt2": _GPT2, "mpt": _GPT2, "olmo": _GPT2,
    "smollm": _DIGITS_GPT2, "starcoder": _DIGITS_GPT2, "refact": _DIGITS_GPT2,
    "command-r": _DIGITS_GPT2, "codeshell": _DIGITS_GPT2, "exaone": _DIGITS_GPT2,
    "minerva-7b": _DIGITS_GPT2,
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@dataclass(frozen=True)
class GGUFTokenizer:
    tokenizer: Tokenizer
    bos_token: str | None
    eos_token: str | None
    bos_token_id: int | None
    # Ids that end a sequence: EOS, end-of-turn / end-of-message, and `<|im_end|>` where the
    # chat template closes turns with it.
    eos_token_ids: tuple[int, ...]
    chat_template: str | None
    add_bos_token: bool


def build_tokenizer(meta: dict) -> GGUFTokenizer:
    """`meta`: the file's metadata as plain Python values (see gguf_checkpoint.read_metadata)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelConfigError(
            f"unsupported GGUF tokenizer model {kind!r} (supported: 'gpt2', byte-level BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        supported = ", ".join(sorted(PRE_TOKENIZERS))
        raise ModelConfigError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: {supported})")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(PRE_TOKENIZERS[pre])
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|endoftext|>) and user-defined ones (<think>) are matched
    # whole in the text, as llama.cpp does, instead of being cut into byte pieces.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types, strict=True) if kind == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED])

    def token(key: str) -> tuple[int | None, str | None]:
        i = meta.get(f"tokenizer.ggml.{key}")
        return (None, None) if i is None or not 0 <= i < len(tokens) else (int(i), tokens[i])

    bos_id, bos = token("bos_token_id")
    eos_id, eos = token("eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    template = meta.get("tokenizer.chat_template")
    stops = {i for i in (eos_id, token("eot_token_id")[0], token("eom_token_id")[0])
             if i is not None}
    im_end = tok.token_to_id("<|im_end|>")
    if template and "<|im_end|>" in template and im_end is not None:
        stops.add(im_end)
    return GGUFTokenizer(tok, bos, eos, bos_id, tuple(sorted(stops)), template, add_bos)


def _pre_tokenizer(split: str):
    if split == _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == _DIGITS_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
