"""The fp8 prefill route (EngineConfig.prefill_gemm "fp8", q27py/gpu/blas.py prefill_gemm_fp8,
cuBLASLt through q27py/gpu/blaslt.py): against its own spec -- a float64 product of the same
e4m3-rounded operands with power-of-two scales -- in every epilogue mode; the residual of MODE_ADD
keeps its bits where the product is zero (the power-of-two rescaling is exact)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from q27py.gpu import blaslt


def test_heuristic_struct_is_cublaslt_size():
    """cublasLtMatmulHeuristicResult_t: a 64-byte algo, workspace size, status, waves, 4 ints = 96 bytes."""
    assert ctypes.sizeof(blaslt._Heuristic) == 96
    assert blaslt._Heuristic.workspace.offset == 64


def test_env_selects_the_route():
    from q27py.config import Q27Config, apply_env

    assert Q27Config().engine.prefill_gemm == "auto"
    assert apply_env(Q27Config(), {"Q27_PREFILL_GEMM": "fp8"}).engine.prefill_gemm == "fp8"


def test_fp8_kernels_compile(tmp_path):
    from tests.gpu.nvcc_build import NVCC, build

    if NVCC is None:
        pytest.skip("nvcc not found")
    for arch in ("sm_86", "sm_89", "sm_90"):
        rc, log = build(tmp_path, "dequant", arch)
        assert rc == 0, log[-2000:]


def _packed(w: np.ndarray, fmt: int, mode: int = 0, out_rows=None):
    """(GpuMatrix, the exact code * scale values it holds: layout.py's spec)."""
    from q27py.gpu import kernels as K
    from q27py.gpu import layout as L

    codes, scales = L.quantize(w, fmt)
    pm = L.pack_matrix(w, fmt)
    return K.upload_packed(pm, mode, out_rows), L.dequantize(codes, scales, pm.shape.group).astype(np.float64)


def _spec(gm, wq: np.ndarray, x: np.ndarray, blas) -> np.ndarray:
    """float64 x8 @ w8^T of the route's operands: e4m3 of w * 2^-ew and of x * 2^-e_t, scales back."""
    from q27py.model.kvformat import e4m3_decode, e4m3_encode

    e = blas.weight_fp8_exponent(gm)
    w8 = e4m3_decode(e4m3_encode((wq * 2.0 ** -e).astype(np.float32))) * 2.0 ** e
    amax = np.abs(x).max(axis=1, keepdims=True)
    ex = np.frexp(amax)[1] - 8
    x8 = e4m3_decode(e4m3_encode((x * 2.0 ** -ex).astype(np.float32))) * 2.0 ** ex
    return x8[:, : wq.shape[1]] @ w8.T


@pytest.mark.gpu
@pytest.mark.parametrize("fmt_name", ["q4", "q8"])
def test_fp8_route_matches_its_spec(fmt_name):
    from q27py.gpu import blas
    from q27py.gpu import kernels as K
    from q27py.gpu import layout as L
    from q27py.gpu.runtime import Runtime

    if not blas.fp8_available():
        pytest.skip("fp8 tensor cores (sm_89+) and cuBLASLt needed")
    cp = Runtime.get().cp
    fmt = {"q4": L.FMT_Q4, "q8": L.FMT_Q8}[fmt_name]
    rng = np.random.default_rng(11)
    rows, cols, ntok = 256, 1024, 160
    w = (rng.standard_normal((rows, cols)) * np.exp(rng.uniform(-2, 1, (rows, 1)))).astype(np.float32)
    x = rng.standard_normal((ntok, cols)).astype(np.float32)
    x[5] *= 500.0  # an outlier token
    gm, wq = _packed(w, fmt)
    kpad = gm.shape.kpad
    xd = cp.asarray(np.pad(x, ((0, 0), (0, kpad - cols))))
    want = _spec(gm, wq, x.astype(np.float64), blas)
    scale = np.abs(want).max(axis=1, keepdims=True)  # per token: the outlier must not hide the others
    y = cp.zeros((ntok, rows), dtype=cp.float32)
    blas.prefill_gemm_fp8(gm, xd, kpad, ntok, y, rows)
    err = np.abs(y.get() - want) / scale
    assert err.max() < 2e-3, f"store: max per-token relative error {err.max():.2e}"
    # MODE_ADD onto a residual: y0 + product, the residual rescaled exactly
    y0 = rng.standard_normal((ntok, rows)).astype(np.float32)
    y = cp.asarray(y0)
    gm.mode = K.MODE_ADD
    blas.prefill_gemm_fp8(gm, xd, kpad, ntok, y, rows)
    err = np.abs(y.get() - y0 - want) / (scale + 1)
    assert err.max() < 2e-3, f"add: {err.max():.2e}"
    # zero activations: the residual comes back bit for bit
    y = cp.asarray(y0)
    blas.prefill_gemm_fp8(gm, cp.zeros_like(xd), kpad, ntok, y, rows)
    np.testing.assert_array_equal(y.get(), y0)
    gm.mode = K.MODE_STORE


@pytest.mark.gpu
def test_fp8_route_swiglu():
    from q27py.gpu import blas
    from q27py.gpu import kernels as K
    from q27py.gpu import layout as L
    from q27py.gpu.runtime import Runtime

    if not blas.fp8_available():
        pytest.skip("fp8 tensor cores (sm_89+) and cuBLASLt needed")
    cp = Runtime.get().cp
    rng = np.random.default_rng(12)
    inner, cols, ntok = 128, 512, 144
    gate, up = rng.standard_normal((inner, cols)).astype(np.float32), rng.standard_normal((inner, cols)).astype(np.float32)
    w = L.interleave_gate_up(gate, up)
    gm, wq = _packed(w, L.FMT_Q4, K.MODE_SWIGLU, inner)
    x = rng.standard_normal((ntok, gm.shape.kpad)).astype(np.float32)
    z = _spec(gm, wq, x.astype(np.float64), blas)
    idx = np.arange(inner)
    g, u = z[:, (idx // 8) * 16 + idx % 8], z[:, (idx // 8) * 16 + 8 + idx % 8]
    want = g / (1 + np.exp(-g)) * u
    y = cp.zeros((ntok, inner), dtype=cp.float32)
    blas.prefill_gemm_fp8(gm, cp.asarray(x), gm.shape.kpad, ntok, y, inner)
    err = np.abs(y.get() - want).max() / np.abs(want).max()
    assert err < 3e-3, f"swiglu: {err:.2e}"
