"""Grammars over a tokenizer's vocabulary, compiled by xgrammar (pinned: its masks are part of
what a record's numbers depend on, so its version is in the worker's fingerprint).

Why xgrammar: it is vLLM's and SGLang's default backend (a request means the same to our
workers as to a vLLM worker behind the same gateway), `compile_json_schema` has OpenAI's
strict semantics, structural tags cover tool calls inside free text, and its masks were
deterministic in every test (fresh processes, threads, refills); fills take 2-12 us over
SmolLM2's 49,152 tokens and compiles 7-10 ms, cached. llguidance was as fast and is
dependency-free, but means writing each tool_choice grammar ourselves.

Special tokens other than the stop tokens are blanked in the vocabulary: xgrammar would
otherwise read `<|im_start|>` as literal text and allow it inside a JSON string. JSON is
written with fixed separators (`any_whitespace=False`), so a weak model cannot spend its
tokens on whitespace.
"""

from __future__ import annotations

import importlib.metadata
import json
import threading
from dataclasses import dataclass
from typing import Any

from detgate.worker.model.tokenizer import Tokenizer


def library_version() -> str:
    """The grammar library's version, for the fingerprint."""
    try:
        return "xgrammar " + importlib.metadata.version("xgrammar")
    except importlib.metadata.PackageNotFoundError:
        return "none"

# Bounds on what a client can make the compiler do (a schema is client data).
MAX_GRAMMAR_BYTES = 64 << 10


class GrammarError(ValueError):
    """The schema or tag cannot be compiled (the client's 400)."""


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A compiled grammar; `matcher()` starts a sequence's state (engine.constraint)."""

    compiled: Any

    def matcher(self):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compiled)


class GrammarCompiler:
    """One per worker: xgrammar's tokenizer info and compiler (which caches compiled
    grammars), built on first use (importing xgrammar takes seconds)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the logits' width (may exceed the tokenizer's)
        self._compiler = None
        self._lock = threading.Lock()

    def json_schema(self, schema: dict[str, Any]) -> CompiledGrammar:
        text = _bounded(schema)
        return self._compile(lambda c: c.compile_json_schema(text, any_whitespace=False))

    def structural_tag(self, tag: dict[str, Any]) -> CompiledGrammar:
        text = _bounded(tag)
        return self._compile(lambda c: c.compile_structural_tag(text))

    def _compile(self, build) -> CompiledGrammar:
        compiler = self._get()
        try:
            return CompiledGrammar(build(compiler))
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors for bad input
            raise GrammarError(str(exc).splitlines()[0][:300]) from None

    def _get(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                tok = self._tokenizer
                stop = list(tok.eos_token_ids)
                vocab = [tok.id_to_piece(i) for i in range(tok.vocab_size)]
                special = tok.special_token_ids
                vocab = ["" if (i in special and i not in stop) else v
                         for i, v in enumerate(vocab)]
                info = xgr.TokenizerInfo(vocab, _vocab_type(tok), vocab_size=self._vocab_size,
                                         stop_token_ids=stop)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler


def _vocab_type(tok: Tokenizer):
    import xgrammar as xgr

    kind = tok.decoder_kind
    if kind == "ByteLevel":
        return xgr.VocabType.BYTE_LEVEL
    if kind == "ByteFallback":
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def _bounded(obj: dict[str, Any]) -> str:
    text = json.dumps(obj)
    if len(text) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"the schema is over {MAX_GRAMMAR_BYTES} bytes")
    return text
