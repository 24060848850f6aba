"""The verifiable tasks of `detgate rl`: problems drawn from a seeded generator (a run's prompts
are a function of its seed), each with a reward checkable without a model.

- `arithmetic` (the default): single-digit arithmetic. The prompt is a few-shot text ("Q: What
  is 2 + 2?\\nA: 4\\n...Q: What is 7 + 5?\\nA:") and an answer earns 1.0 when its first integer
  is 12, else 0.0. SmolLM2-135M gets some right from the start (about one in six at
  temperature 1), so a group's rewards differ and the policy gradient has a signal; asked as
  a chat question it answers in prose first and earns nothing.
- `words`: "Write exactly N words", 1.0 when the answer has N words. Even random weights (the
  `tiny` test model) earn it now and then, so the loop trains, and pushes weights, on them.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_INTEGER = re.compile(r"-?\d+")
EXAMPLES = "Q: What is 2 + 2?\nA: 4\nQ: What is 5 * 3?\nA: 15\nQ: What is 8 - 6?\nA: 2\n"


@dataclass(frozen=True)
class Arithmetic:
    a: int
    op: str
    b: int

    @property
    def prompt(self) -> str:
        return f"{EXAMPLES}Q: What is {self.a} {self.op} {self.b}?\nA:"

    def reward(self, text: str) -> float:
        """1.0 when the answer's first integer is the right one, else 0.0."""
        found = _INTEGER.search(text)
        answer = OPERATIONS[self.op](self.a, self.b)
        return 1.0 if found is not None and int(found.group()) == answer else 0.0


@dataclass(frozen=True)
class Words:
    n: int

    @property
    def prompt(self) -> str:
        return f"Write exactly {self.n} words.\n"

    def reward(self, text: str) -> float:
        return 1.0 if len(text.split()) == self.n else 0.0


Problem = Arithmetic | Words


def arithmetic(rng: random.Random) -> Arithmetic:
    return Arithmetic(rng.randint(0, 9), rng.choice(tuple(OPERATIONS)), rng.randint(0, 9))


def words(rng: random.Random) -> Words:
    return Words(rng.randint(1, 3))


TASKS: dict[str, Callable[[random.Random], Problem]] = {"arithmetic": arithmetic,
                                                         "words": words}


def problems(task: str, seed: int, count: int) -> list[Problem]:
    """`count` problems of `task`, the same for the same seed."""
    rng = random.Random(seed)
    return [TASKS[task](rng) for _ in range(count)]


def group_advantages(rewards: list[float]) -> list[float]:
    """GRPO's group-relative advantage: each reward minus the group's mean, divided by the
    group's standard deviation (population), 0 for every member when all rewards are equal
    (such a group carries no signal)."""
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5
    return [0.0 if std == 0 else (r - mean) / std for r in rewards]
