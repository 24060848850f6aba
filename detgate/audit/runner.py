"""Sends the N audited requests while varying the load around them.

The first request goes alone (a batch of one, and a probe of which optional fields the
endpoint accepts); the others go C at a time, each slot refilled as soon as it frees, so
requests join the server's batches mid-flight. `mix` background loops send other prompts
of random lengths and random output lengths meanwhile, so batch composition keeps changing.
Everything stops at the deadline or when `stop` is set (Ctrl-C): what finished is kept.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from detgate.audit.client import AuditRequestError, EndpointClient, RequestSpec
from detgate.audit.sample import Sample

MIX_WORDS = (
    "the", "river", "light", "stone", "garden", "winter", "market", "engine", "paper", "quiet",
    "north", "signal", "window", "harbor", "letter", "orange", "silver", "mountain", "ladder",
    "theory", "music", "island", "forest", "bridge", "candle", "number", "season", "doctor",
    "planet", "language", "history", "animal", "circle", "method", "village",
)
MIX_MAX_PROMPT_WORDS = 48
MIX_ERROR_PAUSE_S = 0.1


@dataclass(frozen=True)
class LoadPlan:
    n: int
    concurrency: int
    mix: int
    seed: int


@dataclass
class Collected:
    samples: list[Sample] = field(default_factory=list)
    errors: list[tuple[int, str]] = field(default_factory=list)
    mix_done: int = 0
    mix_errors: int = 0
    outcome: str = "complete"  # complete | interrupted | timeout

    @property
    def failed(self) -> int:
        return len(self.errors)


Progress = Callable[[Collected], None]


async def wait_or_stop(work: Awaitable, stop: asyncio.Event, timeout: float) -> str:
    """Run `work` until done, `stop` set or `timeout` (s): 'complete', 'interrupted' or 'timeout'.

    Unfinished work is cancelled and awaited, so no request outlives the call.
    """
    task = asyncio.ensure_future(work)
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({task, stopper}, timeout=max(0.0, timeout),
                                 return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if task in done:
        task.result()
        return "complete"
    task.cancel()
    await asyncio.gather(task, stopper, return_exceptions=True)
    return "interrupted" if stop.is_set() else "timeout"


def mix_spec(rng: random.Random, audited: RequestSpec) -> RequestSpec:
    words = rng.randint(1, MIX_MAX_PROMPT_WORDS)
    return RequestSpec(
        prompt=" ".join(rng.choice(MIX_WORDS) for _ in range(words)),
        max_tokens=rng.randint(1, max(1, audited.max_tokens)),
        temperature=audited.temperature,
        seed=rng.randrange(2**31) if audited.temperature > 0 else None,
    )


async def collect(client: EndpointClient, spec: RequestSpec, plan: LoadPlan,
                  stop: asyncio.Event, progress: Progress) -> Collected:
    out = Collected()

    async def one(index: int) -> None:
        try:
            out.samples.append(await client.complete(spec, index))
        except AuditRequestError as exc:
            out.errors.append((index, str(exc)))
        progress(out)

    async def mix_loop(rng: random.Random) -> None:
        while True:
            try:
                await client.complete(mix_spec(rng, spec), -1)
                out.mix_done += 1
            except AuditRequestError:
                out.mix_errors += 1
                await asyncio.sleep(MIX_ERROR_PAUSE_S)
            progress(out)

    indices = iter(range(1, plan.n))

    async def slot() -> None:
        # The iterator is shared: each index is taken by exactly one slot.
        for index in indices:
            await one(index)

    async def rest() -> None:
        await asyncio.gather(*(slot() for _ in range(plan.concurrency)))

    out.outcome = await wait_or_stop(one(0), stop, client.deadline.remaining())
    if out.outcome != "complete" or not out.samples:
        return out
    mixers = [asyncio.create_task(mix_loop(random.Random(plan.seed * 1000 + k)))
              for k in range(plan.mix)]
    try:
        out.outcome = await wait_or_stop(rest(), stop, client.deadline.remaining())
    finally:
        for task in mixers:
            task.cancel()
        await asyncio.gather(*mixers, return_exceptions=True)
    out.samples.sort(key=lambda s: s.index)
    return out
