"""The batch-invariant trainer ops: the worker's own kernel calls, each in an autograd Function.

Why a trainer logprob has the bits of the sampler's (a batch_invariant worker on the same
weights, dtype and device), whatever either batch holds:
- Every forward below IS the worker's call: the methods of the model's `BatchInvariantOps`
  (matmul, RMSNorm with and without the residual add, SwiGLU, log_softmax) and, for attention,
  the worker's own `Attention.attend` (q/k norm, rotary, K/V store, paged attention; the fused
  Triton launch on CUDA, as the engine takes it). Nothing is re-implemented for training.
- Each of those ops gives a row (a token) bits that depend only on that row's inputs: the
  kernels fix one reduction order per output element by the reduction length alone
  (kernels/cpu.py, kernels/csrc/cpu_kernels.cpp, the Triton kernels' docstrings); the rest is
  pointwise or a gather.
- Attention: a query at position p reads its own sequence's keys 0..p in increasing position
  through the block table, in an order set by (head dim, p + 1) on the CPU and by fixed
  KV_GROUP / KV_SPLIT / BLOCK_N tiles on CUDA, never by the other queries or sequences, by
  decode vs prefill (on CUDA a decode step's 16-row tiles give the bits of prefill's 64-row ones:
  kernels/attention_triton.py says why and how that is checked), by the prompt's chunking or
  by the cache's block size (kernels/attention.py). The
  trainer stores its whole batch in a cache of its own (train/batch.py) and runs the same
  kernel: its row for position p is the engine's row for position p, whether the engine
  computed that row in one prefill, a chunk, a decode step, from a prefix-cache hit (whose K/V
  are the same bits, being rows of the same ops) or after a preemption.
- So by induction over the layers, the hidden row of position p depends only on tokens 0..p,
  and the logprob of token p + 1 (the head's matmul and log_softmax on that row) is the
  sampler's bit for bit. The trainer's batch composition (padding dropped, packing order, the
  number and lengths of the other sequences) never enters.

Backward passes are standard torch arithmetic (gradients need not be bitwise): closed forms for
matmul, norms, SwiGLU and log_softmax; for attention, torch autograd of the reference math
(train/reference.py) recomputed from the saved qkv rows.
"""

from __future__ import annotations

import torch

from detgate.train import reference
from detgate.train.batch import Packed
from detgate.worker.model.layers.attention import Attention
from detgate.worker.model.ops import BatchInvariantOps


class InvariantOps:
    """The same interface as reference.TorchOps, forward through the worker's kernels."""

    mode = "batch_invariant"

    def __init__(self, kernels: BatchInvariantOps) -> None:
        self.kernels = kernels

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        return _Linear.apply(self.kernels, x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return _RMSNorm.apply(self.kernels, x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return _AddRMSNorm.apply(self.kernels, x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return _SiluAndMul.apply(self.kernels, gate_up)

    def attention(self, qkv: torch.Tensor, attn: Attention, batch: Packed) -> torch.Tensor:
        return _Attention.apply(qkv, *reference.norm_weights(attn), attn, batch)

    def chosen_logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return _ChosenLogprobs.apply(self.kernels, logits, targets)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernels, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return kernels.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = (g @ weight).reshape(x.shape) if ctx.needs_input_grad[1] else None
        grad_w = g.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[2] else None
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[3] else None
        return None, grad_x, grad_w, grad_b


def _rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """d/dx and d/dw of weight * x / rms(x), in fp32 (the roundings' derivative taken as 1)."""
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    normed = xf * inv
    g = grad.float()
    grad_w = (g * normed).reshape(-1, x.shape[-1]).sum(0)
    gn = g * weight.float()
    grad_x = inv * (gn - normed * (gn * normed).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), grad_w.to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernels, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return kernels.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x, grad_w = _rms_norm_backward(x, weight, ctx.eps, grad)
        return None, grad_x, grad_w, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernels, x, residual, weight, eps):
        out, new_residual = kernels.add_rms_norm(x, residual, weight, eps)
        ctx.save_for_backward(new_residual, weight)
        ctx.eps = eps
        ctx.residual_dtype = residual.dtype
        return out, new_residual

    @staticmethod
    def backward(ctx, grad_out, grad_residual):
        new_residual, weight = ctx.saved_tensors
        grad_x, grad_w = _rms_norm_backward(new_residual, weight, ctx.eps, grad_out)
        grad_sum = grad_x + grad_residual  # both paths into x + residual
        return None, grad_sum, grad_sum.to(ctx.residual_dtype), grad_w, None


class _SiluAndMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernels, gate_up):
        ctx.save_for_backward(gate_up)
        return kernels.silu_and_mul(gate_up)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        gate, up = gate_up.float().chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        g = grad.float()
        grad_gate = g * up * sig * (1 + gate * (1 - sig))
        grad_up = g * gate * sig
        return None, torch.cat((grad_gate, grad_up), dim=-1).to(gate_up.dtype)


class _ChosenLogprobs(torch.autograd.Function):
    """logits [R, V] -> the sampler's log_softmax(logits)[r, targets[r]], fp32 [R]; only the
    logits are kept for the backward pass (its softmax is recomputed there)."""

    @staticmethod
    def forward(ctx, kernels, logits, targets):
        ctx.save_for_backward(logits, targets)
        return kernels.log_softmax(logits).gather(1, targets[:, None]).squeeze(1)

    @staticmethod
    def backward(ctx, grad):
        logits, targets = ctx.saved_tensors
        grad_logits = torch.softmax(logits.float(), dim=-1).mul_(-grad[:, None])
        grad_logits.scatter_add_(1, targets[:, None], grad[:, None])
        return None, grad_logits.to(logits.dtype), None


class _Attention(torch.autograd.Function):
    """qkv [N, (Hq + 2 Hkv) D] -> [N, Hq, D] by the worker's `Attention.attend` over a cache of
    the batch (its module weights are the serving-dtype ones: the policy runs the forward
    inside `functional_call`); the backward differentiates reference.attention."""

    @staticmethod
    def forward(ctx, qkv, q_norm, k_norm, attn: Attention, batch: Packed):
        ctx.save_for_backward(qkv, q_norm, k_norm)
        ctx.attn, ctx.batch = attn, batch
        meta, cache = batch.attention_inputs(attn.num_kv_heads, attn.head_dim, qkv.dtype)
        return attn.attend(batch.positions, qkv, meta, cache)

    @staticmethod
    def backward(ctx, grad):
        inputs = [None if t is None else t.detach().requires_grad_(need)
                  for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad[:3], strict=True)]
        wanted = [t for t in inputs if t is not None and t.requires_grad]
        with torch.enable_grad():
            out = reference.attention(*inputs, ctx.attn, ctx.batch)
        grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (*(next(grads) if t is not None and t.requires_grad else None for t in inputs),
                None, None)
