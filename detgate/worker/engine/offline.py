"""An Engine driven in process: request mixes, a driver with varying arrivals, and the
determinism measures of what came out (the engine experiment, detgate/bench/engine_gpu.py, and
the engine tests use them).

A workload is a list of requests (token ids + sampling params) and an arrival rule: how many
queued requests join the engine before each step. Varying arrivals make every request of
interest run in batches of changing size and composition, as behind a busy server.
"""

from __future__ import annotations

import collections
import random
import time
from dataclasses import dataclass, field

from detgate.contract.analysis import Answer, TeacherTotals, analyse, compare_to_teacher
from detgate.worker.engine.engine import Engine
from detgate.worker.engine.sequence import SamplingParams

# Requests joining before a step, drawn uniformly: bursts and lulls around the needles.
ARRIVALS = (0, 0, 0, 1, 1, 2, 4, 8, 16, 32)


@dataclass
class Request:
    request_id: str
    token_ids: list[int]
    params: SamplingParams


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)  # sequences in each step it ran in
    prompt_logprobs: list[float] = field(default_factory=list)


@dataclass
class RunStats:
    seconds: float
    steps: int
    generated_tokens: int
    prompt_tokens: int
    decode_only_steps: int
    decode_only_seconds: float  # engine time in decode-only steps (CUDA graphs when on)
    mean_batch_size: float
    max_batch_size: int
    mixed_seconds: float = 0.0  # engine time in the other steps (prefill chunks among them)
    wait_seconds: float = 0.0  # of the engine time, waiting for the device's results (CUDA)
    cached_prompt_tokens: int = 0  # found in the prefix cache at each request's last admission
    preemptions: int = 0


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    # Ids well inside the vocabulary, away from the special tokens at the start.
    return [rng.randrange(100, min(vocab_size, 100_000)) for _ in range(length)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)


def determinism_workload(*, needles: int, fillers: int, prompt_len: int, needle_tokens: int,
                         filler_prompt: tuple[int, int], filler_tokens: tuple[int, int],
                         vocab_size: int, seed: int) -> list[Request]:
    """`needles` copies of one prompt at temperature 0 among `fillers` random requests of
    random lengths, in a seeded random order."""
    rng = random.Random(seed)
    needle = random_prompt(rng, prompt_len, vocab_size)
    reqs = [Request(f"needle-{i}", list(needle), greedy(needle_tokens)) for i in range(needles)]
    for i in range(fillers):
        prompt = random_prompt(rng, rng.randint(*filler_prompt), vocab_size)
        reqs.append(Request(f"filler-{i}", prompt, greedy(rng.randint(*filler_tokens))))
    rng.shuffle(reqs)
    return reqs


def cost_workload(*, requests: int, prompt: tuple[int, int], output: tuple[int, int],
                  vocab_size: int, seed: int) -> list[Request]:
    """The source's cost workload: output lengths drawn in [90, 110] (EOS ignored)."""
    rng = random.Random(seed)
    return [Request(f"req-{i}", random_prompt(rng, rng.randint(*prompt), vocab_size),
                    greedy(rng.randint(*output))) for i in range(requests)]


