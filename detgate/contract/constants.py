"""Names and limits every part of detgate agrees on (each defined here only)."""

from __future__ import annotations

# A worker's numeric modes. `default` comes first: it is the baseline that side-by-side
# tables and benchmark ratios are taken against.
MODES = ("default", "batch_invariant")
DEFAULT_MODE = "batch_invariant"

# The dtypes a worker serves in (float16 is not offered: its range overflows on real
# checkpoints, and nothing is measured in it).
DTYPES = ("float32", "bfloat16")
DEFAULT_DTYPE = "float32"

# Most alternatives per token (`top_logprobs`, completions' `logprobs`, `prompt_logprobs`).
MAX_LOGPROBS = 20

# Chat message roles accepted on the way in.
ROLES = ("system", "developer", "user", "assistant", "tool")

# What a record's `status` can be.
STATUSES = ("complete", "aborted", "failed")


def prompt_logprobs_conflict(stream: bool, prompt_logprobs: int | None) -> str | None:
    """Why a request may not stream with prompt logprobs (they come with a whole answer, and
    a record must be replayable as it was served), or None when it may be served."""
    if stream and prompt_logprobs is not None:
        return "'prompt_logprobs' is not available when streaming"
    return None
