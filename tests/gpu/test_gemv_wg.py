"""The a8 GEMV on warpgroup MMA (cuda/gemv_wg.cu, sm_90a): bitwise the mma.sync a8 kernels
(cuda/gemv.cu gemv8_q4_*) at every width, which is what lets the engine pick either by speed.

CPU (no GPU): the kernel's shared-memory placements and reads emulated on real packed bytes --
the rotated fragment ring, the quad transpose into wgmma's register A fragments, and the
activations through the PTX ISA's K-major no-swizzle canonical layout (core matrices of 8 rows x
16 bytes, LBO between K-adjacent ones, SBO between 8-row groups) -- must give the exact integer
dot products, chunk for chunk equal to the mma.sync emulation; the ring reads are conflict-free;
the sm_90a build keeps wgmma asynchronous and spills nothing.
GPU: GemvPlan with wgmma="all" against wgmma="off" (gemv8_q4_*), bit for bit, on the 27B shapes,
forced K splits (partial last stages, units of fewer than 8 chunks), every epilogue and 1-16 lanes.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from q27py.gpu import constants as C
from q27py.gpu import layout as L

try:
    import nvcc_build
except ImportError:  # run from the repository root
    from tests.gpu import nvcc_build

NVCC = nvcc_build.NVCC


# ---------------------------------------------------------------- the kernel's formulas, read from its source
def _src() -> str:
    from q27py.gpu.runtime import CUDA_DIR

    return (CUDA_DIR / "gemv_wg.cu").read_text(encoding="utf-8")


def frag_pos(g: int, tp: int) -> int:
    """wg_frag_pos: where quad position (g, tp) stores its 16-byte fragment in its warp's 512 bytes."""
    return (g * 4 + (tp ^ ((g >> 1) & 3))) * 16


def act_off(nl: int, n: int, q: int) -> int:
    """wg_act_off: byte of lane n's 16-byte activation piece q in a chunk's B region."""
    return (q >> 1) * nl * 32 + (n >> 3) * 256 + (q & 1) * 128 + (n & 7) * 16


def test_formulas_are_the_kernels():
    """The emulation below uses the kernel's own expressions (a change to either shows here)."""
    s = _src()
    assert "(u32)(g * 4 + (tp ^ ((g >> 1) & 3))) * 16u" in s
    assert "(u32)((q >> 1) * NL * 32 + (n >> 3) * 256 + (q & 1) * 128 + (n & 7) * 16)" in s
    assert "((u64)(128 >> 4) << 16) | ((u64)(256 >> 4) << 32)" in s  # LBO 128, SBO 256, no swizzle


