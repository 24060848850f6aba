"""SwiGLU's silu(gate) * up in one Triton launch (CUDA), bit for bit what torch computes as
`F.silu(gate) * up` in two:

    silu(g) = g / (1 + exp(-g)) in fp32 (IEEE division, libdevice's expf, as torch's CUDA
              kernel), rounded to the model's dtype;
    out     = silu(g) * up in fp32, rounded to the model's dtype (for 16-bit inputs the product
              is exact in fp32, so this is torch's 16-bit multiply).

Pointwise: an element's bits depend on its gate and up values alone, whatever the batch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from detgate.kernels import pdl

_SUPPORTED = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = 1024

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter has no libdevice: numpy's exp
    @triton.jit
    def _exp(x):
        return tl.exp(x)
else:  # tl.exp would be the approximate ex2.approx; libdevice's expf is what CUDA C++ calls
    @triton.jit
    def _exp(x):
        return libdevice.exp(x)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, size, stride_x, stride_out, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    pdl.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    dtype = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + _exp(-g)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = (gate | up) -> silu(gate) * up [..., I] in x's dtype."""
    if x.dtype not in _SUPPORTED or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul wants [..., 2I] in {_SUPPORTED}, got "
                         f"{tuple(x.shape)} {x.dtype}")
    size = x.shape[-1] // 2
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], size), dtype=x.dtype, device=x.device)
    if x2.shape[0] and size:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(size, BLOCK))](
            x2, out, size, x2.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4,
            enable_fp_fusion=False, **pdl.options(x2))
    return out.view(*x.shape[:-1], size)
