"""The demo model's tokenizer: byte-level round trips, special tokens, the sandboxed chat
template, and agreement with transformers on the same files."""

from __future__ import annotations

import pytest

from detgate.worker.model.tokenizer import ChatTemplateError, Tokenizer

MESSAGES = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Tell me about the river."},
]
RENDERED = (
    "<|im_start|>system\nYou are brief.<|im_end|>\n"
    "<|im_start|>user\nTell me about the river.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def tok(tiny_model) -> Tokenizer:
    return Tokenizer.from_folder(tiny_model)


@pytest.mark.parametrize(
    "text",
    ["The river and the town.", "naïve café, 日本語, emoji 🙂\n\ttabs  and  spaces", "", " x"],
)
def test_any_text_round_trips(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_bpe_learned_english(tok):
    """The merges come from the shipped English corpus: common words are single tokens."""
    ids = tok.encode("The river and the bridge")
    assert len(ids) == 5
    assert tok.id_to_token(ids[1]) == " river"
    assert 2000 <= tok.vocab_size <= 4096


def test_special_tokens_and_eos(tok):
    im_start, im_end, eot = (tok.encode(t) for t in ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    assert len(im_start) == len(im_end) == len(eot) == 1
    assert tok.eos_token_ids == sorted(im_end + eot)
    ids = tok.encode("hello<|im_end|>")
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, skip_special_tokens=False) == "hello<|im_end|>"


def test_ids_past_the_vocabulary_decode_to_nothing(tok):
    assert tok.decode([tok.vocab_size, tok.vocab_size + 7]) == ""
    assert tok.id_to_token(tok.vocab_size) == ""


def test_chat_template(tok):
    assert tok.apply_chat_template(MESSAGES) == RENDERED
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == RENDERED.removesuffix(
        "<|im_start|>assistant\n"
    )
    assert tok.encode_chat(MESSAGES) == tok.encode(RENDERED, add_special_tokens=False)


def test_chat_template_rejects_unknown_roles(tok):
    with pytest.raises(ChatTemplateError, match="unsupported role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("message", [{"role": "user", "content": None}, {"content": "no role"}])
def test_malformed_messages_are_template_errors(tok, message):
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template([message])


def test_chat_template_is_sandboxed(tiny_model, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tiny_model / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"}'
    )
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_folder(tmp_path).apply_chat_template(MESSAGES)


def test_no_template(tiny_model, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((tiny_model / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.eos_token_ids == []
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)


def test_agrees_with_transformers(tok, tiny_model):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(tiny_model)
    text = "The lighthouse keeper climbed 112 steps. Ünïcode too!"
    assert tok.encode(text) == ref.encode(text)
    assert tok.apply_chat_template(MESSAGES) == ref.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