def test_fragment_reads_are_bank_conflict_free():
    """Each of the 4 reads "word t of fragment (g, tp)" (fixed tp per instruction) hits 32 banks."""
    for tp in range(4):
        banks = {((frag_pos(g, tp) + 4 * t) // 4) % 32 for g in range(8) for t in range(4)}
        assert len(banks) == 32, tp
    # and the 32 fragments of a warp land on distinct 16-byte slots
    assert sorted(frag_pos(g, t) for g in range(8) for t in range(4)) == list(range(0, 512, 16))


def canonical_b(smem: np.ndarray, start: int, nl: int, lbo: int = 128, sbo: int = 256) -> np.ndarray:
    """B (32 k x nl lanes, s8) of one wgmma k32 step as the hardware reads it: K-major, no swizzle,
    ((8, m), (T, 2k)) : ((1T, SBO), (1, LBO)) in 16-byte units (PTX ISA, canonical layouts)."""
    b = np.zeros((32, nl), dtype=np.int64)
    for n in range(nl):
        for k in range(32):
            addr = start + (n & 7) * 16 + (n >> 3) * sbo + (k // 16) * lbo + (k % 16)
            b[k, n] = int(np.int8(smem[addr].view(np.int8)))
    return b


def emulate_wg_chunk(codes: np.ndarray, shape: L.MatrixShape, tile: int, chunk: int, xbytes: np.ndarray,
                     nl: int) -> np.ndarray:
    """One (16-row tile, 64-k chunk) of gemv_wg: the warp's 32 fragments copied to their rotated slots,
    thread (g, t) reading word t of fragments (g, 0..3), unpacked as gemv.cu unpacks them into the
    m64nNk32 register A fragment (per warp the m16n8k32 map), the lanes' 64 bytes copied piece by piece
    to their B offsets and read back through the canonical layout. Exact int32 sums [16, nl]."""
    cb = L.CHUNK_BYTES[shape.fmt]
    frag = codes[(tile * shape.kchunks + chunk) * cb: (tile * shape.kchunks + chunk + 1) * cb]
    ring = np.zeros(512, dtype=np.uint8)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        ring[frag_pos(g, t): frag_pos(g, t) + 16] = frag[lane * 16: lane * 16 + 16]
    xs = np.zeros(nl * 64, dtype=np.uint8)
    for n in range(nl):
        for q in range(4):
            xs[act_off(nl, n, q): act_off(nl, n, q) + 16] = xbytes[n, q * 16: q * 16 + 16]
    lo8 = lambda w: ((w << 4) & 0xF0F0F0F0) ^ 0x80808080  # noqa: E731  (q4_lo8, sgn = 0x80808080)
    hi8 = lambda w: (w & 0xF0F0F0F0) ^ 0x80808080  # noqa: E731
    d = np.zeros((16, nl), dtype=np.int64)
    for b in range(2):
        A = np.zeros((16, 32), dtype=np.int64)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            wv = [int(ring[frag_pos(g, tp) + 4 * t: frag_pos(g, tp) + 4 * t + 4].view(np.uint32)[0]) for tp in range(4)]
            regs = [lo8(wv[2 * b]), hi8(wv[2 * b]), lo8(wv[2 * b + 1]), hi8(wv[2 * b + 1])]
            A[g, 4 * t: 4 * t + 4] = L._s8x4(regs[0] & 0xFFFFFFFF)
            A[g + 8, 4 * t: 4 * t + 4] = L._s8x4(regs[1] & 0xFFFFFFFF)
            A[g, 16 + 4 * t: 20 + 4 * t] = L._s8x4(regs[2] & 0xFFFFFFFF)
            A[g + 8, 16 + 4 * t: 20 + 4 * t] = L._s8x4(regs[3] & 0xFFFFFFFF)
        d += A @ canonical_b(xs, b * nl * 32, nl)
    return d


@pytest.mark.parametrize("nl", [8, 16])
def test_wg_chunk_emulation_gives_the_mma_sync_sums(nl):
    rng = np.random.default_rng(nl)
    w = rng.standard_normal((32, 192)).astype(np.float32)
    pm = L.pack_matrix(w, L.FMT_Q4)
    codes_w, _ = L.quantize(w, L.FMT_Q4)
    x = rng.standard_normal((nl, 192)).astype(np.float32) * 3
    xc, _ = L.quantize_act8(x)
    xb = L.act8_fragment_bytes(xc)
    for tile in range(2):
        for chunk in range(3):
            sl = slice(chunk * 64, chunk * 64 + 64)
            got = emulate_wg_chunk(pm.codes, pm.shape, tile, chunk, xb[:, sl], nl)
            ref = 16 * codes_w[16 * tile: 16 * tile + 16, sl].astype(np.int64) @ xc[:, sl].astype(np.int64).T
            np.testing.assert_array_equal(got, ref)
            for l0 in range(0, nl, 8):  # the mma.sync kernel's 8-lane tiles
                np.testing.assert_array_equal(got[:, l0:l0 + 8], L.emulate_a8_chunk(pm.codes, pm.shape, tile, chunk,
                                                                                    xb[l0:l0 + 8, sl]))


def test_shared_bytes_match_the_stage_layout():
    """kernels.gemv_wg_shared_bytes against WgStage's fields (the kernel's enum, parsed)."""
    from q27py.gpu import kernels as K

    s = _src()
    for field in ("WC = GEMV_R * 512", "XC = NL * 64", "S_OFF = W_OFF + GWG_CPS * WC",
                  "X_OFF = S_OFF + GWG_CPS * GEMV_R * 32", "XS_OFF = X_OFF + GWG_CPS * XC",
                  "BYTES = XS_OFF + GWG_CPS * NL * 4"):
        assert field in s, field
    for nl in (8, 16):
        stage = C.GWG_CPS * (C.GEMV_R * 512 + C.GEMV_R * 32 + nl * 64 + nl * 4)
        assert K.gemv_wg_shared_bytes(nl) == C.GWG_STAGES * stage
        assert stage % 16 == 0  # every slot's B region stays 16-byte aligned (descriptor start field)


def test_selection_rule(monkeypatch):
    from q27py.gpu import kernels as K

    assert K.gemv_wgmma_supported((9, 0), 227 * 1024)
    assert not K.gemv_wgmma_supported((8, 9), 227 * 1024) and not K.gemv_wgmma_supported((12, 0), 227 * 1024)
    assert not K.gemv_wgmma_supported((9, 0), 48 * 1024)
    with pytest.raises(ValueError):
        K.gemv_wgmma_mode("yes")
    assert K.gemv_wgmma_mode("wide") == "wide"


def test_engine_config_maps_the_switch(monkeypatch):
    from q27py.config import Q27Config, apply_env

    assert Q27Config().engine.gemv_wgmma == "auto"
    monkeypatch.setenv("Q27_GEMV_WGMMA", "all")
    assert apply_env(Q27Config()).engine.gemv_wgmma == "all"


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_sm90a_build_keeps_wgmma_async_and_does_not_spill(tmp_path):
    rep = nvcc_build.sm90a_report(tmp_path, "gemv_wg")
    assert sorted(rep) == ["gemv8w_q4_n16", "gemv8w_q4_n8"], rep
    bound = {k: 65536 // (128 * (C.GWG_CTAS_N8 if k.endswith("8") else C.GWG_CTAS_N16)) for k in rep}
    assert all(spill == 0 and regs <= bound[k] for k, (regs, spill) in rep.items()), rep


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_plain_sm90_build_is_refused_when_sm90a_was_asked(tmp_path):
    nvcc_build.assert_refused_without_sm90a(tmp_path, "gemv_wg", "sm_86")


# ---------------------------------------------------------------- GPU
@pytest.fixture(scope="module")
def cp():
    import cupy

    from q27py.gpu import kernels as K
    from q27py.gpu.runtime import Runtime

    rt = Runtime.get()
    if not K.gemv_wgmma_supported():
        pytest.skip("no sm_90a build of gemv_wg on this card")
    rt.module("gemv_wg")
    rt.module("gemv")
    return cupy


def _pair(cp, K, specs, n, partition=None, seed=0):
    """(wgmma outputs, mma.sync outputs) of one plan over matrices specs [(rows, cols, fmt, mode)]."""
    mats = [K.random_matrix(r, c, f, seed=seed + 7 * j, scale=0.01 if f != L.FMT_BF16 else 0.05, mode=mode)
            for j, (r, c, f, mode) in enumerate(specs)]
    kpad = mats[0].shape.kpad
    x = cp.zeros((16, kpad), dtype=cp.float32)
    K.fill_uniform(x, seed + 3, -1.0, 1.0)
    outs = {}
    for wg in ("all", "off"):
        ws = K.Workspace()
        ys = []
        for (r, _, _, mode), m in zip(specs, mats):
            rows_out = r // 2 if mode == K.MODE_SWIGLU else r
            y = cp.full((16, rows_out), 0.25 if mode == K.MODE_ADD else np.nan, dtype=cp.float32)
            ys.append(y)
        plan = K.GemvPlan(mats, [(y, y.shape[1]) for y in ys], ws, impl="a8", partition=partition, wgmma=wg)
        plan.run(x, kpad, n, allow_gemm=False)
        outs[wg] = [y[:n].get() for y in ys]
    return outs["all"], outs["off"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gate_up", "down", "gdn_in", "attn_in", "gdn_out", "lm_head"])
@pytest.mark.parametrize("n", [1, 3, 8, 9, 16])
def test_wg_is_bitwise_gemv8_on_the_27b_launches(cp, name, n):
    from q27py.gpu import kernels as K

    specs = {
        "gate_up": [(34816, 5120, L.FMT_Q4, K.MODE_SWIGLU)],
        "down": [(5120, 17408, L.FMT_Q4, K.MODE_ADD)],
        "gdn_in": [(16384, 5120, L.FMT_Q4, K.MODE_STORE), (96, 5120, L.FMT_BF16, K.MODE_STORE)],
        "attn_in": [(12288, 5120, L.FMT_Q4, K.MODE_STORE), (2048, 5120, L.FMT_Q8, K.MODE_STORE)],
        "gdn_out": [(5120, 6144, L.FMT_Q4, K.MODE_ADD)],
        "lm_head": [(248320, 5120, L.FMT_Q4, K.MODE_STORE)],
    }[name]
    got, ref = _pair(cp, K, specs, n, seed=n)
    for a, b in zip(got, ref):
        assert np.isfinite(b).all()
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols,splits", [(300, 640, 1), (300, 640, 2), (1040, 5120, 7), (64, 4096, 9),
                                              (200, 320, 1), (5120, 17408, 5)])
@pytest.mark.parametrize("n", [1, 9, 16])
def test_wg_is_bitwise_gemv8_under_forced_splits(cp, rows, cols, splits, n):
    """Splits whose K ranges are not whole stages (partial last stages), units of fewer than 8 chunks
    (200 x 320: 5 chunks, residues that stay empty), the ticket path's ordered sums."""
    from q27py.gpu import kernels as K

    got, ref = _pair(cp, K, [(rows, cols, L.FMT_Q4, K.MODE_STORE)], n, partition=(1, splits), seed=rows + splits)
    np.testing.assert_array_equal(got[0].view(np.uint32), ref[0].view(np.uint32))
    assert np.isfinite(ref[0]).all()


@pytest.mark.gpu
def test_wg_launches_replace_the_q4_launches_only(cp, monkeypatch):
    """A plan's q4 launches go to gemv_wg (under "all"; under "wide" only at 9-16 lanes); q8 and bf16
    launches stay on gemv.cu."""
    from q27py.gpu import kernels as K
    from q27py.gpu.runtime import Runtime

    rt = Runtime.get()
    seen = []
    real = rt.launch
    monkeypatch.setattr(rt, "launch", lambda module, kernel, *a, **kw: (seen.append((module, kernel)), real(module, kernel, *a, **kw)))
    mats = [K.random_matrix(1024, 512, L.FMT_Q4, seed=1, scale=0.01), K.random_matrix(256, 512, L.FMT_Q8, seed=2, scale=0.01)]
    ys = [cp.zeros((16, 1024), cp.float32), cp.zeros((16, 256), cp.float32)]
    x = cp.ones((16, 512), cp.float32)
    for mode, n, want in (("all", 1, "gemv8w_q4_n8"), ("wide", 16, "gemv8w_q4_n16"), ("wide", 8, None), ("off", 16, None),
                          ("auto", 16, "gemv8w_q4_n16"), ("auto", 1, "gemv8w_q4_n8"), ("auto", 8, None)):
        seen.clear()
        K.GemvPlan(mats, [(y, y.shape[1]) for y in ys], K.Workspace(), impl="a8", wgmma=mode).run(x, 512, n)
        wg = [k for m, k in seen if m == "gemv_wg"]
        assert wg == ([want] if want else []), (mode, n, seen)
        assert any(re.match(r"gemv8_q8_nt[12]", k) for _, k in seen)
    # "auto" at 2-8 lanes: a launch of at least GWG_AUTO_WAVES waves of the kernel's resident CTAs (the lm_head)
    big = K.random_matrix(64 * K.GWG_AUTO_WAVES * C.GWG_CTAS_N8 * rt.sm_count, 512, L.FMT_Q4, seed=3, scale=0.01)
    yb = cp.zeros((16, big.shape.rows), cp.float32)
    seen.clear()
    K.GemvPlan([big], [(yb, yb.shape[1])], K.Workspace(), impl="a8", wgmma="auto").run(x, 512, 8)
    assert [k for m, k in seen if m == "gemv_wg"] == ["gemv8w_q4_n8"], seen
