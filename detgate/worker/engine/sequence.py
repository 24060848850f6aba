"""A request's state inside the engine. Sequences only hold state; the scheduler and the block
manager change it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

from detgate.worker.engine.constraint import Constraint, ConstraintState

# Below this temperature a request is greedy (argmax), as in vLLM.
GREEDY_EPS = 1e-5
# The token id of a token sampled on the device whose id the host does not know yet
# (asynchronous scheduling: the next step reads it from the device).
PENDING = -1


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None
    # None: no logprobs; k >= 0: the chosen token's logprob plus the k most likely tokens.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Prefill the whole prompt in one step, never from the prefix cache (the /v1/score path).
    single_pass: bool = False
    # Masks on the generated tokens (a grammar, min_tokens); see constraint.py. For a scored
    # sequence (single_pass), the prompt tokens from `score_start` on are scored under it, as
    # if they had been generated from there.
    constraint: Constraint | None = None
    score_start: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(slots=True)
class TokenLogprob:
    """One token with its logprob (None when not asked for), top alternatives, and rank."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    rank: int | None = None


@dataclass(eq=False, slots=True)
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V sit in the cache (prefix hits included). Preemption resets it to 0.
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at the last admission (reported in usage).
    num_cached_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Hash of each full block of token_ids, in order; stable because tokens are only appended.
    block_hashes: list[int] = field(default_factory=list)
    # Leading blocks of block_table already published to the prefix cache.
    num_registered_blocks: int = 0
    # Per-request random generator (a torch.Generator), created by the sampler from params.seed.
    generator: object | None = None
    # The mask state over this sequence's own generated tokens (None: unconstrained).
    constraint: ConstraintState | None = None
    # prompt_logprobs[i] is for prompt token i + 1 (token 0 has no context).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        if self.params.constraint is not None:
            self.constraint = self.params.constraint.state()

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        """Leading tokens whose ids the host knows: all but the PENDING ones, which are the
        last one or two (a step in flight samples each, asynchronous scheduling)."""
        n = len(self.token_ids)
        while n and self.token_ids[n - 1] == PENDING:
            n -= 1
        return n

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
