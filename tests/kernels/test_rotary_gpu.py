"""The fused rotary kernel (kernels/rotary_triton.py) against the torch code it replaces
(worker/model/layers/rotary.py `_rotate`), bit for bit, on CUDA (skipped without): q and k as
strided views of one qkv row (as the attention layer has them) and contiguous, in every dtype
the engine runs, at random positions. Pointwise, so there is no batch to vary: the check is
that the arithmetic is the same (no FMA, the same rounding to the model's dtype)."""

from __future__ import annotations

import pytest
import torch

from detgate.kernels.bits import same_bits
from detgate.worker.model.layers.rotary import RotaryEmbedding, _rotate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads", [(32, 8, 128), (8, 2, 32), (5, 3, 64)])
@pytest.mark.parametrize("strided", [True, False])
def test_rotary_kernel_is_bit_identical_to_torch(dtype, heads, strided):
    from detgate.kernels.rotary_triton import rotary, supported

    hq, hkv, d = heads
    torch.manual_seed(hq * 1000 + d)
    with torch.device("cuda"):
        rot = RotaryEmbedding(d, 40960, 1e6, None)
    t = 333
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, device="cuda") * 4).to(dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.reshape(t, hq, d), k.reshape(t, hkv, d)
    if not strided:
        q, k = q.contiguous(), k.contiguous()
    pos = torch.randint(0, 40960, (t,), device="cuda")
    assert supported(q, k, rot.cos)
    cos, sin = rot.cos[pos].unsqueeze(1), rot.sin[pos].unsqueeze(1)
    want_q, want_k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    got_q, got_k = rotary(pos, q, k, rot.cos, rot.sin)
    bits = BITS[dtype]
    assert same_bits(got_q.view(bits), want_q.view(bits))
    assert same_bits(got_k.view(bits), want_k.view(bits))
    # The module's forward takes the kernel on CUDA.
    fq, fk = rot(pos, q, k)
    assert same_bits(fq.view(bits), want_q.view(bits)) and same_bits(fk.view(bits),
                                                                          want_k.view(bits))
