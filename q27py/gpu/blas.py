"""Prefill GEMMs through cuBLAS (CuPy's binding): packed weights expanded to a bf16 scratch.

For a prefill chunk of T tokens, `prefill_gemm` computes what the GEMV/GEMM kernels compute
for a packed matrix -- Y[t] (store | add | SwiGLU)= W x[t] -- as

    W  -> bf16 [rows, kpad] row-major scratch      (cuda/dequant.cu: dequant_q4 / q8 / bf16)
    x  -> bf16 [T, kpad] scratch                    (f32_to_bf16_rows)
    Y  =  x W^T   (cublasGemmEx, bf16 in, fp32 accumulate and out; beta = 1 for MODE_ADD)
    SwiGLU: Y into an fp32 scratch, then swiglu_tiles writes the inner rows.

Why not our own kernel: on the H200 cuBLAS runs these shapes at ~650 TFLOP/s, our mma.sync
GEMM at ~120 (docs/PERF.md). The expansion costs one pass over the packed bytes plus 2 bytes
written per weight, amortized over the chunk's T tokens (the engine's prefill chunk is sized
for that). Numerics: weights bf16(code * scale) instead of exact codes with the scale applied
per 64-k chunk -- a relative difference of at most 2^-9 per weight, far under the 4-bit
quantization step; the prefill tolerance class of docs/PERF.md.

Only cuBLAS through CuPy (a runtime dependency already), no other library. Every call is
enqueued on CuPy's current stream; scratch buffers grow and are kept per process.
"""

from __future__ import annotations

import numpy as np

from q27py.gpu import constants as C
from q27py.gpu import layout as L
from q27py.gpu.runtime import Runtime, i32, i64

# cublas / CUDA enums (cublas_api.h, library_types.h)
_OP_N, _OP_T = 0, 1
_R_32F, _R_16BF = 0, 14
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1

MIN_TOKENS = 128  # below this the mma.sync GEMM (no expansion pass) is faster: measured, docs/PERF.md
_ONE = np.ones(1, dtype=np.float32)
_ZERO = np.zeros(1, dtype=np.float32)


