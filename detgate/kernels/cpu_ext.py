"""Builds (once) and loads the compiled CPU kernels, csrc/cpu_kernels.cpp.

The build runs through torch's C++ extension loader: the first call compiles the source
with the flags below into torch's extension cache (`TORCH_EXTENSIONS_DIR`, by default under
~/.cache) and later calls, in any process, load the cached library in milliseconds; a changed
source or flag set builds anew. `scripts/install.sh` runs `python -m detgate.kernels.cpu_ext`
so that the first worker does not pay for the compile.

The flags are part of the invariance argument (see the source's header): no -ffast-math, no
fused multiply-add the source does not write (-ffp-contract=off), OpenMP so that
`at::parallel_for` shares torch's thread pool. Two builds exist: "native" (AVX2 + FMA, and F16C,
where this CPU has them, else the same as baseline) and "baseline" (no instruction set beyond the
platform's default); they give the same bits, which the tests check. A process runs the
native build unless DETGATE_CPU_KERNELS=baseline (how the tests run a whole worker on the
portable one).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
CFLAGS = ["-O3", "-fno-fast-math", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


class BuildError(RuntimeError):
    """The CPU kernels could not be compiled: batch_invariant mode on the CPU needs them."""


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


BUILDS = ("native", "baseline")
BUILD_ENV = "DETGATE_CPU_KERNELS"


def _x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def isa_class() -> str:
    """This CPU's instruction-set class as the native build sees it, and glibc's libm too
    (it picks FMA variants of log, exp, sin, cos, pow on x86-64 CPUs with FMA and AVX2):
    "x86-64 avx2+fma", "x86-64 baseline", or the architecture's name elsewhere."""
    if _x86():
        return "x86-64 " + ("avx2+fma" if {"avx2", "fma"} <= _cpu_flags() else "baseline")
    return platform.machine()


def cpu_flags_sha256() -> str:
    """A hash of this CPU's feature flags (/proc/cpuinfo): what BLAS libraries dispatch on."""
    import hashlib

    return hashlib.sha256(" ".join(sorted(_cpu_flags())).encode()).hexdigest()


def isa_cflags(build: str) -> list[str]:
    """Compiler flags of a build: "native" adds AVX2 + FMA on an x86 CPU that has both."""
    if build == "native" and isa_class() == "x86-64 avx2+fma":
        # F16C converts the fp16 scales of quantised weights; the portable code gives the
        # same bits (an exact conversion either way).
        return ["-mavx2", "-mfma", *(["-mf16c"] if "f16c" in _cpu_flags() else [])]
    return []


def load(build: str | None = None):
    """The compiled module (`matmul`, `matmul_quantised`, `dequantise`, `inv_rms`,
    `log_softmax`, `softmax`, `silu_and_mul`, `paged_attention`, `isa`) of `build` ("native"
    or "baseline"; None: DETGATE_CPU_KERNELS, else native); builds it on first use."""
    return _load(build) if build else _load_default()


@functools.cache
def _load_default():
    return _load(os.environ.get(BUILD_ENV) or "native")


@functools.cache
def _load(build: str):
    if build not in BUILDS:
        raise BuildError(f"unknown CPU kernel build {build!r} (from {BUILD_ENV}?); expected "
                         f"one of {BUILDS}")
    if _compiler() is None:
        raise BuildError(
            "batch_invariant mode on the CPU needs a C++ compiler to build its kernels once "
            "(none found: install g++ or clang, e.g. `apt-get install g++`, or set CXX)")
    from torch.utils import cpp_extension

    flags = isa_cflags(build)
    try:
        with _progress(f"compiling the batch-invariant CPU kernels ({build} build; once per "
                       "install or source change)"):
            return cpp_extension.load(
                name=_extension_name(flags),
                sources=[str(SOURCE)],
                extra_cflags=[*CFLAGS, *flags],
                extra_ldflags=LDFLAGS,
                verbose=False,
            )
    except (RuntimeError, OSError, ImportError) as exc:
        raise BuildError(f"building the CPU kernels ({SOURCE.name}) failed: {exc}") from exc


def _extension_name(flags: list[str]) -> str:
    """One build folder per flag set and per checkout: torch keeps a build under its name, and
    ninja rebuilds when the source path in it changes, so two checkouts (a clone beside a
    working tree, an installed copy beside a development one) sharing one name would recompile
    each other's build at every process start."""
    import hashlib

    where = hashlib.sha256(str(SOURCE.resolve()).encode()).hexdigest()[:10]
    isa = "_".join(f.lstrip("-") for f in flags) or "baseline"
    return f"detgate_cpu_kernels_{isa}_{where}"


@contextlib.contextmanager
def _progress(what: str, first_after_s: float = 2.0, every_s: float = 20.0):
    """A line on stderr when the work inside takes longer than a cached load does (a compile:
    minutes on a loaded machine), then one every `every_s` until it is done."""
    done = threading.Event()
    start = time.monotonic()

    def report() -> None:
        if done.wait(first_after_s):
            return
        print(f"detgate: {what} ...", file=sys.stderr, flush=True)
        while not done.wait(every_s):
            print(f"detgate: still {what.split(' (')[0]}: {time.monotonic() - start:.0f} s",
                  file=sys.stderr, flush=True)
        print(f"detgate: done in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)

    thread = threading.Thread(target=report, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def main() -> int:
    """`python -m detgate.kernels.cpu_ext`: build now and say which instruction set runs."""
    try:
        ext = load()
    except BuildError as exc:
        print(f"detgate: {exc}", file=sys.stderr)
        return 1
    print(f"detgate CPU kernels built ({ext.isa()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
