"""cuBLASLt GEMMs with our matmul's bits, for row counts where cuBLAS's tiles are faster.

From 129 rows cuBLAS's Hopper kernels run up to 2.6x faster than our Triton tiles (H100,
eager, per call: gate_up_proj 75 against 109 us at 129 rows and 89 against 152 at 257,
down_proj 46 against 77 at 129, the lm_head 434 against 691 at 129 and 486 against 549 at
256, transformers' separate gate / up projection 44 against 113 at 257; equal at 1,024 and
2,048 rows of Qwen3-8B's projections; `python -m detgate.bench.cublaslt`). Decode steps of
129-256 sequences and mixed steps spend most of their time in these matmuls.
cuBLAS is not batch-invariant as torch calls it: its heuristic picks split-K
kernels at some row counts, and a split-K kernel sums each output element's K range in parts
and then adds the parts, an order that changes with the split.

Why a call here gives the bits of `matmul_triton.matmul` (whose order is fixed by construction,
see its module doc): the algorithm is asked for with no workspace and accepted only with
SPLITK_NUM 1 and reduction scheme NONE. With no workspace there is nowhere to keep partial sums
between programs (split-K and stream-K both need it), and reduction NONE excludes summing into
the output in place: every output element is one program's one accumulator over all of K. A
Hopper bf16/fp16 kernel builds that accumulator from wgmma k16 steps; when they run in
increasing k, as ours do, the bits are ours, whatever the tile. That last part is cuBLAS's
code, not ours, so it is measured, not assumed: an algorithm serves a weight shape only after
this process computed that shape with it both ways on random input and found every output
element's bits equal (`_Shape.verified`); anywhere else, or if the check fails once for a shape,
or while a CUDA graph is being captured before its algorithm was checked, or where the check's
operands would take more than VERIFY_MAX_BYTES, the Triton kernel runs. Both paths give a row
the same bits, so which one a call takes never changes an answer.

The check is per algorithm, not per row count: the heuristic picks an algorithm for each M, and
an algorithm (cublasLtMatmulAlgo_t: kernel, tile, stages, swizzle, cluster; no field of the
problem) computes every output element with the same instructions in the same k order whatever
M is: M only sets how many tiles are launched, and rows past M are zero-filled loads that reach
no stored element. A row count whose algorithm was checked at another row count is served
without a check of its own. On an H100 the lm_head's 896 row counts from 129 to 1,024 ran 33
algorithms (down_proj's 45), each checked once, every row count's bits the Triton kernel's
(tests/kernels/test_gpu_cublaslt.py); one check per row count had cost the eagerly run lm_head
about 1.5 ms at each new M.

DETGATE_CUBLASLT=0 turns the path off (Triton everywhere); DETGATE_CUBLASLT_MIN_ROWS=M moves
the lower bound (a tuning knob for benchmarks).

A caller that launches one op at a time (`matmul_triton.matmul(..., host_bound=True)`, which
set_batch_invariant_mode uses) takes the Triton launch at every row count outside a CUDA graph
capture: its forward waits on the host, not on these matmuls (see matmul_triton.matmul).
"""

from __future__ import annotations

import copy
import ctypes
import logging
import os
import threading

import torch

from detgate.kernels.bits import same_bits

log = logging.getLogger(__name__)

ENABLED = os.environ.get("DETGATE_CUBLASLT", "1") != "0"
# Row counts from which every weight shape may take cuBLASLt. Below, the Triton kernel's decode
# tiles (16-128 rows) serve: cuBLASLt's algorithms without split-K were not measured faster
# there.
MIN_ROWS = int(os.environ.get("DETGATE_CUBLASLT_MIN_ROWS", "129"))
# The check computes x [M, K] and two outputs [M, N]: larger than this, Triton serves that M
# (an lm_head's 151,936 columns at thousands of scored positions would take gigabytes).
VERIFY_MAX_BYTES = 1 << 30

# cublasLt enums (cublasLt.h, library_types.h)
_COMPUTE_32F = 68
_R_32F = 0
_DTYPES = {torch.bfloat16: 14, torch.float16: 2}  # CUDA_R_16BF, CUDA_R_16F
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_OP_N, _OP_T = 0, 1
_PREF_MAX_WORKSPACE_BYTES = 1
_CONFIG_SPLITK_NUM, _CONFIG_REDUCTION_SCHEME = 2, 3
_CONFIG_NAMES = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5,
                 "stages": 6}
_HEURISTICS = 8

