"""Builds (once) and loads the compiled CPU kernels, kernels/csrc/cpu_kernels.cpp.

The build runs through torch's C++ extension loader: the first call compiles the source
with the flags below into torch's extension cache (`TORCH_EXTENSIONS_DIR`, by default under
~/.cache) and later calls, in any process, load the cached library in milliseconds; a changed
source or flag set builds anew. `scripts/install.sh` runs `python -m kernels.cpu_ext` so that
the first worker does not pay for the compile.

The flags are part of the invariance argument (see the source's header): no -ffast-math, no
fused multiply-add the source does not write (-ffp-contract=off), OpenMP so that
`at::parallel_for` shares torch's thread pool. Two builds exist: "native" (AVX2 + FMA where
this CPU has them, else the same as baseline) and "baseline" (no instruction set beyond the
platform's default); they give the same bits, which the tests check.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import sys
from pathlib import Path

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
CFLAGS = ["-O3", "-fno-fast-math", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


class BuildError(RuntimeError):
    """The CPU kernels could not be compiled: batch_invariant mode on the CPU needs them."""


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa_cflags(build: str) -> list[str]:
    """Compiler flags of a build: "native" adds AVX2 + FMA on an x86 CPU that has both."""
    if build == "native" and platform.machine() in ("x86_64", "AMD64") \
            and {"avx2", "fma"} <= _cpu_flags():
        return ["-mavx2", "-mfma"]
    return []


@functools.cache
def load(build: str = "native"):
    """The compiled module (`matmul`, `inv_rms`, `log_softmax`, `silu_and_mul`,
    `paged_attention`, `isa`) of `build` ("native" or "baseline"); builds it on first use."""
    if build not in ("native", "baseline"):
        raise ValueError(f"unknown CPU kernel build {build!r}")
    if _compiler() is None:
        raise BuildError(
            "batch_invariant mode on the CPU needs a C++ compiler to build its kernels once "
            "(none found: install g++ or clang, e.g. `apt-get install g++`, or set CXX)")
    from torch.utils import cpp_extension

    flags = isa_cflags(build)
    try:
        return cpp_extension.load(
            name="detgate_cpu_kernels_" + ("_".join(f.lstrip("-") for f in flags) or "baseline"),
            sources=[str(SOURCE)],
            extra_cflags=[*CFLAGS, *flags],
            extra_ldflags=LDFLAGS,
            verbose=False,
        )
    except (RuntimeError, OSError, ImportError) as exc:
        raise BuildError(f"building the CPU kernels ({SOURCE.name}) failed: {exc}") from exc


def main() -> int:
    """`python -m kernels.cpu_ext`: build now and say which instruction set runs."""
    try:
        ext = load()
    except BuildError as exc:
        print(f"detgate: {exc}", file=sys.stderr)
        return 1
    print(f"detgate CPU kernels built ({ext.isa()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
