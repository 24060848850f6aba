"""The engine experiment's measures (worker/engine/offline.py), on hand-made completions."""

from __future__ import annotations

from detgate.worker.engine.offline import Completion, compare_scores, determinism_measures


def test_determinism_measures_count_ids_and_logprob_bits():
    top = Completion([1, 2, 3], [-0.5, -1.0, -2.0], [4])
    measures = determinism_measures([
        top, Completion([1, 2, 3], [-0.5, -1.0, -2.0], [9]),
        Completion([1, 2, 3], [-0.5, -1.0, -2.0000002], [16]),  # same ids, other bits
        Completion([1, 7, 3], [-0.5, -1.25, -2.0], [30]),  # diverges at token 1
    ])
    assert measures["unique_completions"] == 2
    assert measures["unique_completions_with_logprob_bits"] == 3
    assert measures["most_common_count"] == 3
    assert measures["most_common_exact_count"] == 2
    assert measures["first_divergence"] == [1]
    # Before divergence only: the diverged completion's -1.25 is not compared.
    assert measures["max_abs_logprob_diff"] == abs(-2.0000002 - -2.0)
    assert measures["batch_sizes_seen"] == {"distinct": 4, "min": 4, "max": 30}


def test_compare_scores_lines_up_completion_tokens():
    # prompt of 3 tokens: prompt_logprobs[i] scores token i + 1, so completion token j is at 2 + j
    sampled = Completion([5, 6], [-0.1, -0.2])
    scored = Completion(prompt_logprobs=[-9.0, -8.0, -0.1, -0.2])
    assert compare_scores([sampled], [scored], [3])["all_equal"]
    scored.prompt_logprobs[-1] = -0.20000001
    result = compare_scores([sampled], [scored], [3])
    assert (result["bitwise_equal"], result["positions"]) == (1, 2)
