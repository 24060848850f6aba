"""Programmatic dependent launch (PDL) for our Triton kernels, Hopper and later.

A decode step is a chain of short kernels (per layer: norm, qkv, its norm and rotary,
attention, o_proj, norm, gate_up, silu, down), each only a few microseconds at small batch.
Normally a kernel is not even launched until the one before it has finished, so every link of
the chain pays the launch and the ramp-up of its programs. With PDL (the launch attribute
`programmaticStreamSerialization`, which CUDA graphs capture as programmatic edges) a kernel
is launched while its predecessor still runs: its programs start and then wait at
`griddepcontrol.wait` until the predecessor has completed and its memory is visible.

Every kernel of ours enters through `enter(PDL)`, before it touches global memory:
- the wait comes first, so the kernel reads nothing before its producer is done and
  overwrites nothing its predecessor may still read; a predecessor that itself waited on its
  own, so completion is transitive along the chain;
- then `launch_dependents`, so that the next kernel may be launched at once (its programs
  take only room that this kernel's programs, all started by then, left free).
Bits: nothing in a kernel's arithmetic changes, only when its programs start; each program
sees exactly the memory it would have seen without PDL, so every reduction order (and every
invariance argument beside the kernels) holds as written.

A kernel launched without the attribute (torch's, or ours with PDL off) just runs after its
predecessor as usual, and a kernel of ours after one of torch's waits for it in full: mixing
is safe. Off on the CPU and in Triton's interpreter, before sm_90, and with DETGATE_PDL=0 (a
switch for measuring it).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@triton.jit
def enter(PDL: tl.constexpr):
    """First statement of a kernel: wait for the predecessor, then let the successor launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _enabled(device: int) -> bool:
    if os.environ.get("DETGATE_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def on(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL (the kernel's `PDL` constexpr and its
    `launch_pdl` option must both be this)."""
    return t.is_cuda and _enabled(t.get_device())


def options(t: torch.Tensor) -> dict[str, bool]:
    """`kernel[grid](..., **pdl.options(t))`: the constexpr and the launch option together."""
    enabled = on(t)
    return {"PDL": enabled, "launch_pdl": enabled}
