"""Programmatic dependent launch changes when kernels start, never what they compute
(detgate/kernels/pdl.py). On a real GPU (skipped without CUDA): a chain of our kernels, each
reading the one before (norm, matmul, silu, matmul, attention's store and read, log_softmax),
eagerly and replayed from a CUDA graph, in a process with PDL on and one with it off: the same
bytes, and the kernels of the first were compiled to launch with PDL (else the comparison
proves nothing).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CHAIN = r"""
import hashlib, sys, torch
from detgate import kernels
from detgate.kernels import attention_triton, matmul_triton, pdl

g = torch.Generator(device="cuda").manual_seed(0)
def randn(*shape):
    return (torch.randn(*shape, device="cuda", generator=g) * 0.05).to(torch.bfloat16)

h, inter, heads, d, block, vocab = 1024, 2816, 8, 128, 16, 8192
w_norm, w_up, w_down, w_head = randn(h) + 1, randn(2 * inter, h), randn(h, inter), randn(vocab, h)
k_cache = torch.zeros(64, block, heads, d, device="cuda", dtype=torch.bfloat16)
v_cache = torch.zeros_like(k_cache)

t = 37  # tokens of one sequence, on blocks 0..2 (the metadata made before any capture)
slots = torch.arange(t, device="cuda", dtype=torch.int64)
tables = torch.arange(4, device="cuda", dtype=torch.int32).view(1, 4)
starts = torch.tensor([0, t], device="cuda", dtype=torch.int32)
lens = torch.tensor([t], device="cuda", dtype=torch.int32)

def chain(x):
    y = kernels.rms_norm(x, w_norm, 1e-6)
    y = kernels.matmul(kernels.silu_and_mul(kernels.matmul(y, w_up.t())), w_down.t())
    q = y.view(t, heads, d)
    attention_triton.store_kv(q, q, k_cache, v_cache, slots)
    out = attention_triton.paged_attention(q, k_cache, v_cache, tables, starts, lens, d ** -0.5)
    return kernels.log_softmax(kernels.matmul(out.view(t, h), w_head.t()))

x = randn(t, h)
eager = chain(x)
static = x.clone()
chain(static)
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    replayed = chain(static)
graph.replay()
torch.cuda.synchronize()
digest = hashlib.sha256(eager.cpu().numpy().tobytes() + replayed.cpu().numpy().tobytes())
launch_pdl = [w.by_config and next(iter(w.by_config.values())).launcher._pdl
              for w in matmul_triton._WEIGHTS.values() if w is not None]
print(digest.hexdigest(), pdl.on(x), all(launch_pdl) and bool(launch_pdl))
"""


def _run(pdl: str) -> list[str]:
    env = {**os.environ, "DETGATE_PDL": pdl}
    done = subprocess.run([sys.executable, "-c", CHAIN], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()


def test_pdl_changes_no_bit_eagerly_or_in_a_graph():
    with_pdl, without = _run("1"), _run("0")
    # The control: PDL was in force in the first process (on this GPU: sm_90 or later).
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs sm_90 or later")
    assert with_pdl[1:] == ["True", "True"] and without[1:] == ["False", "False"]
    assert with_pdl[0] == without[0]
