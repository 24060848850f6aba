"""Request fields that would change an answer but that the built-in worker does not implement,
and the one message that refuses them (the gateway refuses unknown fields the same way).

Each field comes with the values that mean "off": clients send `"presence_penalty": 0` or
`"logit_bias": {}` by default, and those are served. A request is refused once, naming every
field it holds with another value, so that a client (instructor sends two at a time) sees
all it must change.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

_OFF: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "suffix": ("",),
    "prediction": (),
    "audio": (),
    "modalities": (["text"],),
    "web_search_options": (),
    # vLLM's sampling extensions
    "repetition_penalty": (1, 1.0),
    "min_p": (0, 0.0),
    "best_of": (1,),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "logits_processors": (),
    "truncate_prompt_tokens": (),
    "prompt_embeds": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "structured_outputs": (),
    "spaces_between_special_tokens": (True,),
    "add_special_tokens": (),
    "continue_final_message": (False,),
    "add_generation_prompt": (True,),
    "chat_template": (),
    "chat_template_kwargs": (),
    "return_tokens_as_token_ids": (False,),
    "vllm_xargs": (),
}
UNSUPPORTED = frozenset(_OFF)


def unsupported_fields(body: dict[str, Any]) -> list[str]:
    """The fields of `body` set to something the worker cannot honour, in body order."""
    return [k for k, v in body.items()
            if k in _OFF and v is not None and not _is_off(v, _OFF[k])]


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    # bool is an int: `True` must not pass for `1`.
    return any(type(value) is type(o) and value == o
               or (type(o) in (int, float) and type(value) in (int, float) and value == o)
               for o in off)


def refusal(names: Iterable[str], why: str) -> str:
    """One message naming every refused parameter."""
    names = list(names)
    quoted = ", ".join(f"'{n}'" for n in names)
    noun = "parameter" if len(names) == 1 else "parameters"
    return f"unsupported {noun} {quoted} ({why})"


def unsupported_message(body: dict[str, Any]) -> str | None:
    names = unsupported_fields(body)
    if not names:
        return None
    return refusal(names, "this worker does not implement them; leave them out or at their "
                          "neutral values")
