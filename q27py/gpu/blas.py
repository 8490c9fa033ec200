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

import weakref

import numpy as np

from q27py.gpu import constants as C
from q27py.gpu import layout as L
from q27py.gpu.runtime import Runtime, i32, i64, profile_mark

# cublas / CUDA enums (cublas_api.h, library_types.h)
_OP_N, _OP_T = 0, 1
_R_32F, _R_16BF = 0, 14
_COMPUTE_32F = 68
_COMPUTE_32F_PEDANTIC = 69  # fp32 FMA only: never TF32, whatever the handle's math mode
_GEMM_DEFAULT = -1

MIN_TOKENS = 128  # below this the mma.sync GEMM (no expansion pass) is faster: measured, docs/PERF.md
# resident_route: the same for 32-127-token chunks when the matrix's expansion is resident. Measured
# (device run g6, tools/prefill_profile.py): the warm turn's 105-token piece went 53.5 ms (mma.sync
# GEMM) -> 44 ms (cuBLAS at ~1.1 TB/s on these thin shapes), TTFT 206.0 -> 205.7 ms: not wired in
# (kernels.gemm keeps MIN_TOKENS), kept with its test for the next study of thin-chunk GEMMs.
MIN_TOKENS_RESIDENT = 32


def resident_route(m, ntok: int) -> bool:
    """A chunk of MIN_TOKENS_RESIDENT..MIN_TOKENS tokens takes cuBLAS when m's expansion is served
    by the weight cache."""
    if not MIN_TOKENS_RESIDENT <= ntok < MIN_TOKENS:
        return False
    c = weight_cache()
    return c is not None and c.serves(m)
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


_AVAILABLE: bool | None = None


def available() -> bool:
    """cuBLAS reachable through CuPy (it ships with cupy-cudaXXx's CUDA libraries). Asked once: the prefill's
    route checks call this for every matrix of every chunk."""
    global _AVAILABLE
    if _AVAILABLE is None:
        try:
            from cupy_backends.cuda.libs import cublas  # noqa: F401

            _AVAILABLE = True
        except Exception:
            _AVAILABLE = False
    return _AVAILABLE


def _handle():
    cp = Runtime.get().cp
    from cupy_backends.cuda.libs import cublas

    h = cp.cuda.device.get_cublas_handle()
    cublas.setStream(h, cp.cuda.get_current_stream().ptr)
    cublas.setPointerMode(h, 0)  # CUBLAS_POINTER_MODE_HOST: alpha/beta are host floats (CuPy may leave DEVICE set)
    return cublas, h


def expanded_bytes(m) -> int:
    """Bytes of a packed matrix's bf16 expansion: [row_tiles * 16, kpad]."""
    return m.shape.row_tiles * 16 * m.shape.kpad * 2


def dequantize_to_bf16(m, out=None):
    """Packed GpuMatrix -> bf16 bits [row_tiles * 16, kpad] (row-major, padded rows/k are zero codes)."""
    rt = Runtime.get()
    sh = m.shape
    if out is None:
        out = _SCRATCH.get("w", expanded_bytes(m))
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


def gemm_bf16(w_bf16, ldw: int, x_bf16, ldx: int, ntok: int, nrows: int, k: int, y, ldy: int, accumulate: bool,
              out_bf16: bool = False) -> None:
    """y[t][r] (+)= sum_k W[r][k] x[t][k] for r < nrows, t < ntok: bf16 operands, fp32 math and output.

    Row-major W [nrows, ldw] is column-major [ldw, nrows], so in cuBLAS terms C(nrows x ntok,
    ldc = ldy) = op_T(W) (nrows x k) . X (k x ntok, ldb = ldx).
    out_bf16: y is uint16 and receives C as bf16 (EngineConfig.prefill_gate_up_bf16): only C's type changes
    (CUDA_R_16BF); the compute type stays CUBLAS_COMPUTE_32F (fp32 accumulation, fp32 alpha / beta), so
    each output is the fp32 sum converted once (cuBLAS's epilogue rounds to nearest: the GPU test checks
    it against the fp32 output rounded to nearest even). Never accumulating (beta 0).
    """
    assert not (accumulate and out_bf16), "the bf16 output is written, never accumulated into"
    cublas, h = _handle()
    beta = _ONE if accumulate else _ZERO
    cublas.gemmEx(h, _OP_T, _OP_N, int(nrows), int(ntok), int(k), _ONE.ctypes.data, int(w_bf16.data.ptr), _R_16BF,
                  int(ldw), int(x_bf16.data.ptr), _R_16BF, int(ldx), beta.ctypes.data, int(y.data.ptr),
                  _R_16BF if out_bf16 else _R_32F, int(ldy), _COMPUTE_32F, _GEMM_DEFAULT)
    # FLOPs as run (padded rows / k); the bf16-output GEMM under its own label, so a profile tells them apart
    profile_mark("cublas:gemm_bf16_out16" if out_bf16 else "cublas:gemm_bf16", 2.0 * nrows * ntok * k)


