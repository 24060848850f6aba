"""The worker's tokenizer: a Hugging Face tokenizer.json plus the chat template of
tokenizer_config.json, rendered in a sandboxed Jinja environment as transformers does."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import tokenizers
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template rejected them)."""


class Tokenizer:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None,
        eos_token_ids: Iterable[int],
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = _compile(chat_template) if chat_template else None
        self.special_token_ids = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_folder(cls, folder: Path, extra_eos_ids: Iterable[int] = ()) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ eos ids of generation_config.json)."""
        folder = Path(folder)
        tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        cfg = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        eos_ids = set(extra_eos_ids) | set(_as_ids(gen.get("eos_token_id")))
        if eos is not None and tok.token_to_id(eos) is not None:
            eos_ids.add(tok.token_to_id(eos))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # several named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        return cls(tok, template, eos_ids, bos, eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Text rendered by the chat template already holds its special
        tokens: encode it with add_special_tokens=False (or use encode_chat)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt, **kwargs),
            add_special_tokens=False,
        )

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # Ids past the tokenizer's vocabulary (a model's padded vocab rows) decode to nothing.
        return self._tok.decode(
            [i for i in ids if 0 <= i < self.vocab_size], skip_special_tokens=skip_special_tokens
        )

    def id_to_piece(self, token_id: int) -> str:
        """The token as the vocabulary spells it (ByteLevel's byte alphabet, `▁`, `<0x0A>`)."""
        return self._tok.id_to_token(token_id) or ""

    @property
    def decoder_kind(self) -> str:
        """How vocabulary pieces become bytes: "ByteLevel", "ByteFallback" or "" (as text)."""
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        return next((k for k in ("ByteLevel", "ByteFallback") if k in kinds), "")

    def max_token_chars(self) -> int:
        """The most characters any one token's text has (special tokens included)."""
        texts = self._tok.decode_batch([[i] for i in range(self.vocab_size)],
                                       skip_special_tokens=False)
        return max(map(len, texts), default=1)

    def id_to_token(self, token_id: int) -> str:
        """The text of one token as shown in logprobs (bytes of an incomplete UTF-8 character
        come out as U+FFFD, as in vLLM)."""
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except (TemplateError, TypeError, ValueError, LookupError, AttributeError) as exc:
            # The template runs on client data: a message it cannot handle (content None, a
            # missing key) is a bad request, whatever Python error the template hit.
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


def _compile(source: str):
    # Same environment and helpers as transformers' chat templates; the sandbox keeps a
    # checkpoint's template from reaching Python internals.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _raise_exception(message: str):
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _token_text(token: str | dict[str, Any] | None) -> str | None:
    """tokenizer_config.json writes special tokens either as text or as AddedToken dicts."""
    return token.get("content") if isinstance(token, dict) else token


def _as_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [int(value)]
