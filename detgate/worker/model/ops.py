"""The model's reducing ops, in one of two numeric modes chosen when the model is built.

Only matmul, RMSNorm, attention and log_softmax reduce, and SwiGLU's silu is the one
transcendental pointwise op (torch computes exp in its vectorised loop body and libm's in the
scalar tail, which can differ by an ulp, and where a row falls depends on the batch);
everything else in the decoder is a gather or one IEEE +, * or rounding per element, which
gives the same bits in any loop, so it is batch-invariant already. `make_ops("default")` is
what a tuned engine runs: fast, but its reduction order may depend on how many rows are in the
batch. `make_ops("batch_invariant")` routes those ops through `kernels`, whose results for one
row never depend on the rest of the batch.

Default mode, by device:
- CUDA: what a user of a tuned engine (vLLM) gets, so that batch_invariant / default is the
  price of invariance and nothing else. cuBLAS matmuls (F.linear, whose kernel and split-K
  choice follow the batch's row count: the mode's one source of batch dependence here);
  fused RMSNorm, with the residual add fused in, as vLLM's rms_norm / fused_add_rms_norm
  kernels do (one program per row): our Triton kernel, since torch's F.rms_norm fuses no
  residual add and the two kernels then cost the same in both modes; the same paged attention
  kernel as batch_invariant (kernels.attention: K/V stored, then read through the block
  table, no gather), so default-mode steps are captured in the same CUDA graphs; the same
  fused launches as batch_invariant for what is pointwise or per head (q/k norm + rotary +
  K/V store, kernels/qkv_triton.py; silu-and-mul, kernels/activation_triton.py), as vLLM
  fuses them; F.log_softmax.
- CPU: plain torch as before (MKL matmuls, torch's RMSNorm math, SDPA over the gathered
  cache): the CPU tests' negative controls rely on it differing between batch compositions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from detgate import kernels
from detgate.contract.constants import MODES
from detgate.kernels import cpu as cpu_kernels
from detgate.kernels.attention import paged_attention, store_kv
from detgate.kernels.quantised import QuantisedWeight
from detgate.worker.model.attention_metadata import AttentionMetadata
from detgate.worker.model.layers.rotary import RotaryEmbedding

# (k_cache, v_cache), each [num_blocks, block_size, Hkv, D]
KVCache = tuple[torch.Tensor, torch.Tensor]


class DefaultOps:
    """cuBLAS / MKL matmuls; on CUDA fused norms and paged attention (see the module
    docstring), on the CPU torch RMSNorm math and SDPA over the gathered cache."""

    mode = "default"

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.is_cuda:
            return kernels.rms_norm(x, weight, eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            return kernels.add_rms_norm(x, residual, weight, eps)
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                 meta: AttentionMetadata) -> None:
        # k, v: [T, Hkv, D], written before attention reads the cache
        k_cache, v_cache = kv_cache
        if k.is_cuda:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            _store_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def attention(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                  scale: float) -> torch.Tensor:
        # q: [T, Hq, D] -> [T, Hq, D]
        if q.is_cuda:
            return _paged(q, kv_cache, meta, scale)
        k_cache, v_cache = kv_cache
        return _padded_sdpa(q, k_cache, v_cache, meta, scale)

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        # torch widens inside its kernel: one pass over [B, V] fewer than logits.float() first.
        return F.log_softmax(logits, dim=-1, dtype=torch.float32)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.is_cuda:  # one launch, the bits of the two-kernel torch code
            return kernels.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotate(self, rotary: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor,
               k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary(positions, q, k)


class BatchInvariantOps:
    """Every reduction through `kernels`: one order per output element, whatever the batch."""

    mode = "batch_invariant"

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor | QuantisedWeight,
        bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        # weight: [N, K] as nn.Linear stores it; the kernel reads its transposed view, no copy.
        # GGUF blocks (CPU only) give the bits of their dequantised fp32 weight.
        if isinstance(weight, QuantisedWeight):
            out = cpu_kernels.matmul_quantised(x.reshape(-1, x.shape[-1]), weight, bias)
            return out.reshape(*x.shape[:-1], weight.shape[0])
        out = kernels.matmul(x.reshape(-1, x.shape[-1]), weight.t(), bias)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return kernels.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.add_rms_norm(x, residual, weight, eps)

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                 meta: AttentionMetadata) -> None:
        store_kv(k, v, *kv_cache, meta.slot_mapping)

    def attention(self, q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                  scale: float) -> torch.Tensor:
        return _paged(q, kv_cache, meta, scale)

    def log_softmax(self, logits: torch.Tensor) -> torch.Tensor:
        return kernels.log_softmax(logits, dim=-1)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        # The sampler's probabilities, of one row at a time (so no batch to vary). On the CPU
        # the kernels' own: torch's softmax sums in lanes of its vector width, and its AVX2 and
        # AVX-512 kernels give other bits, which would tie a record to one CPU family
        # (worker/model/numerics.py). On CUDA torch's, whose GPU and version the fingerprint
        # names.
        return cpu_kernels.softmax(x) if x.is_cpu else torch.softmax(x, dim=-1)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return kernels.silu_and_mul(gate_up)

    def rotate(self, rotary: RotaryEmbedding, positions: torch.Tensor, q: torch.Tensor,
               k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Pointwise, so either way is invariant; on the CPU in fp32 one compiled call per
        # tensor instead of the module's ~8 torch ops, with their bits.
        if q.is_cpu:
            q2 = cpu_kernels.rotary(positions, q, rotary.cos, rotary.sin)
            k2 = cpu_kernels.rotary(positions, k, rotary.cos, rotary.sin)
            if q2 is not None and k2 is not None:
                return q2, k2
        return rotary(positions, q, k)


Ops = DefaultOps | BatchInvariantOps


def make_ops(mode: str) -> Ops:
    if mode == "default":
        return DefaultOps()
    if mode == "batch_invariant":
        return BatchInvariantOps()
    raise ValueError(f"unknown numeric mode {mode!r}; expected one of {MODES}")


def _paged(q: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
           scale: float) -> torch.Tensor:
    """Paged attention (kernels.attention) over the cache, this step's K/V already stored in it
    (`store_kv` or the layer's fused store): fresh and cached keys are read and reduced the
    same way, so a prompt gives the same bits whether prefilled at once, in chunks, or found
    in the prefix cache."""
    k_cache, v_cache = kv_cache
    return paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                           meta.seq_lens, scale, decode=meta.max_query_len == 1)


def _store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    # Every slot must be >= 0: the model runner gives padding rows a slot in its padding block
    # rather than a negative one, so no boolean mask (a host sync, uncapturable) is needed.
    _, _, hkv, d = k_cache.shape
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _padded_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Gather every sequence's K/V into a padded batch and run one masked SDPA call.

    GQA without copying K/V per query head: the q heads of a group are extra query rows of
    their kv head (rows ordered query, then head of the group), so SDPA sees equal head counts
    and can take a fused kernel with a mask (SDPA's enable_gqa with a mask falls back to the
    math kernel, which expands K/V to every q head).
    """
    block_size = k_cache.shape[1]
    num_blocks = -(-meta.max_seq_len // block_size)
    qsl = meta.query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]  # [B]
    seq_lens = meta.seq_lens.long()  # [B]
    device = q.device
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    group = hq // hkv

    tables = meta.block_tables[:, :num_blocks].long().clamp(min=0)  # [B, nb]
    b, nb = tables.shape
    keys = k_cache[tables].reshape(b, nb * block_size, hkv, d).transpose(1, 2)
    values = v_cache[tables].reshape(b, nb * block_size, hkv, d).transpose(1, 2)
    # keys, values: [B, Hkv, L, D]

    max_q = meta.max_query_len
    j = torch.arange(max_q, device=device)
    q_valid = j[None, :] < q_lens[:, None]  # [B, max_q]
    token = torch.where(q_valid, qsl[:-1, None] + j[None, :], 0)
    queries = q[token].view(b, max_q, hkv, group, d).permute(0, 2, 1, 3, 4)
    queries = queries.reshape(b, hkv, max_q * group, d)  # [B, Hkv, max_q * G, D]
    # Padding queries get positions >= seq_len, so every row sees at least one key (no NaN rows).
    q_pos = seq_lens[:, None] - q_lens[:, None] + j[None, :]  # [B, max_q]
    k_pos = torch.arange(nb * block_size, device=device)
    mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
        k_pos[None, None, :] < seq_lens[:, None, None]
    )
    mask = mask.repeat_interleave(group, dim=1)  # [B, max_q * G, L]

    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask[:, None],
                                         scale=scale)
    out = out.view(b, hkv, max_q, group, d).permute(0, 2, 1, 3, 4).reshape(b, max_q, hq, d)
    # Back to token order by index, not by boolean mask: no host sync (CUDA graphs need none).
    t = torch.arange(q.shape[0], device=device)
    seq_of = torch.searchsorted(qsl[1:], t, right=True)  # [T]
    return out[seq_of, t - qsl[seq_of]]  # [T, Hq, D]
