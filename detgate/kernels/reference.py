"""Plain-torch references for every kernel: the numbers the kernels are checked against.

Computed in float64 where that is cheap, so a kernel's error is measured against the exact
answer rather than against another float32 ordering.
"""

from __future__ import annotations

import torch


def matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = a.double() @ b.double()
    if bias is not None:
        out = out + bias.double()
    return out.to(a.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.double() * normed).to(torch.promote_types(x.dtype, weight.dtype))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual.to(x.dtype)
    return rms_norm(new_residual, weight, eps), new_residual


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return torch.log_softmax(x.double(), dim=dim).float()


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Per sequence: gather its keys position by position, causal softmax(q k^T) v in fp64."""
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // hkv
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        qi = q[starts[i]:starts[i + 1]].double()  # [n, Hq, D]
        n = qi.shape[0]
        pos = torch.arange(seq_len, device=q.device)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        q_pos = seq_len - n + torch.arange(n, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = scores.softmax(-1)
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
