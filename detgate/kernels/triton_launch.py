"""Launching a compiled Triton kernel with little host work per call (CUDA only).

`kernel[grid](...)` re-binds and re-specializes every argument, builds launch metadata and
encodes a TMA descriptor for every host tensor descriptor on every call: tens of microseconds,
more than a decode-sized matmul takes on the GPU. `Launcher` compiles one variant once through
the JIT (so Triton's own cache and specialization rules pick the binary), then calls Triton's
C launcher directly: pointers as integers, cached descriptors as the encoded objects Triton
itself would pass, no per-call device or metadata queries.

What must stay true: a Launcher is reused only for arguments that Triton would specialize the
same way as the ones it was compiled with (integer == 1 or divisible by 16, pointer alignment,
dtypes, constexprs). Each caller keys its Launchers on those properties, or marks the varying
integers `do_not_specialize`. The arithmetic is the compiled kernel's, whichever way it is
launched, so the reduction order cannot depend on the launch path. Launch hooks (profilers)
are not called on this path.
"""

from __future__ import annotations

import inspect

import torch
import triton
from triton.backends.nvidia import driver as nvidia_driver


class Unsupported(RuntimeError):
    """This Triton build's launcher does not look as expected: use the JIT path."""


def raw_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


class Launcher:
    """One compiled variant of a @triton.jit kernel, launched through Triton's C launcher.

    `args` are the example arguments it is compiled for (tensors, TensorDescriptors, ints,
    constexprs, in parameter order; the constexprs must be the last parameters). Calls then
    pass the non-constexpr arguments only, pointers as ints and tensor descriptors expanded
    (`descriptor_arg`, or `encoder(i)` for per-call ones)."""

    def __init__(self, fn, grid: tuple[int, ...], args: tuple, **options):
        kernel = fn.warmup(*args, grid=grid, **options)
        if hasattr(kernel, "result"):
            kernel = kernel.result()
        md = kernel.metadata
        if md.global_scratch_size or md.profile_scratch_size or getattr(md, "num_ctas", 1) != 1:
            raise Unsupported("kernel needs scratch memory or clusters")
        launch = kernel.run.launch  # CudaLauncher: the C launch, maybe wrapped for descriptors
        if not callable(launch):
            raise Unsupported("no launch function")
        if inspect.isfunction(launch):  # wrap_handle_tensordesc's expanding wrapper
            launch = inspect.getclosurevars(launch).nonlocals.get("launcher")
            if launch is None:
                raise Unsupported("descriptor wrapper without a launcher")
        self._launch = launch
        self._function = kernel.function
        self._coop = md.launch_cooperative_grid
        self._pdl = md.launch_pdl
        self._packed = kernel.packed_metadata
        self._desc_meta = list(getattr(md, "tensordesc_meta", None) or [])
        constexprs = set(fn.constexprs)
        first = min(constexprs) if constexprs else len(args)
        if any(i not in constexprs for i in range(first, len(args))):
            raise Unsupported("constexpr parameters must come last")
        self._tail = tuple(args[first:])
        # What follows the stream in every call: function, cooperative, PDL, global and
        # profile scratch, packed metadata, launch metadata, enter and exit hooks.
        self._head = (self._function, self._coop, self._pdl, None, None, self._packed, None,
                      None, None)

    def __call__(self, grid0: int, grid1: int, grid2: int, stream: int, *args) -> None:
        self._launch(grid0, grid1, grid2, stream, *self._head, *args, *self._tail)

    def descriptor_arg(self, i: int, desc) -> list:
        """The launcher's arguments for tensor-descriptor parameter i (in order), encoded once."""
        meta = self._desc_meta[i] if self._desc_meta else None
        return nvidia_driver.make_tensordesc_arg(desc, meta)

    def encoder(self, i: int):
        """encode(ptr, shape, strides) -> the launcher's arguments for descriptor parameter i,
        as `descriptor_arg` would give for a TensorDescriptor over that memory."""
        meta = self._desc_meta[i] if self._desc_meta else None
        if meta is None:
            def plain(ptr, shape, strides):
                return [ptr, *shape, *strides, False, *shape, *strides]
            return plain
        if meta["fp4_padded"]:
            raise Unsupported("fp4 descriptors")
        fill = triton.runtime.driver.active.utils.fill_tma_descriptor
        swizzle, elem_size, block = meta["swizzle"], meta["elem_size"], meta["block_size"]
        elem_type = nvidia_driver.TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]]

        def tma(ptr, shape, strides):
            return [fill(ptr, swizzle, elem_size, elem_type, block, shape, strides, 0),
                    *shape, *strides]
        return tma


def int_spec(*values: int) -> tuple:
    """What Triton specializes an integer argument on: == 1, divisible by 16, 64-bit."""
    return tuple(4 if v == 1 else (v % 16 == 0) | ((not -2**31 <= v < 2**31) << 1)
                 for v in values)