class ExpandAhead:
    """EngineConfig.prefill_expand_ahead: the next matrix's bf16 expansion runs on a side stream while
    the current matrix's GEMM runs, into the other of two weight buffers (double buffering), instead
    of expansion and GEMM taking turns on one stream (~20 ms of expansion per 27B pass, once per
    prefill chunk or interleaved piece: docs/PERF.md).

    Which matrix comes next is learned: the prefill calls its GEMMs in the same order every chunk,
    so the matrix that followed m last time is expanded ahead after m's GEMM is enqueued; a wrong
    guess costs only that expansion (the matrix actually asked for is expanded in stream order).
    Ordering, with buffers b = 0 / 1 alternating:
      main:  wait(expanded[b]) -> GEMM(buf b) -> record read[b]
      side:  wait(read[1 - b]) -> expand(next, buf 1 - b) -> record expanded[1 - b]
    so a buffer is never rewritten before the GEMM that reads it has run, and never read before its
    expansion is done. The same bits: the expansion and the GEMM are the same launches.
    """

    def __init__(self):
        # id(matrix) -> (weakref to it, weakref to the matrix whose GEMM came after it last time):
        # weak, so a dropped model's matrices (and their device memory) are not kept alive here
        self.next_of: dict[int, tuple] = {}
        self.last = None  # weakref to the previous call's matrix
        self.slot = 0  # the buffer the coming GEMM uses when nothing was expanded ahead for it
        self.pending = None  # (matrix, buffer, event): an expansion issued on the side stream
        self.bufs: list = [None, None]
        self.side = None
        # events are reused (a wait binds the event's latest record when it is enqueued): per buffer
        # one for "the main stream has read it", one for "its expansion is done"; an event exists
        # once it has been recorded
        self._ev_read: list = [None, None]
        self._ev_done: list = [None, None]

    def _event(self, pool: list, b: int):
        if pool[b] is None:
            pool[b] = Runtime.get().cp.cuda.Event(disable_timing=True)
        return pool[b]

    def _buffer(self, b: int, nbytes: int):
        buf = self.bufs[b]
        if buf is None or buf.nbytes < nbytes:
            cp = Runtime.get().cp
            # growing frees the old buffer: nothing may still be reading or writing it
            cp.cuda.get_current_stream().synchronize()
            if self.side is not None:
                self.side.synchronize()
            self.bufs[b] = None
            buf = cp.empty(max(nbytes, 16) // 2 + 8, dtype=cp.uint16)
            self.bufs[b] = buf
        return buf

    def weights(self, m):
        """m's bf16 expansion for a GEMM about to be enqueued on the current stream: (buffer, b).
        Call release(b) right after enqueueing that GEMM."""
        cp = Runtime.get().cp
        main = cp.cuda.get_current_stream()
        prev = self.last() if self.last is not None else None
        if prev is not None:
            self.next_of[id(prev)] = (self.last, weakref.ref(m))
        self.last = weakref.ref(m)
        nbytes = expanded_bytes(m)
        if self.pending is not None and self.pending[0] is m:
            _, b, ev = self.pending
            main.wait_event(ev)
        else:
            if self.pending is not None:  # a wrong guess: its buffer is the one about to be written
                main.wait_event(self.pending[2])
            b = self.slot
            dequantize_to_bf16(m, out=self._buffer(b, nbytes))
        self.pending = None
        self.slot = 1 - b
        return self.bufs[b], b

    def release(self, b: int, m) -> None:
        """The GEMM reading buffer b is enqueued: record it, then expand m's predicted successor into
        the other buffer on the side stream."""
        cp = Runtime.get().cp
        main = cp.cuda.get_current_stream()
        self._event(self._ev_read, b).record(main)
        link = self.next_of.get(id(m))
        nxt = link[1]() if link is not None and link[0]() is m else None
        if nxt is None:
            return
        o = 1 - b
        buf = self._buffer(o, expanded_bytes(nxt))
        if self.side is None:
            self.side = cp.cuda.Stream(non_blocking=True)
        if self._ev_read[o] is not None:
            self.side.wait_event(self._ev_read[o])
        with self.side:
            dequantize_to_bf16(nxt, out=buf)
        done = self._event(self._ev_done, o)
        done.record(self.side)
        self.pending = (nxt, o, done)


_EXPAND_AHEAD: ExpandAhead | None = None
_EXPAND_AHEAD_SET = False


def expand_ahead() -> ExpandAhead | None:
    """The process's ExpandAhead when EngineConfig.prefill_expand_ahead (env Q27_PREFILL_EXPAND_AHEAD)
    is on, else None; read once (set_expand_ahead overrides)."""
    if not _EXPAND_AHEAD_SET:
        from q27py.config import engine_env

        set_expand_ahead(engine_env().prefill_expand_ahead)
    return _EXPAND_AHEAD


def set_expand_ahead(on: bool) -> None:
    global _EXPAND_AHEAD, _EXPAND_AHEAD_SET
    _EXPAND_AHEAD = ExpandAhead() if on else None
    _EXPAND_AHEAD_SET = True


class ExpansionCache:
    """EngineConfig.prefill_weight_cache_gb: bf16 expansions kept resident, one per matrix, so the
    prefill chunks and interleaved pieces after a matrix's first skip its expansion.

    Why: the expansion is ~20 ms per 27B pass (13.7 GB read, 49.5 GB written), paid by every chunk and
    every interleaved piece; beside a 32K prefill a 384-token piece is ~85 ms, of which ~20 is the
    expansion, and expanding ahead on a side stream did not overlap it (both kernels fill the GPU:
    docs/PERF.md, e2). On a card with room (the 27B's 49.5 GB = 46.1 GiB of expansions on an H200) the cost goes.
    Matrices are admitted in first-use order until the budget is full (every matrix runs once per
    chunk, so any set of that size saves the same); nothing is evicted; a matrix that is freed (its
    model dropped) frees its expansion; an allocation that fails stops admission (the route falls
    back to the scratch). A cached expansion is the same launch into a different buffer: same bits.
    alloc / expand are the device calls (CPU tests pass stand-ins); size is a matrix's buffer bytes
    (the bf16 expansion's; the fp32 copies of prefill_gemm_f32 pass their own)."""

    def __init__(self, budget_bytes: int, alloc=None, expand=None, size=None):
        self.budget = max(0, int(budget_bytes))
        self.used = 0
        self.full = False  # an allocation failed: admit nothing more
        self.hits = self.misses = 0
        self._entries: dict[int, tuple] = {}  # id(matrix) -> (weakref to it, buffer, bytes)
        self._alloc = alloc or self._device_alloc
        self._expand = expand or (lambda m, out: dequantize_to_bf16(m, out=out))
        self._size = size or expanded_bytes

    @staticmethod
    def _device_alloc(nbytes: int):
        cp = Runtime.get().cp
        try:
            return cp.empty(max(nbytes, 16) // 2 + 8, dtype=cp.uint16)
        except cp.cuda.memory.OutOfMemoryError:
            return None

    def get(self, m):
        """m's resident expansion (made now if it fits), or None: expand into the scratch as before."""
        e = self._entries.get(id(m))
        if e is not None and e[0]() is m:
            self.hits += 1
            return e[1]
        self.misses += 1
        n = self._size(m)
        if self.full or self.used + n > self.budget:
            return None
        buf = self._alloc(n)
        if buf is None:
            self.full = True
            return None
        self._expand(m, buf)
        key = id(m)
        self._entries[key] = (weakref.ref(m, lambda _ref, key=key: self._drop(key)), buf, n)
        self.used += n
        return buf

    def serves(self, m) -> bool:
        """Whether get(m) returns a resident expansion (held now, or admitted on this call), with no
        side effect: the route choice below depends on it, not on which requests came before."""
        e = self._entries.get(id(m))
        if e is not None and e[0]() is m:
            return True
        return not self.full and self.used + self._size(m) <= self.budget

    def _drop(self, key: int) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            self.used -= e[2]

    def __len__(self) -> int:
        return len(self._entries)


_WEIGHT_CACHE: ExpansionCache | None = None
_WEIGHT_CACHE_SET = False


def weight_cache() -> ExpansionCache | None:
    """The process's ExpansionCache, or None when off. Models built directly (benches, tests) get
    EngineConfig.prefill_weight_cache_gb (env Q27_PREFILL_WEIGHT_CACHE_GB) as its budget, read once;
    load_fast_model sets it from the engine's config, capped at the model's expansions."""
    if not _WEIGHT_CACHE_SET:
        from q27py.config import engine_env

        set_weight_cache(weight_cache_budget(engine_env().prefill_weight_cache_gb, 1 << 62))
    return _WEIGHT_CACHE


def weight_cache_budget(gb: float, total_bytes: int) -> int:
    """The bytes EngineConfig.prefill_weight_cache_gb reserves: at most every expansion's (total_bytes).
    "auto" is 0 here: forward.configure_memory sizes it with the slots (models built directly, as the
    benches and tests build them, keep it off unless they ask)."""
    if gb == "auto":
        return 0
    return min(int(float(gb) * (1 << 30)), int(total_bytes)) if gb and gb > 0 else 0


def set_weight_cache(budget_bytes: int) -> None:
    """Start the process's expansion cache with this budget (0: off; replaces an existing one)."""
    global _WEIGHT_CACHE, _WEIGHT_CACHE_SET
    _WEIGHT_CACHE = ExpansionCache(budget_bytes) if budget_bytes > 0 else None
    _WEIGHT_CACHE_SET = True


def prefill_gemm(m, x, ldx: int, ntok: int, y, ldy: int, x_bf16=None, y_bf16=None, z_bf16: bool = False) -> None:
    """The GEMM kernel's contract (kernels.gemm) through cuBLAS: MODE_STORE, MODE_ADD or MODE_SWIGLU.

    x_bf16: the activations already as bf16 rows of kpad (their producer wrote them, or the plan
    converted once for all its matrices), else converted here. y_bf16 (MODE_SWIGLU only): a 2-D
    uint16 array whose rows receive the SwiGLU output as bf16 (the down projection's input) instead
    of y: the bytes to_bf16 would make of y's rows. z_bf16 (MODE_SWIGLU only; kernels.PREFILL_GATE_UP_BF16):
    cuBLAS writes the gate / up rows as bf16 instead of fp32 and SwiGLU reads those (_gemm_expanded).
    """
    sh = m.shape
    if x_bf16 is None:
        x_bf16 = to_bf16(x, ldx, ntok, sh.kpad)
    cache = weight_cache()
    resident = cache.get(m) if cache is not None else None
    if resident is not None:
        _gemm_expanded(m, resident, x_bf16, ntok, y, ldy, y_bf16, z_bf16)
        return
    ahead = expand_ahead()
    if ahead is not None:
        w, slot = ahead.weights(m)
    else:
        w = dequantize_to_bf16(m)
    _gemm_expanded(m, w, x_bf16, ntok, y, ldy, y_bf16, z_bf16)
    if ahead is not None:
        ahead.release(slot, m)


def _gemm_expanded(m, w, x_bf16, ntok: int, y, ldy: int, y_bf16=None, z_bf16: bool = False) -> None:
    sh = m.shape
    assert y_bf16 is None or m.mode == C.MODE_SWIGLU, "only the SwiGLU epilogue writes bf16 rows"
    assert not z_bf16 or m.mode == C.MODE_SWIGLU, "only the SwiGLU GEMM writes its rows as bf16"
    if z_bf16:
        # EngineConfig.prefill_gate_up_bf16 (on by default; docs/QUANT.md "bf16 gate_up before SwiGLU"): the gate /
        # up rows as bf16 (fp32 accumulation, one round to nearest each), then SwiGLU on them (cuda/dequant.cu
        # swiglu_tiles_zbf16*): half the bytes written by the GEMM and read by SwiGLU. The rows live in the fp32
        # route's "z" scratch (the same buffer, half of it used), so the route needs no memory of its own.
        nrows = sh.row_tiles * 16
        z = _SCRATCH.get("z", ntok * nrows * 2)
        gemm_bf16(w, sh.kpad, x_bf16, sh.kpad, ntok, nrows, sh.kpad, z, nrows, accumulate=False, out_bf16=True)
        grid = (-(-m.nout // 2048), ntok)  # a thread per 8 outputs (one 16-row tile), 256 threads
        if y_bf16 is not None:
            Runtime.get().launch("dequant", "swiglu_tiles_zbf16_bf16", grid, 256,
                                 (z, i32(nrows), i32(m.nout), y_bf16, i32(y_bf16.shape[1])))
        else:
            Runtime.get().launch("dequant", "swiglu_tiles_zbf16", grid, 256, (z, i32(nrows), i32(m.nout), y, i32(ldy)))
        return
    if m.mode == C.MODE_SWIGLU:
        nrows = sh.row_tiles * 16
        z = _SCRATCH.get("z", ntok * nrows * 4).view(Runtime.get().cp.float32)
        gemm_bf16(w, sh.kpad, x_bf16, sh.kpad, ntok, nrows, sh.kpad, z, nrows, accumulate=False)
        if y_bf16 is not None:
            Runtime.get().launch("dequant", "swiglu_tiles_bf16", (-(-m.nout // 512), ntok), 256,
                                 (z, i32(nrows), i32(m.nout), y_bf16, i32(y_bf16.shape[1])))
        else:
            Runtime.get().launch("dequant", "swiglu_tiles", (-(-m.nout // 256), ntok), 256,
                                 (z, i32(nrows), i32(m.nout), y, i32(ldy)))
    else:
        gemm_bf16(w, sh.kpad, x_bf16, sh.kpad, ntok, m.nout, sh.kpad, y, ldy, accumulate=m.mode == C.MODE_ADD)


# ---------------------------------------------------------------- small bf16 matrices: an fp32 GEMM
# The GDN gates' [in_proj_b; in_proj_a] (96 x 5120) stay bf16 in every tier and on the GEMV, whose hi + lo
# activations keep fp32-grade products, because the decay / beta gates are sensitive. A prefill chunk
# used to run them as the GEMV in blocks of 16 lanes: 256 launches per 4,096-token chunk and layer
# (~12K per chunk on the 27B, ~60 ms). An exact fp32 copy of the weights and one fp32 GEMM (fp32 FMA,
# never TF32) is at least as exact and one launch. Only matrices up to F32_MAX_BYTES get a copy (the
# bf16 tier's big matrices stay on the GEMV: their fp32 copies would double the model).
F32_MAX_BYTES = 64 << 20


def _f32_bytes(m) -> int:
    return m.shape.row_tiles * 16 * m.shape.kpad * 4


def f32_route(m) -> bool:
    """Whether a bf16 matrix's prefill GEMM can take prefill_gemm_f32."""
    return m.shape.fmt == L.FMT_BF16 and m.mode != C.MODE_SWIGLU and _f32_bytes(m) <= F32_MAX_BYTES


def _expand_f32(m, out) -> None:
    """out (a uint16 buffer of _f32_bytes(m)) <- the matrix as fp32 [row_tiles * 16, kpad] (exact)."""
    cp = Runtime.get().cp
    n = m.shape.row_tiles * 16 * m.shape.kpad
    bits = dequantize_to_bf16(m)[:n]
    out[: 2 * n].view(cp.uint32)[...] = bits.astype(cp.uint32) << 16
    profile_mark("blas:expand")  # the CuPy ops above are no launch() of ours


# every small bf16 matrix once (94 MB for the 27B's 48); an allocation that fails leaves the rest to
# the scratch (weights_f32)
_F32_CACHE = ExpansionCache(1 << 62, expand=_expand_f32, size=_f32_bytes)


def weights_f32(m):
    """The matrix as fp32 [row_tiles * 16, kpad] (bf16 -> fp32 is exact), kept once made."""
    sh = m.shape
    buf = _F32_CACHE.get(m)
    if buf is None:  # no room for another resident copy: a scratch one, made again each call
        buf = _SCRATCH.get("w32", _f32_bytes(m))
        _expand_f32(m, buf)
    return buf[: 2 * sh.row_tiles * 16 * sh.kpad].view(Runtime.get().cp.float32).reshape(sh.row_tiles * 16, sh.kpad)


def prefill_gemm_f32(m, x, ldx: int, ntok: int, y, ldy: int) -> None:
    """y[t] (+)= W x[t] for a small bf16 matrix (f32_route): fp32 operands and math (MODE_STORE / MODE_ADD)."""
    assert f32_route(m), "prefill_gemm_f32 takes small bf16 matrices without the SwiGLU epilogue"
    sh = m.shape
    w = weights_f32(m)
    cublas, h = _handle()
    beta = _ONE if m.mode == C.MODE_ADD else _ZERO
    cublas.gemmEx(h, _OP_T, _OP_N, int(m.nout), int(ntok), int(sh.kpad), _ONE.ctypes.data, int(w.data.ptr), _R_32F,
                  int(sh.kpad), int(x.data.ptr), _R_32F, int(ldx), beta.ctypes.data, int(y.data.ptr), _R_32F,
                  int(ldy), _COMPUTE_32F_PEDANTIC, _GEMM_DEFAULT)
    profile_mark("cublas:gemm_f32", 2.0 * m.nout * ntok * sh.kpad)


# ---------------------------------------------------------------- small bf16 matrices: three bf16 terms
# prefill_gemm_split3, another route for the same matrices (EngineConfig.prefill_small_gemm "bf16x3"; the default,
# "bf16x3f", runs these terms fused in one kernel: prefill_gemm_bf16x3f below; "f32" keeps prefill_gemm_f32). The
# pedantic SGEMM runs the 27B's ab (96 x 5120) at ~32 TFLOP/s: 0.127 ms per 4,096-token chunk and layer, 12.2 ms
# of an 8K prefill (docs/PERF.md i3). Here each fp32 activation is split
# into three bf16 terms, x = hi + mid + lo exactly (cuda/dequant.cu f32_split3_bf16_rows), and W x = W hi +
# W mid + W lo runs on tensor cores (bf16 x bf16 -> fp32, COMPUTE_32F): every product is exact in fp32, only
# the accumulation rounds.
#
# How the three products are laid out:
#   - W mid and W lo: ONE GEMM, the two planes stacked along N (2 * ntok columns), full K: their terms are
#     under 2^-8 and 2^-16 of x's, so how their accumulation rounds does not show.
#   - W hi: K cut into pieces of SPLIT3_PIECE_CHUNKS x 64 columns, one strided-batched GEMM (a piece per batch,
#     same weights and rows, offsets along K) + one plain GEMM for a remainder piece, each piece into its own
#     fp32 partial; split3_combine then sums lo + mid, the hi pieces in K order, and y, round to nearest.
#   Why the pieces: the tensor cores' fp32 accumulation is not IEEE round-to-nearest. Published models of
#   V100 / A100 / H100 (Fasi et al. 2021, Khattak & Mikaitis 2025) add each k-block's exact products to the
#   accumulator with truncated alignment and a round-toward-zero result, an error biased toward zero of up to an
#   ulp of the accumulator per MMA step; over one K = 5120 chain that emulates (numpy, blocks of 16 / 8 / 4
#   products, 0-3 extra bits) at 1.0e-6 to 1.5e-5 relative against 1.24e-6 for a sequential round-to-nearest
#   fp32 chain (the SGEMM), i.e. up to 12x looser. Pieces of 320 bring it to 1.8e-7 to 5.0e-7 (512: 2.2e-7 to
#   8.7e-7; 1024: 3.5e-7 to 2.0e-6), and cost one partial (ntok x nout fp32: 1.6 MB at the 27B's chunk)
#   written and read per piece.
#   Rejected: [hi | mid | lo] stacked along K against a resident [W | W | W] (3x the weights, 141 MB for the 27B,
#   one launch): mid and lo then land in an accumulator already holding W hi, each of their MMA steps costing up
#   to an ulp of |y|: 1.5e-6 to 1.3e-5 at K = 640 in the same emulation (the terms kept apart: 2.6e-7 to 1.1e-6;
#   tools/split3_numerics.py). Rejected too: three GEMMs chained with beta = 1, smallest first (no partials):
#   W hi is then the one K = 5120 chain above, and each GEMM is 32 CTAs of 128 x 128 on 132 SMs (M = 96, so
#   cuBLAS would split K its own way or idle SMs), where the batched pieces give 16 x 32.
# Cost, 27B, 4,096-token chunk, per layer (bytes; these shapes are bandwidth-bound, ~12 GFLOP of MMA at any
# rate above ~300 TFLOP/s hides under them): split, x read + mid / lo written = 84 + 84 MB (hi is the bf16 rows
# the norm already writes for the q4 qkvz beside ab in its plan: GemvPlan.run passes them; without them the
# split writes hi too, +42 MB); W hi pieces: 42 MB read + 16 partials 25 MB; W mid / lo: 84 MB read + 3 MB;
# combine: 28 MB read. ~350 MB, ~80-90 us at 4-4.5 TB/s against the SGEMM's 127 us: ~4 ms of an 8K prefill
# (96 calls), not measured. The bigger lever is the producer: the input norm writing mid / lo beside its bf16
# rows (and no fp32 rows for this plan) drops the split's 168 MB, ~45 us a call.
#
# Numerics: both routes are fp32-grade against float64 (tests/gpu/test_prefill_split3.py measures both on the
# same rows and holds this one to the SGEMM's error); the accumulation order differs, so the bits differ from
# prefill_gemm_f32's. Like it, this route serves prefill chunks of >= MIN_TOKENS (128) tokens only
# (kernels.gemm_f32_route), the cuBLAS route's prefill tolerance class: decode, verify and the canonical gates'
# prompts (36 and 10 tokens, gates/run.py) keep the GEMV.
SPLIT3_PIECE_CHUNKS = 5  # 64-column chunks per piece of the W hi GEMM (320 columns: 16 pieces at K = 5120)


def split3_pieces(kpad: int) -> tuple[int, int, int]:
    """(full, kp, rem): the W hi GEMM's K pieces, `full` pieces of kp columns (one strided-batched GEMM), then
    one of rem < kp columns (a plain GEMM) when rem > 0."""
    kp = SPLIT3_PIECE_CHUNKS * L.CHUNK_K
    full, rem = divmod(int(kpad), kp)
    return full, kp, rem


class Split3:
    """x's rows [ntok][kpad] as the three bf16 planes of the split: hi (the producer's bf16 rows or a plane of
    the scratch, row stride ldhi) and mid / lo as one [2 * ntok][kpad] block (mid rows, then lo rows)."""

    def __init__(self, hi, ldhi: int, midlo, ntok: int, kpad: int):
        self.hi, self.ldhi, self.midlo, self.ntok, self.kpad = hi, int(ldhi), midlo, int(ntok), int(kpad)


def split3(x, ldx: int, ntok: int, kpad: int, x_bf16=None) -> Split3:
    """Split fp32 rows x [ntok][ldx] (columns [0, kpad)) into bf16 hi + mid + lo (cuda/dequant.cu
    f32_split3_bf16_rows). x_bf16: uint16 rows holding f32_to_bf16_rows' bytes of x's rows (the plan's bf16
    input: a 2-D array its producer wrote, or to_bf16's flat [ntok][kpad] output): the hi plane, so only mid
    and lo are written."""
    assert kpad % 64 == 0 and ldx % 4 == 0, (kpad, ldx)
    rt = Runtime.get()
    n = ntok * kpad
    buf = _SCRATCH.get("x3", (2 if x_bf16 is not None else 3) * n * 2)
    if x_bf16 is not None:
        if x_bf16.ndim == 1:  # to_bf16's rows: ld = kpad
            ldhi = kpad
        else:
            assert x_bf16.shape[1] >= kpad and x_bf16.strides[1] == 2, (x_bf16.shape, x_bf16.strides)
            ldhi = x_bf16.strides[0] // 2
        hi, midlo, hi_out = x_bf16, buf[: 2 * n], None
    else:
        hi, ldhi, midlo = buf[:n], kpad, buf[n: 3 * n]
        hi_out = hi
    rt.launch("dequant", "f32_split3_bf16_rows", (-(-kpad // 1024), ntok), 256,
              (x, i32(ldx), i32(kpad), hi_out, midlo, midlo[n:], i32(kpad)))
    return Split3(hi, ldhi, midlo, ntok, kpad)


# every small bf16 matrix's bf16 expansion once (47 MB for the 27B's 48 ab); an allocation that fails leaves
# the rest to the scratch (weights_bf16_small)
_BF16_SMALL_CACHE = ExpansionCache(1 << 62)


def weights_bf16_small(m):
    """The matrix as bf16 [row_tiles * 16, kpad] (a flat uint16 buffer), kept once made."""
    buf = _BF16_SMALL_CACHE.get(m)
    return buf if buf is not None else dequantize_to_bf16(m)


def prefill_gemm_split3(m, x, ldx: int, ntok: int, y, ldy: int, split: Split3 | None = None) -> None:
    """prefill_gemm_f32's contract (y[t] (+)= W x[t], MODE_STORE / MODE_ADD, small bf16 matrices) as three bf16
    terms on tensor cores (the section above). split: x's planes already made (a plan's matrices share them)."""
    assert f32_route(m), "prefill_gemm_split3 takes small bf16 matrices without the SwiGLU epilogue"
    rt = Runtime.get()
    sh = m.shape
    kpad, nout = int(sh.kpad), int(m.nout)
    assert ntok * nout < 1 << 31
    if split is None:
        split = split3(x, ldx, ntok, kpad)
    assert split.ntok == ntok and split.kpad == kpad, (split.ntok, split.kpad, ntok, kpad)
    w = int(weights_bf16_small(m).data.ptr)
    full, kp, rem = split3_pieces(kpad)
    npieces = full + (rem > 0)
    ldp = L.round_up(nout, 4)
    pstride = ntok * ldp  # floats between partials
    part = _SCRATCH.get("p3", (npieces + 2) * pstride * 4).view(rt.cp.float32)
    p = int(part.data.ptr)
    hi, ldhi = int(split.hi.data.ptr), split.ldhi
    cublas, h = _handle()
    one, zero = _ONE.ctypes.data, _ZERO.ctypes.data
    if full:
        cublas.gemmStridedBatchedEx(h, _OP_T, _OP_N, nout, ntok, kp, one, w, _R_16BF, kpad, kp, hi, _R_16BF, ldhi, kp,
                                    zero, p, _R_32F, ldp, pstride, full, _COMPUTE_32F, _GEMM_DEFAULT)
    if rem:
        off = full * kp * 2  # bytes
        cublas.gemmEx(h, _OP_T, _OP_N, nout, ntok, rem, one, w + off, _R_16BF, kpad, hi + off, _R_16BF, ldhi, zero,
                      p + full * pstride * 4, _R_32F, ldp, _COMPUTE_32F, _GEMM_DEFAULT)
    cublas.gemmEx(h, _OP_T, _OP_N, nout, 2 * ntok, kpad, one, w, _R_16BF, kpad, int(split.midlo.data.ptr), _R_16BF,
                  kpad, zero, p + npieces * pstride * 4, _R_32F, ldp, _COMPUTE_32F, _GEMM_DEFAULT)
    profile_mark("cublas:gemm_split3", 3 * 2.0 * nout * ntok * kpad)  # FLOPs as run: three bf16 products
    rt.launch("dequant", "split3_combine", -(-(ntok * nout) // 256), 256,
              (part, i32(ldp), i64(pstride), i32(npieces), i32(nout), i32(ntok), i32(int(m.mode == C.MODE_ADD)), y,
               i32(ldy)))


def bf16x3f_fits(m) -> bool:
    """Whether prefill_gemm_bf16x3f takes the matrix: its nout rows in at most C.GEMM3_MT 16-row tiles."""
    return f32_route(m) and -(-int(m.nout) // 16) <= C.GEMM3_MT


def prefill_gemm_bf16x3f(m, x, ldx: int, ntok: int, y, ldy: int) -> None:
    """prefill_gemm_split3's terms, grouping and contract in one kernel (cuda/dequant.cu gemm3_small_m*: the split in
    registers, the products on mma.sync, no planes or partials in memory); other bits than split3's, same class."""
    assert bf16x3f_fits(m), "prefill_gemm_bf16x3f takes small bf16 matrices of at most GEMM3_MT row tiles"
    sh = m.shape
    kpad, nout = int(sh.kpad), int(m.nout)
    assert kpad % 64 == 0 and ldx % 4 == 0 and ldy >= nout, (kpad, ldx, ldy)
    mt = -(-nout // 16)  # the packed rows past nout (row groups of 64) are zeros: not loaded, not multiplied
    ntw = C.GEMM3_NTW
    w = weights_bf16_small(m)
    Runtime.get().launch("dequant", f"gemm3_small_m{mt}", -(-ntok // (16 * ntw)), 128,
                         (w, i32(kpad), x, i32(ldx), i32(ntok), i32(nout), i32(int(m.mode == C.MODE_ADD)), y, i32(ldy),
                          i32(SPLIT3_PIECE_CHUNKS * 4)),
                         shared_mem=C.GEMM3_STAGES * (mt * 2048 + 16 * ntw * 256))


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
        profile_mark("cublas:gemm_fp8", 2.0 * nrows * ntok * sh.kpad)
        rt.launch("dequant", "swiglu_tiles_scaled", (-(-m.nout // 256), ntok), 256,
                  (z, i32(nrows), i32(m.nout), y, i32(ldy), scale))
        return
    grid = (-(-m.nout // 1024), ntok)
    add = m.mode == C.MODE_ADD
    if add:  # y + s D = s (y / s + D): exact for powers of two, so the residual keeps its bits
        rt.launch("dequant", "fp8_scale_rows", grid, 256, (y, i32(ldy), i32(m.nout), scale, i32(1)))
    lt.matmul_fp8(w8, sh.kpad, codes, sh.kpad, m.nout, ntok, sh.kpad, y, ldy, alpha, accumulate=add)
    profile_mark("cublas:gemm_fp8", 2.0 * m.nout * ntok * sh.kpad)
    rt.launch("dequant", "fp8_scale_rows", grid, 256, (y, i32(ldy), i32(m.nout), scale, i32(0)))