class _Scratch:
    """Growing device buffers shared by every prefill GEMM of the process (one stream at a time)."""

    def __init__(self):
        self.bufs: dict[str, object] = {}

    def get(self, name: str, nbytes: int):
        cp = Runtime.get().cp
        b = self.bufs.get(name)
        if b is None or b.nbytes < nbytes:
            self.bufs.pop(name, None)
            b = cp.empty(max(nbytes, 16) // 2 + 8, dtype=cp.uint16)
            self.bufs[name] = b
        return b


_SCRATCH = _Scratch()


def available() -> bool:
    """cuBLAS reachable through CuPy (it ships with cupy-cudaXXx's CUDA libraries)."""
    try:
        from cupy_backends.cuda.libs import cublas  # noqa: F401

        return True
    except Exception:
        return False


def _handle():
    cp = Runtime.get().cp
    from cupy_backends.cuda.libs import cublas

    h = cp.cuda.device.get_cublas_handle()
    cublas.setStream(h, cp.cuda.get_current_stream().ptr)
    cublas.setPointerMode(h, 0)  # CUBLAS_POINTER_MODE_HOST: alpha/beta are host floats (CuPy may leave DEVICE set)
    return cublas, h


def dequantize_to_bf16(m, out=None):
    """Packed GpuMatrix -> bf16 bits [row_tiles * 16, kpad] (row-major, padded rows/k are zero codes)."""
    rt = Runtime.get()
    sh = m.shape
    nrows = sh.row_tiles * 16
    if out is None:
        out = _SCRATCH.get("w", nrows * sh.kpad * 2)
    kern = {L.FMT_Q4: "dequant_q4", L.FMT_Q8: "dequant_q8", L.FMT_BF16: "dequant_bf16"}[sh.fmt]
    nblk = sh.row_tiles * sh.kchunks
    rt.launch("dequant", kern, -(-nblk // C.DQ_WARPS), 32 * C.DQ_WARPS,
              (m.codes, m.scales, i32(sh.row_tiles), i32(sh.kchunks), i32(sh.groups), i32(sh.group_chunks), out,
               i64(sh.kpad)))
    return out


def to_bf16(x, ldx: int, ntok: int, cols: int, out=None, ldo: int | None = None):
    rt = Runtime.get()
    ldo = cols if ldo is None else ldo
    if out is None:
        out = _SCRATCH.get("x", ntok * ldo * 2)
    rt.launch("dequant", "f32_to_bf16_rows", (-(-cols // 1024), ntok), 256, (x, i32(ldx), i32(cols), out, i32(ldo)))
    return out


def gemm_bf16(w_bf16, ldw: int, x_bf16, ldx: int, ntok: int, nrows: int, k: int, y, ldy: int, accumulate: bool) -> None:
    """y[t][r] (+)= sum_k W[r][k] x[t][k] for r < nrows, t < ntok: bf16 operands, fp32 math and output.

    Row-major W [nrows, ldw] is column-major [ldw, nrows], so in cuBLAS terms C(nrows x ntok,
    ldc = ldy) = op_T(W) (nrows x k) . X (k x ntok, ldb = ldx).
    """
    cublas, h = _handle()
    beta = _ONE if accumulate else _ZERO
    cublas.gemmEx(h, _OP_T, _OP_N, int(nrows), int(ntok), int(k), _ONE.ctypes.data, int(w_bf16.data.ptr), _R_16BF,
                  int(ldw), int(x_bf16.data.ptr), _R_16BF, int(ldx), beta.ctypes.data, int(y.data.ptr), _R_32F,
                  int(ldy), _COMPUTE_32F, _GEMM_DEFAULT)


def prefill_gemm(m, x, ldx: int, ntok: int, y, ldy: int, x_bf16=None) -> None:
    """The GEMM kernel's contract (kernels.gemm) through cuBLAS: MODE_STORE, MODE_ADD or MODE_SWIGLU.

    x_bf16: the activations already converted (matrices of one plan share them), else converted here.
    """
    sh = m.shape
    if x_bf16 is None:
        x_bf16 = to_bf16(x, ldx, ntok, sh.kpad)
    w = dequantize_to_bf16(m)
    if m.mode == C.MODE_SWIGLU:
        nrows = sh.row_tiles * 16
        z = _SCRATCH.get("z", ntok * nrows * 4).view(Runtime.get().cp.float32)
        gemm_bf16(w, sh.kpad, x_bf16, sh.kpad, ntok, nrows, sh.kpad, z, nrows, accumulate=False)
        Runtime.get().launch("dequant", "swiglu_tiles", (-(-m.nout // 256), ntok), 256,
                             (z, i32(nrows), i32(m.nout), y, i32(ldy)))
    else:
        gemm_bf16(w, sh.kpad, x_bf16, sh.kpad, ntok, m.nout, sh.kpad, y, ldy, accumulate=m.mode == C.MODE_ADD)


# ---------------------------------------------------------------- fp8 route (EngineConfig.prefill_gemm "fp8")
# Weights and activations as e4m3 with power-of-two scales, multiplied by cuBLASLt (blaslt.py):
# cuda/dequant.cu "fp8 prefill route" says why the scales are where they are. sm_89+ only.
_MAX_CODE = {L.FMT_Q4: 8.0, L.FMT_Q8: 128.0}


def weight_fp8_exponent(m) -> int:
    """The matrix's one power-of-two exponent ew: max |code * scale| * 2^-ew in [128, 256)
    (cuda/common.cuh fp8_row_exponent). Read once per matrix (a device max, then cached)."""
    if m.fp8_exp is None:
        cp = Runtime.get().cp
        amax = float(cp.abs(m.scales.view(cp.float16).astype(cp.float32)).max()) * _MAX_CODE[m.shape.fmt]
        m.fp8_exp = 0 if not amax > 0 else int(np.frexp(amax)[1]) - 8
    return m.fp8_exp


def dequantize_to_fp8(m, out=None):
    """Packed GpuMatrix -> e4m3 codes [row_tiles * 16, kpad] of code * scale * 2^-ew (and ew)."""
    rt = Runtime.get()
    sh = m.shape
    e = weight_fp8_exponent(m)
    if out is None:
        out = _SCRATCH.get("w8", sh.row_tiles * 16 * sh.kpad).view(rt.cp.uint8)
    kern = {L.FMT_Q4: "dequant_q4_fp8", L.FMT_Q8: "dequant_q8_fp8"}[sh.fmt]
    nblk = sh.row_tiles * sh.kchunks
    rt.launch("dequant", kern, -(-nblk // C.DQ_WARPS), 32 * C.DQ_WARPS,
              (m.codes, m.scales, i32(sh.row_tiles), i32(sh.kchunks), i32(sh.groups), i32(sh.group_chunks),
               np.float32(2.0 ** -e), out, i64(sh.kpad)))
    return out, e


def to_fp8(x, ldx: int, ntok: int, cols: int, ldo: int):
    """Activations fp32 -> (e4m3 codes [ntok][ldo], fp32 power-of-two scale per token)."""
    rt = Runtime.get()
    cp = rt.cp
    codes = _SCRATCH.get("x8", ntok * ldo).view(cp.uint8)
    scale = _SCRATCH.get("xs8", ntok * 4).view(cp.float32)
    rt.launch("dequant", "f32_to_fp8_rows", ntok, 1024, (x, i32(ldx), i32(cols), codes, i32(ldo), scale))
    return codes, scale


def fp8_available() -> bool:
    from q27py.gpu import blaslt

    return blaslt.available()


def prefill_gemm_fp8(m, x, ldx: int, ntok: int, y, ldy: int, x8=None) -> None:
    """prefill_gemm's contract on the fp8 route. x8: (codes, scales) of x already made (a plan's
    matrices share them), else made here."""
    from q27py.gpu import blaslt

    rt = Runtime.get()
    sh = m.shape
    if x8 is None:
        x8 = to_fp8(x, ldx, ntok, sh.kpad, sh.kpad)
    codes, scale = x8
    w8, e = dequantize_to_fp8(m)
    lt = blaslt.Lt.get()
    alpha = float(2.0 ** e)
    if m.mode == C.MODE_SWIGLU:
        nrows = sh.row_tiles * 16
        z = _SCRATCH.get("z", ntok * nrows * 4).view(rt.cp.float32)
        lt.matmul_fp8(w8, sh.kpad, codes, sh.kpad, nrows, ntok, sh.kpad, z, nrows, alpha, accumulate=False)
        rt.launch("dequant", "swiglu_tiles_scaled", (-(-m.nout // 256), ntok), 256,
                  (z, i32(nrows), i32(m.nout), y, i32(ldy), scale))
        return
    grid = (-(-m.nout // 1024), ntok)
    add = m.mode == C.MODE_ADD
    if add:  # y + s D = s (y / s + D): exact for powers of two, so the residual keeps its bits
        rt.launch("dequant", "fp8_scale_rows", grid, 256, (y, i32(ldy), i32(m.nout), scale, i32(1)))
    lt.matmul_fp8(w8, sh.kpad, codes, sh.kpad, m.nout, ntok, sh.kpad, y, ldy, alpha, accumulate=add)
    rt.launch("dequant", "fp8_scale_rows", grid, 256, (y, i32(ldy), i32(m.nout), scale, i32(0)))
