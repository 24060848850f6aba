"""The long-lived objects every endpoint needs, built once in the app's lifespan."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from worker.engine.config import EngineConfig
from worker.engine.engine import AsyncEngine
from worker.errors import InvalidRequest
from worker.model.tokenizer import Tokenizer


@dataclass
class ServingContext:
    """The long-lived objects every handler needs (built in the app's lifespan)."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    config: EngineConfig
    model_name: str
    model_aliases: frozenset[str]
    fingerprint: str
    created: int = field(default_factory=lambda: int(time.time()))
    _token_text: dict[int, str] = field(default_factory=dict)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, name: str) -> None:
        if name not in self.model_aliases:
            raise InvalidRequest(f"model {name!r} does not exist; this worker serves "
                                 f"{self.model_name!r}", param="model", code="model_not_found")

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.id_to_token(token_id)
        return text
