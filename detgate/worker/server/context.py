"""The long-lived objects every endpoint needs, built once in the app's lifespan."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from detgate.worker.engine import constraint, sampler
from detgate.worker.engine.async_engine import AsyncEngine
from detgate.worker.engine.config import EngineConfig
from detgate.worker.errors import InvalidRequest
from detgate.worker.model import grammar
from detgate.worker.model.grammar import GrammarCompiler
from detgate.worker.model.tokenizer import Tokenizer
from detgate.worker.server import structured
from detgate.worker.server.abort import Aborts


@dataclass
class ServingContext:
    """The long-lived objects every handler needs (built in the app's lifespan)."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    config: EngineConfig
    model_name: str
    model_aliases: frozenset[str]
    grammar: GrammarCompiler
    eos_token_ids: tuple[int, ...]
    # What the fingerprint hashes (the loader's parts), and the fingerprint of the weights that
    # sequences submitted now run on: it changes with a weight update (server/admin.py).
    fingerprint_parts: dict[str, str]
    # The machine (CPU, threads, versions), reported beside the fingerprint on /v1/models.
    machine: dict[str, str | int]
    # Most characters one token adds to a text (+1 for a tokenizer's leading-space rules):
    # the gateway bounds a text prompt's tokens from below by chars / this.
    max_token_chars: int
    fingerprint: str = ""
    # Seconds one engine step may take before /health reports the worker stuck.
    stall_timeout_s: float = 60.0
    created: int = field(default_factory=lambda: int(time.time()))
    aborts: Aborts = field(default_factory=Aborts)
    _token_text: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fingerprint = self.fingerprint or system_fingerprint(self.fingerprint_parts)

    def use_weights(self, weights_sha256: str) -> str:
        """Name new weights in the fingerprint of what is submitted from now on; returns it."""
        self.fingerprint_parts = {**self.fingerprint_parts, "weights_sha256": weights_sha256}
        self.fingerprint = system_fingerprint(self.fingerprint_parts)
        if "weights" in self.machine:  # the update serves its fp32 parameters, not GGUF blocks
            self.machine = {**self.machine, "weights": "fp32"}
        return self.fingerprint

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


def numerics(parts: dict[str, str]) -> dict[str, str]:
    """Everything that can change the numbers: the loader's parts (weights, config, mode,
    dtype, device kind, the kernels' and model's sources, versions; the machine only where it
    changes bits: worker/model/numerics.py), the sampler's and the token masks' sources and
    the grammar library's version (its masks decide which tokens a structured answer may
    take)."""
    sources = {f"{m.__name__.rpartition('.')[2]}_sha256":
               hashlib.sha256(Path(m.__file__).read_bytes()).hexdigest()
               for m in (sampler, constraint, grammar, structured)}
    return {**parts, **sources, "grammar_library": grammar.library_version()}


def system_fingerprint(parts: dict[str, str]) -> str:
    """A hash of `numerics(parts)`."""
    digest = hashlib.sha256(json.dumps(numerics(parts), sort_keys=True).encode()).hexdigest()
    return f"fp_{digest[:16]}"