_vp = ctypes.c_void_p


class _Heuristic(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


class Unavailable(RuntimeError):
    """No usable cuBLASLt in this process."""


def _library_path() -> str:
    """The libcublasLt torch itself loaded (the same copy and version as its own calls)."""
    x = torch.zeros(16, 16, device="cuda", dtype=torch.bfloat16)
    torch.nn.functional.linear(x, x)  # loads cuBLAS(Lt) if it is not yet
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcublasLt" in path:
                return path
    raise Unavailable("libcublasLt is not loaded in this process")


class _Library:
    """The few cublasLt entry points used, with their C signatures."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        c = ctypes
        lib.cublasLtCreate.argtypes = [c.POINTER(_vp)]
        lib.cublasLtMatmulDescCreate.argtypes = [c.POINTER(_vp), c.c_int, c.c_int]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [_vp, c.c_int, _vp, c.c_size_t]
        lib.cublasLtMatrixLayoutCreate.argtypes = [c.POINTER(_vp), c.c_int, c.c_uint64,
                                                   c.c_uint64, c.c_int64]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [c.POINTER(_vp)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [_vp, c.c_int, _vp, c.c_size_t]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [_vp] * 7 + [
            c.c_int, c.POINTER(_Heuristic), c.POINTER(c.c_int)]
        lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [_vp, c.c_int, _vp, c.c_size_t,
                                                             c.POINTER(c.c_size_t)]
        lib.cublasLtMatmul.argtypes = [_vp] * 14 + [c.c_size_t, _vp]
        self.lib = lib
        self.handle = _vp()
        self.ok(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.pref = _vp()
        self.ok(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "preference")
        zero = ctypes.c_uint64(0)  # no workspace: see the module doc
        self.ok(lib.cublasLtMatmulPreferenceSetAttribute(
            self.pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(zero), 8), "workspace")
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        # D = op(A) op(B), A transposed, fp32 accumulation and scale, for any 16-bit operands.
        self.desc = _vp()
        self.ok(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F),
                "matmul desc")
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            v = ctypes.c_int32(op)
            self.ok(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4),
                    "transpose")

    @staticmethod
    def ok(status: int, what: str) -> None:
        if status != 0:
            raise Unavailable(f"cublasLt {what}: status {status}")

    def layout(self, dtype: torch.dtype, rows: int, cols: int, ld: int) -> _vp:
        lay = _vp()
        self.ok(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), _DTYPES[dtype], rows,
                                                    cols, ld), "layout")
        return lay

    def config(self, algo, attr: int) -> int:
        v, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
        self.ok(self.lib.cublasLtMatmulAlgoConfigGetAttribute(
            ctypes.byref(algo), attr, ctypes.byref(v), 4, ctypes.byref(written)), "config")
        return v.value

    def candidates(self, a_layout: _vp, b_layout: _vp, d_layout: _vp,
                   count: int = _HEURISTICS) -> list:
        """The heuristic's algorithms with one K split, no reduction and no workspace, fastest
        first (copies: the results array goes away)."""
        results = (_Heuristic * count)()
        got = ctypes.c_int(0)
        status = self.lib.cublasLtMatmulAlgoGetHeuristic(
            self.handle, self.desc, a_layout, b_layout, d_layout, d_layout, self.pref,
            count, results, ctypes.byref(got))
        if status != 0:
            return []
        return [(ctypes.c_uint64 * 8)(*r.algo) for r in results[:got.value]
                if r.state == 0 and r.workspace == 0
                and self.config(r.algo, _CONFIG_SPLITK_NUM) == 1
                and self.config(r.algo, _CONFIG_REDUCTION_SCHEME) == 0]

    def algorithm(self, a_layout: _vp, b_layout: _vp, d_layout: _vp):
        """The fastest of `candidates`, or None."""
        found = self.candidates(a_layout, b_layout, d_layout)
        return found[0] if found else None

    def describe(self, algo) -> dict[str, int]:
        """An algorithm's configuration (cublasLtMatmulAlgoConfigAttributes_t) for reports."""
        return {name: self.config(algo, attr) for name, attr in _CONFIG_NAMES.items()}


_LIBRARY: _Library | None = None
_LOCK = threading.Lock()


def library() -> _Library:
    global _LIBRARY
    with _LOCK:
        if _LIBRARY is None:
            _LIBRARY = _Library(_library_path())
        return _LIBRARY


class Gemm:
    """x [M, K] @ W.T for one weight W [N, K] (rows `w_stride` apart) at one M."""

    __slots__ = ("lib", "w_ptr", "n", "a_layout", "b_layout", "d_layout", "algo")

    def __init__(self, lib: _Library, w_ptr: int, w_stride: int, n: int, k: int, m: int,
                 dtype: torch.dtype):
        self.lib, self.w_ptr, self.n = lib, w_ptr, n
        # Column-major view: W [N, K] row-major is K x N (ld w_stride), used transposed; x
        # [M, K] is K x M (ld K); D = W x^T is N x M (ld N), i.e. C [M, N] row-major.
        self.a_layout = lib.layout(dtype, k, n, w_stride)
        self.b_layout = lib.layout(dtype, k, m, k)
        self.d_layout = lib.layout(dtype, n, m, n)
        self.algo = lib.algorithm(self.a_layout, self.b_layout, self.d_layout)

    def rebind(self, w_ptr: int) -> Gemm:
        """The same call (layouts, algorithm) on another weight of the same shape and stride."""
        other = copy.copy(self)
        other.w_ptr = w_ptr
        return other

    def __call__(self, a: torch.Tensor, stream: int) -> torch.Tensor:
        c = a.new_empty((a.shape[0], self.n))
        lib = self.lib
        lib.ok(lib.lib.cublasLtMatmul(
            lib.handle, lib.desc, ctypes.byref(lib.one), self.w_ptr, self.a_layout,
            a.data_ptr(), self.b_layout, ctypes.byref(lib.zero), c.data_ptr(), self.d_layout,
            c.data_ptr(), self.d_layout, ctypes.byref(self.algo), None, 0, stream), "matmul")
        return c


class _Shape:
    """Per (N, K, row stride, dtype, device): the call served at each row count met (every
    weight of the shape runs it), the algorithms whose bits were checked equal to the Triton
    kernel's (by their bytes), and whether a check failed (then Triton serves the shape)."""

    def __init__(self):
        self.served: dict[int, Gemm] = {}
        self.verified: set[bytes] = set()
        self.failed = False


_SHAPES: dict[tuple, _Shape] = {}


def _verify(gemm: Gemm, bt: torch.Tensor, m: int, reference) -> bool:
    """Both paths on the same random x [m, K] and the weight itself: every output element's
    bits equal."""
    gen = torch.Generator(device=bt.device).manual_seed(m)
    x = torch.randn(m, bt.shape[1], device=bt.device, generator=gen).to(bt.dtype)
    return same_bits(gemm(x, torch.cuda.current_stream(bt.device).cuda_stream),
                     reference(x, bt.t()))


def gemm_for(bt: torch.Tensor, m: int, reference) -> Gemm | None:
    """A cuBLASLt call for x [m, K] @ bt.T (bt: W [N, K], 16-bit, rows 16-byte aligned) whose
    bits were found equal to `reference(x, W.t())` at this M, or None (use the reference)."""
    global ENABLED
    n, k = bt.shape
    if not ENABLED or bt.dtype not in _DTYPES or m < MIN_ROWS \
            or m * (k + 2 * n) * bt.element_size() > VERIFY_MAX_BYTES:
        return None
    key = (n, k, bt.stride(0), bt.dtype, bt.get_device())
    shape = _SHAPES.setdefault(key, _Shape())
    if shape.failed:
        return None
    served = shape.served.get(m)
    if served is not None:
        return served.rebind(bt.data_ptr())
    # No check inside a capture (Triton serves that M, same bits either way); an algorithm
    # checked before may still serve it.
    capturing = torch.cuda.is_current_stream_capturing()
    if capturing and not shape.verified:
        return None
    try:
        gemm = Gemm(library(), bt.data_ptr(), bt.stride(0), n, k, m, bt.dtype)
    except (Unavailable, OSError) as exc:
        log.warning("cuBLASLt unavailable, the Triton matmul serves every row count: %s", exc)
        ENABLED = False
        return None
    if gemm.algo is None:
        return None
    if bytes(gemm.algo) in shape.verified:  # checked at another M: see the module doc
        shape.served[m] = gemm
        return gemm
    if capturing:
        return None
    if not _verify(gemm, bt, m, reference):
        shape.failed = True
        log.warning("cuBLASLt's bits differ from the Triton matmul's for %s at %d rows: "
                    "Triton serves this shape", (n, k, bt.dtype), m)
        return None
    shape.verified.add(bytes(gemm.algo))
    shape.served[m] = gemm
    return gemm
