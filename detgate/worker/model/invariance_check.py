"""The batch_invariant worker's startup self-check, on its own model's shapes and weights.

Runs `kernels.selfcheck` on every distinct matmul of the model (its real weights), its norms,
SwiGLU, log_softmax over its vocabulary and its attention head layout, before the engine
serves. A failure stops the worker with the op, shape, dtype and CPU named: a worker that
claims invariance must not serve answers that lack it.
"""

from __future__ import annotations

import logging

import torch

from detgate.kernels import selfcheck
from detgate.worker.model.loader import LoadedModel

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
    quantised = _quantised_checks(model, linears)
    device = head.device
    try:
        seconds = selfcheck.run(checks + [c for c, _ in quantised], config.dtype, device,
                                attention=(config.num_heads, config.num_kv_heads,
                                           config.head_dim))
        for c, dequantised in quantised:
            diff = selfcheck.quantised_difference(c, dequantised)
            if diff:
                raise selfcheck.SelfCheckError(f"{c.op} ({c.shape}): {diff}")
    except selfcheck.SelfCheckError as exc:
        where = f"{loaded.machine.get('cpu', device)} ({loaded.machine.get('isa_class', '')})"
        build = loaded.machine.get("cpu_kernels", "")
        raise selfcheck.SelfCheckError(
            f"batch invariance self-check failed on {where} ({build}): {exc}. Refusing to "
            "serve answers that claim an invariance they lack; `--skip-self-check` serves "
            "anyway") from exc
    log.info("batch invariance self-check passed: %d ops on the model's shapes in %.2f s",
             len(checks) + len(quantised) + 1, seconds)
    return seconds


def _quantised_checks(model, linears: dict[str, torch.Tensor]):
    """(check, fp32 weight) for each distinct shape and type of GGUF blocks the model reads:
    checked for invariance like the fp32 matmuls, and for equality with them."""
    blocks = {name: m.quantised for name, m in model.named_modules()
              if getattr(m, "quantised", None) is not None}
    if model.quantised_head is not None:
        blocks["lm_head"] = model.quantised_head
    out, seen = [], set()
    for name, weight in blocks.items():
        if (weight.shape, weight.qtype) not in seen:
            seen.add((weight.shape, weight.qtype))
            out.append((selfcheck.quantised_check(name, weight), linears[name]))
    return out
