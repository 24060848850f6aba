"""A quick self-check of every CUDA kernel the batch_invariant engine uses, run before the
engine experiment (detgate/bench/engine_gpu.py): on a small input each kernel must run, be close to
torch, and give a row the same bits alone as in a batch. A failure here names the kernel behind
a failed batch_invariant phase; the experiment goes on either way.
"""

from __future__ import annotations

import time

import torch

from detgate.kernels.bits import same_bits

T0 = time.time()


def kernel_check() -> dict:
    """Each CUDA kernel on a small input: ran, close to torch, rows invariant. A failure here
    names the kernel behind a failed batch_invariant phase."""
    from detgate import kernels
    from detgate.kernels.attention import paged_attention, store_kv

    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)

    x, w, r, norm_w = randn(37, 4096), randn(1024, 4096), randn(37, 4096), randn(4096)

    def attention():
        # 3 sequences of 70, 1 and 33 tokens, block 16, the whole prompt as queries.
        lens, hq, hkv, d, bs = [70, 1, 33], 32, 8, 128, 16
        blocks = [-(-n // bs) for n in lens]
        kc = torch.zeros(sum(blocks) + 1, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        q, k, v = randn(sum(lens), hq, d), randn(sum(lens), hkv, d), randn(sum(lens), hkv, d)
        tables = torch.full((3, max(blocks)), -1, dtype=torch.int32, device="cuda")
        slots, first = [], 0
        for i, n in enumerate(lens):
            tables[i, :blocks[i]] = torch.arange(first, first + blocks[i])
            slots += [(first + p // bs) * bs + p % bs for p in range(n)]
            first += blocks[i]
        qsl = torch.tensor([0, 70, 71, 104], dtype=torch.int32, device="cuda")
        seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        store_kv(k, v, kc, vc, torch.tensor(slots, device="cuda"))
        out = paged_attention(q, kc, vc, tables, qsl, seq_lens, d**-0.5)
        ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None],
            v[s:e].transpose(0, 1)[None], is_causal=True, enable_gqa=True, scale=d**-0.5
        )[0].transpose(0, 1) for s, e in ((0, 70), (70, 71), (71, 104))])
        one = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
        alone = paged_attention(q[70:71], kc, vc, tables[1:2], one, seq_lens[1:2], d**-0.5)
        return out, ref, same_bits(alone, out[70:71])

    checks = {
        "matmul": lambda: (kernels.matmul(x, w.t()), x.float() @ w.float().t(),
                           same_bits(kernels.matmul(x[:5], w.t()), kernels.matmul(x, w.t())[:5])),
        "rms_norm": lambda: (kernels.rms_norm(x, norm_w, 1e-6),
                             torch.nn.functional.rms_norm(x.float(), (4096,), norm_w.float(), 1e-6),
                             same_bits(kernels.rms_norm(x[:3], norm_w, 1e-6),
                                         kernels.rms_norm(x, norm_w, 1e-6)[:3])),
        "add_rms_norm": lambda: (kernels.add_rms_norm(x, r, norm_w, 1e-6)[0],
                                 torch.nn.functional.rms_norm((x + r).float(), (4096,),
                                                              norm_w.float(), 1e-6),
                                 same_bits(kernels.add_rms_norm(x[:3], r[:3], norm_w, 1e-6)[0],
                                             kernels.add_rms_norm(x, r, norm_w, 1e-6)[0][:3])),
        "log_softmax": lambda: (kernels.log_softmax(x.float() * 3), torch.log_softmax(
                                    x.float() * 3, -1), same_bits(
                                    kernels.log_softmax(x[:2].float() * 3),
                                    kernels.log_softmax(x.float() * 3)[:2])),
        "attention": attention,
    }
    result = {}
    for name, fn in checks.items():
        try:
            ours, ref, invariant = fn()
            torch.cuda.synchronize()
            err = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
            result[name] = {"ok": err < 2e-2 and invariant, "rel_err": err,
                            "rows_invariant": invariant}
        except Exception as exc:  # the kernel does not run here: say which, keep going
            result[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(f"[{time.time() - T0:6.1f}s] kernel {name}: {result[name]}", flush=True)
    return result
