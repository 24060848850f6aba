"""The batch_invariant worker's startup self-check, on its own model's shapes and weights.

Runs `kernels.selfcheck` on every distinct matmul of the model (its real weights), its norms,
SwiGLU, log_softmax over its vocabulary and its attention head layout, before the engine
serves. A failure stops the worker with the op, shape, dtype and CPU named: a worker that
claims invariance must not serve answers that lack it.
"""

from __future__ import annotations

import logging

from kernels import selfcheck
from worker.model.loader import LoadedModel

log = logging.getLogger("detgate.worker")


def check(loaded: LoadedModel) -> float:
    """Seconds taken; raises selfcheck.SelfCheckError (with the machine named) on a failure."""
    model, config = loaded.model, loaded.config
    linears = {name: m.weight for name, m in model.named_modules() if hasattr(m, "shard_sizes")}
    head = model.lm_head.weight if model.lm_head is not None else \
        model.model.embed_tokens.weight
    linears["lm_head"] = head
    checks = selfcheck.model_checks(linears, config.hidden_size, config.head_dim,
                                    config.vocab_size)
    device = head.device
    try:
        seconds = selfcheck.run(checks, config.dtype, device,
                                attention=(config.num_heads, config.num_kv_heads,
                                           config.head_dim))
    except selfcheck.SelfCheckError as exc:
        where = loaded.fingerprint_parts.get("device", str(device))
        build = loaded.fingerprint_parts.get("cpu_kernels", "")
        raise selfcheck.SelfCheckError(
            f"batch invariance self-check failed on {where} ({build}): {exc}. Refusing to "
            "serve answers that claim an invariance they lack; `--skip-self-check` serves "
            "anyway") from exc
    log.info("batch invariance self-check passed: %d ops on the model's shapes in %.2f s",
             len(checks) + 1, seconds)
    return seconds
