"""The trainer's ops in plain torch, differentiated by torch autograd: the reference math.

Three uses, one definition: the `default` trainer (what a plain PyTorch or Hugging Face trainer
computes: its numbers need not equal any sampler's), the backward pass of the batch-invariant
attention (whose forward is the engine's paged kernel), and the gradient checks of the
batch-invariant ops. The rounding points are the kernels' (a norm's statistic in fp32 and its
normalised row rounded to the model's dtype before the weight; rotary in fp32 rounded once;
SwiGLU and log_softmax in fp32), so that the two differ only in reduction order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from detgate.train.batch import Packed
from detgate.worker.model.layers.attention import Attention
from detgate.worker.model.layers.rotary import _rotate  # the worker's CPU rotary: torch ops


class TorchOps:
    mode = "default"

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        residual = x + residual
        return rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.float().chunk(2, dim=-1)
        return (F.silu(gate) * up).to(gate_up.dtype)

    def attention(self, qkv: torch.Tensor, attn: Attention, batch: Packed) -> torch.Tensor:
        return attention(qkv, *norm_weights(attn), attn, batch)

    def chosen_logprobs(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """logits [R, V] -> log_softmax(logits)[r, targets[r]], fp32 [R]."""
        return F.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None]).squeeze(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def norm_weights(attn: Attention) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if attn.q_norm is None:
        return None, None
    return attn.q_norm.weight, attn.k_norm.weight


def attention(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
              attn: Attention, batch: Packed) -> torch.Tensor:
    """qkv [N, (Hq + 2 Hkv) D] -> [N, Hq, D]: q/k norm, rotary, causal GQA attention within
    each sequence (SDPA over the sequences right-padded to [B, Hq, T, D]; a padding query
    sees only keys, never a real query a padding key)."""
    n = qkv.shape[0]
    q, k, v = qkv.split(attn.qkv_proj.shard_sizes, dim=-1)
    q = q.reshape(n, attn.num_heads, attn.head_dim)
    k = k.reshape(n, attn.num_kv_heads, attn.head_dim)
    v = v.reshape(n, attn.num_kv_heads, attn.head_dim)
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, attn.q_norm.eps), rms_norm(k, k_norm, attn.k_norm.eps)
    cos = attn.rotary.cos[batch.positions].unsqueeze(1)  # [N, 1, D/2] fp32
    sin = attn.rotary.sin[batch.positions].unsqueeze(1)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    where = (batch.seq_of, batch.positions)
    shape = (len(batch.lens), max(batch.lens))

    def padded(x: torch.Tensor) -> torch.Tensor:  # [N, H, D] -> [B, Hq, T, D]
        # q head h reads kv head h // group (the kernels' GQA layout); K/V are repeated per q
        # head rather than passed with enable_gqa, which some backends only run in math mode
        x = x.repeat_interleave(attn.num_heads // x.shape[1], dim=1)
        return x.new_zeros(*shape, *x.shape[1:]).index_put(where, x).transpose(1, 2)

    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), is_causal=True,
                                         scale=attn.scale)
    return out.transpose(1, 2)[where]
