"""The decoder's forward over a packed batch, op for op the worker's (worker/model/decoder.py).

Same modules, same weights, same order of ops per row as `DecoderModel.forward` and
`CausalLM.compute_logits`, but every op comes from the trainer's ops (train/ops.py or
train/reference.py), which autograd can differentiate, and attention runs over the batch's own
cache. The tests compare the result with a sampling engine bit for bit: a drift between this
file and decoder.py fails them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from detgate.train.batch import Packed
from detgate.worker.model.decoder import CausalLM


def hidden_states(model: CausalLM, ops, batch: Packed) -> torch.Tensor:
    """-> the final norm's output [N, H] for every token of the batch."""
    decoder = model.model
    hidden = F.embedding(batch.input_ids, decoder.embed_tokens.weight)  # [N, H]
    residual = None
    for layer in decoder.layers:
        norm = layer.input_layernorm
        if residual is None:
            residual = hidden
            hidden = ops.rms_norm(hidden, norm.weight, norm.eps)
        else:
            hidden, residual = ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        attn = layer.self_attn
        qkv = ops.linear(hidden, attn.qkv_proj.weight, attn.qkv_proj.bias)
        out = ops.attention(qkv, attn, batch)  # [N, Hq, D]
        hidden = ops.linear(out.reshape(out.shape[0], -1), attn.o_proj.weight, attn.o_proj.bias)
        norm = layer.post_attention_layernorm
        hidden, residual = ops.add_rms_norm(hidden, residual, norm.weight, norm.eps)
        mlp = layer.mlp
        gate_up = ops.linear(hidden, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias)
        hidden = ops.linear(ops.silu_and_mul(gate_up), mlp.down_proj.weight, mlp.down_proj.bias)
    hidden, _ = ops.add_rms_norm(hidden, residual, decoder.norm.weight, decoder.norm.eps)
    return hidden


def chosen_logprobs(model: CausalLM, ops, batch: Packed, targets: torch.Tensor) -> torch.Tensor:
    """targets [R]: indices into the batch of tokens that are not first in their sequence ->
    fp32 [R], log p(token | the tokens before it), from the row of the token before it."""
    hidden = hidden_states(model, ops, batch)
    head = model.model.embed_tokens if model.lm_head is None else model.lm_head
    logits = ops.linear(hidden[targets - 1], head.weight)  # [R, V] in the model's dtype
    return ops.chosen_logprobs(logits, batch.input_ids[targets])
