"""The batch-invariant ops' backward passes against torch autograd of the reference math
(train/reference.py) in float64: op by op, and the whole model's parameter gradients.
Gradients are checked to a tolerance: only the forward is claimed bit for bit."""

from __future__ import annotations

import pytest
import torch

from detgate.train import reference
from detgate.train.ops import InvariantOps
from detgate.worker.model.ops import BatchInvariantOps
from tests.train.conftest import prompts

OURS, REF = InvariantOps(BatchInvariantOps()), reference.TorchOps()


def leaves(*shapes: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).requires_grad_() for s in shapes]


def grads(fn, inputs: list[torch.Tensor], weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """d/d inputs of sum(out_i * weights_i) over fn's outputs."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o.double() * w).sum() for o, w in zip(outs, weights, strict=True))
    return list(torch.autograd.grad(loss, inputs))


def check(op: str, inputs: list[torch.Tensor], *extra, out_shapes, rtol: float = 1e-5) -> None:
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(s, generator=gen, dtype=torch.float64) for s in out_shapes]
    ours = grads(lambda *x: getattr(OURS, op)(*x, *extra), inputs, weights)
    wide = [t.detach().double().requires_grad_() for t in inputs]
    want = grads(lambda *x: getattr(REF, op)(*x, *extra), wide, weights)
    for name, g, w in zip(range(len(inputs)), ours, want, strict=True):
        assert g.dtype == inputs[name].dtype
        torch.testing.assert_close(g.double(), w, rtol=rtol, atol=rtol * float(w.abs().max()),
                                   msg=f"{op}: gradient of input {name}")


def test_linear_backward():
    check("linear", leaves((2, 5, 24), (12, 24), (12,)), out_shapes=[(2, 5, 12)])


def test_rms_norm_backward():
    x, w = leaves((6, 40), (40,))
    check("rms_norm", [x, w], 1e-6, out_shapes=[(6, 40)])


def test_add_rms_norm_backward_through_both_outputs():
    check("add_rms_norm", leaves((6, 40), (6, 40), (40,)), 1e-6, out_shapes=[(6, 40), (6, 40)])


def test_silu_and_mul_backward():
    check("silu_and_mul", leaves((5, 2 * 24)), out_shapes=[(5, 24)])


def test_chosen_logprobs_backward():
    targets = torch.tensor([3, 0, 49, 7])
    check("chosen_logprobs", leaves((4, 50)), targets, out_shapes=[(4,)])


def test_attention_backward(policies):
    """The paged-kernel attention (forward) differentiated as the reference attention, over a
    packed batch of three sequences, q/k norm weights included (the tiny model is Qwen3)."""
    policy = policies("float32")
    attn = policy.model.model.layers[1].self_attn
    seqs = prompts(3, seed=2, lo=2, hi=30)
    batch = policy.pack(torch.tensor(sum(seqs, [])), cu_seqlens=_cu(seqs))
    n = batch.input_ids.shape[0]
    (qkv,) = leaves((n, (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim), seed=3)
    norms = [attn.q_norm.weight, attn.k_norm.weight]  # attend reads them from the module
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(n, attn.num_heads, attn.head_dim, generator=gen, dtype=torch.float64)
    out = OURS.attention(qkv, attn, batch)
    ours = torch.autograd.grad((out.double() * weight).sum(), [qkv, *norms])
    wide = [t.detach().double().requires_grad_() for t in (qkv, *norms)]
    want = grads(lambda *x: reference.attention(*x, attn, batch), wide, [weight])
    for g, w in zip(ours, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))


def _cu(seqs: list[list[int]]) -> list[int]:
    cu = [0]
    for s in seqs:
        cu.append(cu[-1] + len(s))
    return cu


def model_grads(policy, prompts_, completions) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    policy.zero_grad(set_to_none=True)
    lps = policy.completion_logprobs(prompts_, completions)
    loss = sum((lp.double() * torch.randn(lp.shape, generator=gen, dtype=torch.float64)
                .to(lp.device)).sum() for lp in lps)
    loss.backward()
    return {name: p.grad.clone() for name, p in policy.named_parameters()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_gradients_match_float64_autograd(policies, dtype):
    """Every fp32 master's gradient, the batch_invariant forward in `dtype`, against plain
    autograd in float64 on the same weights: within 1e-4 of its norm, or no worse than 1.5x
    plain autograd run in `dtype` (bf16's own rounding error is a few percent)."""
    policy = policies(dtype)
    asked = prompts(3, seed=6, lo=2, hi=25)
    completions = prompts(3, seed=7, lo=1, hi=12)
    ours = model_grads(policy, asked, completions)
    plain = model_grads(policy.with_mode("default"), asked, completions)
    want = model_grads(policy.with_mode("default", torch.float64), asked, completions)
    assert set(ours) == set(want) and all(g.dtype == torch.float32 for g in ours.values())

    def error(g: torch.Tensor, name: str) -> float:
        return float((g.double() - want[name]).norm() / want[name].norm())

    for name, g in ours.items():
        assert float(want[name].norm()) > 0, name
        bound = max(1e-4, 1.5 * error(plain[name], name))
        assert error(g, name) < bound, f"{name}: error {error(g, name):.2e}, bound {bound:.2e}"
