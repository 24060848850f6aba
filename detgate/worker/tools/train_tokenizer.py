"""Train the demo model's byte-level BPE tokenizer from the English text shipped in worker/data.

Training is deterministic (same tokenizers version -> same tokenizer.json bytes), so a
checkpoint made twice is the same checkpoint.
"""

from __future__ import annotations

from importlib import resources

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus_text() -> str:
    return resources.files("detgate.worker.data").joinpath("corpus.txt").read_text(encoding="utf-8")


def chat_template() -> str:
    return (
        resources.files("detgate.worker.data").joinpath("chat_template.jinja").read_text(encoding="utf-8")
    )


def train_bpe(vocab_size: int) -> Tokenizer:
    """A GPT-2 style byte-level BPE: every byte has a token, so any text round-trips.

    Special tokens take ids 0..2; then the 256 byte tokens; then merges, up to `vocab_size`
    (fewer if the corpus runs out of pairs seen at all).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text().splitlines(), trainer=trainer)
    return tok
