"""cuBLASLt's fp8 GEMM through ctypes: the one library call of the fp8 prefill route (blas.prefill_gemm_fp8).

CuPy binds cuBLAS but not cuBLASLt, and only cuBLASLt multiplies e4m3 operands. The library is
the one CuPy's cuBLAS already loaded (libcublasLt ships beside it in every CUDA 12 / 13 install),
so this adds no dependency: ctypes, a handle, and per shape one matmul descriptor, four layouts
and the heuristic's first algorithm, cached. sm_89+ only (fp8 tensor cores); callers check.

The call, column-major as cuBLASLt sees row-major buffers (the same mapping as blas.gemm_bf16):
D (nrows x ntok, ld ldy, fp32) = alpha * op_T(W) (nrows x k) . X (k x ntok) + beta * C, with
W e4m3 [nrows][k] row-major, X e4m3 [ntok][k] row-major, C = D (beta 1 accumulates in place).
FP8 needs this "TN" form, 16-byte aligned pointers and k, ld multiples of 16.
"""

from __future__ import annotations

import ctypes

import numpy as np

from q27py.gpu.runtime import Runtime

# cublasLt.h / library_types.h / cublas_api.h values
_R_32F, _R_8F_E4M3 = 0, 28
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_FAST_ACCUM = 25
_PREF_MAX_WORKSPACE_BYTES = 1
WORKSPACE_BYTES = 32 << 20


class _Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class LtError(RuntimeError):
    pass


def _load():
    from cupy_backends.cuda.libs import cublas  # noqa: F401  (loads libcublas and with it libcublasLt)

    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        return ctypes.CDLL(load_nvidia_dynamic_lib("cublasLt").abs_path)
    except Exception as exc:  # no cuBLASLt on this machine
        raise LtError(f"libcublasLt not found ({exc})") from None


class Lt:
    """One per process (Lt.get()): the handle, a workspace and the per-shape plans."""

    _instance: "Lt | None" = None

    def __init__(self):
        self.lib = _load()
        L = self.lib
        for fn in ("cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescSetAttribute",
                   "cublasLtMatrixLayoutCreate", "cublasLtMatmulPreferenceCreate",
                   "cublasLtMatmulPreferenceSetAttribute", "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul"):
            getattr(L, fn).restype = ctypes.c_int
        L.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                                                 ctypes.c_uint64, ctypes.c_int64]
        L.cublasLtMatmulDescSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
        L.cublasLtMatmulPreferenceSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                                           ctypes.c_size_t]
        L.cublasLtMatmul.argtypes = [ctypes.c_void_p] * 16
        self.handle = ctypes.c_void_p()
        self._check(L.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        cp = Runtime.get().cp
        self.workspace = cp.empty(WORKSPACE_BYTES, dtype=cp.uint8)
        self.pref = ctypes.c_void_p()
        self._check(L.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "PreferenceCreate")
        ws = ctypes.c_size_t(WORKSPACE_BYTES)
        self._check(L.cublasLtMatmulPreferenceSetAttribute(self.pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                           ctypes.sizeof(ws)), "PreferenceSetAttribute")
        self.plans: dict = {}

    @classmethod
    def get(cls) -> "Lt":
        if cls._instance is None:
            cls._instance = Lt()
        return cls._instance

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise LtError(f"{what} failed with cublasStatus {rc}")

    def _layout(self, dtype: int, rows: int, cols: int, ld: int):
        lay = ctypes.c_void_p()
        self._check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, rows, cols, ld), "LayoutCreate")
        return lay

    def _plan(self, nrows: int, ntok: int, k: int, ldw: int, ldx: int, ldy: int, fast_accum: bool):
        key = (nrows, ntok, k, ldw, ldx, ldy, fast_accum)
        p = self.plans.get(key)
        if p is not None:
            return p
        L = self.lib
        desc = ctypes.c_void_p()
        self._check(L.cublasLtMatmulDescCreate(ctypes.byref(desc), _COMPUTE_32F, _R_32F), "MatmulDescCreate")
        for attr, val in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            v = ctypes.c_int32(val)
            self._check(L.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), 4), "DescSetAttribute")
        fa = ctypes.c_int8(1 if fast_accum else 0)
        self._check(L.cublasLtMatmulDescSetAttribute(desc, _DESC_FAST_ACCUM, ctypes.byref(fa), 1), "fast accum")
        a = self._layout(_R_8F_E4M3, k, nrows, ldw)  # W^T as stored: k x nrows, column-major
        b = self._layout(_R_8F_E4M3, k, ntok, ldx)
        c = self._layout(_R_32F, nrows, ntok, ldy)
        res = _Heuristic()
        n = ctypes.c_int(0)
        self._check(L.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, self.pref, 1, ctypes.byref(res),
                                                     ctypes.byref(n)), "AlgoGetHeuristic")
        if n.value < 1:
            raise LtError(f"no cuBLASLt fp8 algorithm for {nrows}x{ntok}x{k}")
        p = (desc, a, b, c, res)
        self.plans[key] = p
        return p

    def matmul_fp8(self, w8, ldw: int, x8, ldx: int, nrows: int, ntok: int, k: int, y, ldy: int, alpha: float,
                   accumulate: bool, fast_accum: bool = False) -> None:
        """y (+)= alpha * x8 . w8^T on CuPy's current stream (see the module docstring)."""
        desc, a, b, c, res = self._plan(nrows, ntok, k, ldw, ldx, ldy, fast_accum)
        al = np.array([alpha], dtype=np.float32)
        be = np.array([1.0 if accumulate else 0.0], dtype=np.float32)
        stream = Runtime.get().cp.cuda.get_current_stream().ptr
        vp = ctypes.c_void_p
        rc = self.lib.cublasLtMatmul(self.handle, desc, vp(al.ctypes.data), vp(int(w8.data.ptr)), a,
                                     vp(int(x8.data.ptr)), b, vp(be.ctypes.data), vp(int(y.data.ptr)), c,
                                     vp(int(y.data.ptr)), c, vp(ctypes.addressof(res)), vp(int(self.workspace.data.ptr)),
                                     vp(WORKSPACE_BYTES), vp(int(stream)))
        self._check(rc, "cublasLtMatmul")


def available() -> bool:
    try:
        return Runtime.get().cc >= (8, 9) and Lt.get() is not None
    except Exception:
        return False