def run(engine: Engine, reqs: list[Request], arrival_seed: int | None,
        trace: list[tuple[int, int, float]] | None = None
        ) -> tuple[dict[str, Completion], RunStats]:
    """Run every request to completion. arrival_seed None: all join at once; else a seeded
    number (ARRIVALS) joins before each step. `trace` gets (tokens, sequences, seconds) per
    step."""
    rng = random.Random(arrival_seed)
    queue = collections.deque(reqs)
    out = {r.request_id: Completion() for r in reqs}
    steps = decode_only = seqs_total = max_seqs = generated = 0
    decode_seconds = mixed_seconds = wait_seconds = 0.0
    cached = preemptions = 0
    start = time.perf_counter()
    while queue or engine.has_work():
        joining = len(queue) if arrival_seed is None else rng.choice(ARRIVALS)
        if not engine.has_work():
            joining = max(joining, 1)
        for _ in range(min(joining, len(queue))):
            r = queue.popleft()
            engine.add(r.request_id, r.token_ids, r.params)
        outputs, stats = engine.step()
        steps += 1
        if trace is not None:
            trace.append((stats.num_tokens, stats.num_seqs, stats.seconds))
        if stats.num_tokens == stats.num_seqs:
            decode_only += 1
            decode_seconds += stats.seconds
        else:
            mixed_seconds += stats.seconds
        wait_seconds += stats.wait_seconds
        seqs_total += stats.num_seqs
        max_seqs = max(max_seqs, stats.num_seqs)
        generated += stats.num_generated
        preemptions += stats.num_preempted
        for o in outputs:
            c = out[o.request_id]
            if o.finished:
                cached += o.num_cached_tokens
            c.token_ids += [t.token_id for t in o.new_tokens]
            c.logprobs += [t.logprob for t in o.new_tokens]
            c.batch_sizes.append(stats.num_seqs)
            if o.prompt_logprobs is not None:
                c.prompt_logprobs = [t.logprob for t in o.prompt_logprobs]
    seconds = time.perf_counter() - start
    prompt_tokens = sum(len(r.token_ids) for r in reqs)
    return out, RunStats(seconds, steps, generated, prompt_tokens, decode_only, decode_seconds,
                         seqs_total / max(steps, 1), max_seqs, mixed_seconds, wait_seconds,
                         cached, preemptions)


def determinism_measures(completions: list[Completion]) -> dict:
    """The contract's analysis of the completions (`detgate.contract.analysis.analyse`: unique
    completions by token ids and by ids + logprob bits, first divergences and logprob
    differences against the most common exact variant of the most common completion), plus
    the batch sizes the completions ran in."""
    a = analyse([Answer(i, token_ids=tuple(c.token_ids), logprobs=tuple(c.logprobs))
                 for i, c in enumerate(completions)])
    sizes = sorted({b for c in completions for b in c.batch_sizes})
    return {
        "n": a.n,
        "unique_completions": a.unique_completions,
        "unique_completions_with_logprob_bits": a.distinct_outputs,
        "most_common_count": a.most_common_count,
        "most_common_exact_count": a.exact_matches,
        "first_divergence": sorted(a.first_divergence),
        "max_abs_logprob_diff": a.max_abs_logprob_diff or 0.0,
        "tokens_per_completion": len(completions[a.reference_index].token_ids),
        "batch_sizes_seen": {"distinct": len(sizes), "min": sizes[0], "max": sizes[-1]},
    }


def score_requests(completions: dict[str, Completion], reqs: list[Request],
                   count: int) -> list[tuple[Request, int]]:
    """Teacher-forced scoring requests (no KV reuse, one pass) for the first `count` requests'
    prompt + completion: (request, prompt length)."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=0, single_pass=True)
    out = []
    for r in reqs[:count]:
        c = completions[r.request_id]
        out.append((Request(f"score-{r.request_id}", r.token_ids + c.token_ids, params),
                    len(r.token_ids)))
    return out


def compare_scores(sampled: list[Completion], scored: list[Completion],
                   prompt_lens: list[int]) -> dict:
    """Sampled logprobs against the teacher-forced ones of the same tokens, by the contract's
    `compare_to_teacher`. prompt_logprobs[i] scores token i + 1, so completion token j is
    entry prompt_len - 1 + j."""
    totals = TeacherTotals.of([compare_to_teacher(s.logprobs, sc.prompt_logprobs[p - 1:])
                               for s, sc, p in zip(sampled, scored, prompt_lens, strict=True)])
    return {"sequences": totals.sequences, "positions": totals.tokens,
            "bitwise_equal": totals.identical, "all_equal": totals.all_identical,
            "max_abs_diff": totals.max_abs_diff or 0.0}
