"""The a8 GEMV on warpgroup MMA (cuda/gemv_wg.cu, sm_90a): bitwise the mma.sync a8 kernels
(cuda/gemv.cu gemv8_q4_*) at every width, which is what lets the engine pick either by speed.

CPU (no GPU): the kernel's shared-memory placements and reads emulated on real packed bytes --
the rotated fragment ring, the quad transpose into wgmma's register A fragments, and the
activations through the PTX ISA's K-major no-swizzle canonical layout (core matrices of 8 rows x
16 bytes, LBO between K-adjacent ones, SBO between 8-row groups) -- must give the exact integer
dot products, chunk for chunk equal to the mma.sync emulation; the ring reads are conflict-free;
the sm_90a build keeps wgmma asynchronous and spills nothing.
The 32-lane kernel (gemv8w_q4_n32): its two-pass stage walk (residues 0-3, then 4-7) adds each
chunk's terms to its residue's partial in chunk order and the partials in residue order, as
gemv.cu's warps do; its activation pieces and the two-half chunk scales read what GemvPlan lays out;
a recorded plan runs each q4 launch of a 17-32-lane block as one gemv8w_q4_n32 launch (16 lanes and
fewer exactly as before).
GPU: GemvPlan with wgmma="all" against wgmma="off" (gemv8_q4_*), bit for bit, on the 27B shapes,
forced K splits (partial last stages, units of fewer than 8 chunks), every epilogue and 1-16 lanes;
17 / 24 / 32 lanes (gemv8w_q4_n32) against gemv8_q4_* run as two 16-lane blocks.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

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


def _lo8(w: int) -> int:
    return ((w << 4) & 0xF0F0F0F0) ^ 0x80808080  # q4_lo8, sgn = 0x80808080


def _hi8(w: int) -> int:
    return (w & 0xF0F0F0F0) ^ 0x80808080  # q4_hi8


def _a_fragment(A: np.ndarray, g: int, t: int, regs: list[int]) -> None:
    """Thread (g, t)'s four A registers of one k32 step (the m16n8k32 map: rows g / g + 8, k 4t.. and 16 + 4t..) into A."""
    A[g, 4 * t: 4 * t + 4] = L._s8x4(regs[0] & 0xFFFFFFFF)
    A[g + 8, 4 * t: 4 * t + 4] = L._s8x4(regs[1] & 0xFFFFFFFF)
    A[g, 16 + 4 * t: 20 + 4 * t] = L._s8x4(regs[2] & 0xFFFFFFFF)
    A[g + 8, 16 + 4 * t: 20 + 4 * t] = L._s8x4(regs[3] & 0xFFFFFFFF)


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
    d = np.zeros((16, nl), dtype=np.int64)
    for b in range(2):
        A = np.zeros((16, 32), dtype=np.int64)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            wv = [int(ring[frag_pos(g, tp) + 4 * t: frag_pos(g, tp) + 4 * t + 4].view(np.uint32)[0]) for tp in range(4)]
            regs = [_lo8(wv[2 * b]), _hi8(wv[2 * b]), _lo8(wv[2 * b + 1]), _hi8(wv[2 * b + 1])]
            _a_fragment(A, g, t, regs)
        d += A @ canonical_b(xs, b * nl * 32, nl)
    return d


@pytest.mark.parametrize("nl", [8, 16, 32])
def test_wg_chunk_emulation_gives_the_mma_sync_sums(nl):
    """gemv_wg's rotated ring and quad transpose give the exact integer sums, chunk for chunk equal to the mma.sync
    emulation."""
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
    for field in ("template <int NL, int CPS = GWG_CPS>\nstruct WgStage", "WC = GEMV_R * 512", "XC = NL * 64",
                  "S_OFF = W_OFF + CPS * WC", "X_OFF = S_OFF + CPS * GEMV_R * 32", "XS_OFF = X_OFF + CPS * XC",
                  "BYTES = XS_OFF + CPS * NL * 4"):
        assert field in s, field
    for nl in (8, 16, 32):
        stage = C.GWG_CPS * (C.GEMV_R * 512 + C.GEMV_R * 32 + nl * 64 + nl * 4)
        assert K.gemv_wg_shared_bytes(nl) == C.GWG_STAGES * stage
        assert stage % 16 == 0  # every slot's B region stays 16-byte aligned (descriptor start field)
    assert K.gemv_wg_shared_bytes(32) == 87040


def test_wide_stage_entries_size_and_fit(monkeypatch):
    """GWG_WIDE_STAGE: the 8-lane launches and the 16-lane ones on the plain entry run gemv8w_q4_n8w / n16w, whose
    stages hold GWG_CPS_W chunks (all 8 residues: the one-pass walk only) in a ring of GWG_STAGES_W -- the same
    weight bytes in flight as the plain ring -- at the plain entries' residency; 16-lane launches past a wave
    keep n16t, 32 lanes theirs."""
    from q27py.gpu import kernels as K

    assert C.GWG_CPS_W == C.GEMV_WARPS and C.GWG_CPS_W % C.GWG_SUB_W == 0
    assert (C.GWG_STAGES_W - 1) * C.GWG_CPS_W == (C.GWG_STAGES - 1) * C.GWG_CPS
    monkeypatch.setattr(C, "GWG_WIDE_STAGE", 0)
    assert K.gemv_wg_kernel(8) == "gemv8w_q4_n8" and K.gemv_wg_kernel(16) == "gemv8w_q4_n16"
    monkeypatch.setattr(C, "GWG_WIDE_STAGE", 1)
    assert K.gemv_wg_kernel(8) == "gemv8w_q4_n8w" and K.gemv_wg_kernel(16) == "gemv8w_q4_n16w"
    assert K.gemv_wg_kernel(32) == "gemv8w_q4_n32"
    for nl, ctas in ((8, C.GWG_CTAS_N8), (16, C.GWG_CTAS_N16)):
        stage = C.GWG_CPS_W * (C.GEMV_R * 512 + C.GEMV_R * 32 + nl * 64 + nl * 4)
        assert K.gemv_wg_shared_bytes(nl) == C.GWG_STAGES_W * stage and stage % 16 == 0
        assert ctas * (K.gemv_wg_shared_bytes(nl) + 128 + 1024) <= 228 * 1024, nl


def test_resident_ctas_fit_the_sm90_shared_memory(monkeypatch):
    """Each kernel's launch bounds promise GWG_CTAS_N* resident CTAs: their dynamic shared memory, static
    128 B and the 1 KB the driver reserves per CTA fit an sm_90 SM's 228 KB (one CTA: the 227 KB opt-in)."""
    from q27py.gpu import kernels as K

    for nl, ctas in ((8, C.GWG_CTAS_N8), (16, C.GWG_CTAS_N16), (32, C.GWG_CTAS_N32), (16, C.GWG_CTAS_N16T)):
        assert K.gemv_wg_shared_bytes(nl) <= 227 * 1024
        assert ctas * (K.gemv_wg_shared_bytes(nl) + 128 + 1024) <= 228 * 1024, nl
    monkeypatch.setattr(C, "GWG_N32_SUB", 1)  # gemv8w_q4_n32s: a 4-stage ring, three CTAs
    assert K.gemv_wg_shared_bytes(32) == C.GWG_STAGES_N32S * 17408 == 69632
    assert C.GWG_CTAS_N32S * (K.gemv_wg_shared_bytes(32) + 128 + 1024) <= 228 * 1024
    assert C.GWG_MAX_LANES == 32 and C.GEMV_MAX_LANES == 16


def test_the_8_lane_pad_leaves_room_for_the_next_launch(monkeypatch):
    """GWG_N8_PAD (an experiment knob, 0 by default) adds to the 8-lane launches' shared memory only; the value the
    constants table suggests (24,576) holds the 8-lane entry to two CTAs an sm_90 SM and leaves room for one more
    8-lane CTA of the next launch beside them (228 KB, 1 KB reserved a CTA)."""
    from q27py.gpu import kernels as K

    assert C.GWG_N8_PAD == 0
    assert [K.gemv_wg_launch_bytes(nl) for nl in (8, 16, 32)] == [K.gemv_wg_shared_bytes(nl) for nl in (8, 16, 32)]
    monkeypatch.setattr(C, "GWG_N8_PAD", 24576)
    padded, plain = K.gemv_wg_launch_bytes(8), K.gemv_wg_shared_bytes(8)
    assert padded == plain + 24576 and K.gemv_wg_launch_bytes(16) == K.gemv_wg_shared_bytes(16)
    per = lambda b: b + 128 + 1024  # noqa: E731  (static shared memory and the driver's reserve)
    assert 3 * per(padded) > 228 * 1024 >= 2 * per(padded) + per(plain)


# ---------------------------------------------------------------- the 32-lane kernel's walk and activations
def stage_walk(nch: int, nl: int, two: bool = False, cps: int | None = None) -> list[tuple[int, bool, int]]:
    """wg_body's stages over a unit of nch chunks, in ring order: (first chunk - c0, whole, acc index of the
    stage's chunk j = 0) -- PASSES = 1 at 8 / 16 lanes (chunks in order, residues CPS (k & 1) + j), 2 at 32
    (residues 0 .. CPS - 1 over the unit, then CPS .. 7; acc index j). cps: chunks a stage (GWG_CPS; the wide-stage
    entries GWG_CPS_W = 8, every stage residues 0 .. 7)."""
    cps, w = cps or C.GWG_CPS, C.GEMV_WARPS
    if nl <= C.GEMV_MAX_LANES and not two:
        nst, nfull = (nch + cps - 1) // cps, nch // cps
        return [(k * cps, k < nfull, ((k & 1) * cps) % w) for k in range(nst)]
    nst0, nfull0 = (nch + w - 1) // w, (nch + cps) // w
    nst1, nfull1 = (nch + w - 1 - cps) // w, nch // w
    first = [w * k for k in range(nst0)] + [w * k + cps for k in range(nst1)]
    whole = [k < nfull0 for k in range(nst0)] + [k < nfull1 for k in range(nst1)]
    return [(f, h, 0) for f, h in zip(first, whole)]


def test_stage_walk_formulas_are_the_kernels():
    s = _src()
    for expr in ("PASSES = (NL > GEMV_MAX_LANES || TWO) ? 2 : 1, RL = GEMV_WARPS / PASSES",
                 "GWG_KERNEL(gemv8w_q4_n16t, 16, GWG_CTAS_N16T, 1, GWG_CPS, GWG_STAGES)",
                 "GWG_KERNEL(gemv8w_q4_n32s, 32, GWG_CTAS_N32S, 0, GWG_SUB_N32S, GWG_STAGES_N32S)",
                 "for (int jj = 0; jj < SUB; jj++) wg_epilogue<NL, PASSES, PAR, FULL, CPS>(st, b + jj, dd[jj], acc, first(k),",
                 "GWG_KERNEL_C(gemv8w_q4_n8w, 8, GWG_CTAS_N8, 0, GWG_SUB_W, GWG_STAGES_W, GWG_CPS_W)",
                 "GWG_KERNEL_C(gemv8w_q4_n16w, 16, GWG_CTAS_N16, 0, GWG_SUB_W, GWG_STAGES_W, GWG_CPS_W)",
                 "nst0 = PASSES == 1 ? (nch + CPS - 1) / CPS : (nch + GEMV_WARPS - 1) / GEMV_WARPS",
                 "nfull0 = PASSES == 1 ? nch / CPS : (nch + CPS) / GEMV_WARPS",
                 "nst1 = PASSES == 1 ? 0 : (nch + GEMV_WARPS - 1 - CPS) / GEMV_WARPS",
                 "nfull1 = PASSES == 1 ? 0 : nch / GEMV_WARPS",
                 "return k < nst0 ? c0 + GEMV_WARPS * k : c0 + GEMV_WARPS * (k - nst0) + CPS;",
                 "return k < nst0 ? k < nfull0 : k - nst0 < nfull1;",
                 "const int nfull = (c1 - c0) / CPS;",
                 "constexpr int R0 = PASSES == 1 ? (PAR * CPS) % GEMV_WARPS : 0;",
                 "if (!FULL && first_k + j >= c1) return;",
                 "wg_epilogue<NL, PASSES, PAR, FULL, CPS>(st, j, dd[j], acc, first(k), c1, warp, g, t);",
                 "for (k = nst0; k < nst0 + nfull1; k++)"):
        assert expr in s, expr


def gemv8_order_sum(terms, w):
    """A unit's fp32 sum in gemv.cu's order: warp r sums chunks r, r + w, ... in order, then P0 + P1 + ... in warp
    order."""
    part = [np.float32(0)] * w
    for c in range(len(terms)):
        part[c % w] = np.float32(part[c % w] + terms[c])
    ref = part[0]
    for r in range(1, w):
        ref = np.float32(ref + part[r])
    return ref


@pytest.mark.parametrize("nl", [8, 16, 32, "16t", "8t", "8w", "16w"])
def test_stage_walk_sums_like_gemv8s_warps(nl):
    """Every chunk of a unit once; the fp32 result of the walk -- each chunk's term added to its residue's
    partial (acc index as the kernel picks it), PASSES = 2 folding residues 0-3 into v when the first pass
    ends and restarting the partials -- bit for bit gemv.cu's: warp w sums chunks w, w + 8, ... in order,
    then v = P0, v += P1, ..., v += P7. Terms of wildly different scales, so any other order shows."""
    # "16t": gemv8w_q4_n16t, the two-pass walk at 16 lanes; "8w" / "16w": the wide-stage entries (GWG_CPS_W chunks)
    wide = nl in ("8w", "16w")
    two = nl in ("16t", "8t") or (not wide and nl > C.GEMV_MAX_LANES)  # "8t": gemv8w_q4_n8q's walk
    nl = {"16t": 16, "8t": 8, "8w": 8, "16w": 16}.get(nl, nl)
    rng = np.random.default_rng(nl + two + 2 * wide)
    cps, w = (C.GWG_CPS_W if wide else C.GWG_CPS), C.GEMV_WARPS
    for nch in list(range(1, 41)) + [80, 272, 11, 54, 55]:
        terms = (rng.standard_normal(nch) * 2.0 ** rng.integers(-30, 30, nch)).astype(np.float32)
        ref = gemv8_order_sum(terms, w)
        walk = stage_walk(nch, nl, two, cps)
        acc = [np.float32(0)] * (w // 2 if two else w)
        seen, v = [], None
        npass0 = (nch + w - 1) // w
        for k, (f, whole, r0) in enumerate(walk):
            if two and k == npass0:  # the pass change: P0 .. P3 into v
                v = acc[0]
                for r in range(1, len(acc)):
                    v = np.float32(v + acc[r])
                acc = [np.float32(0)] * len(acc)
            assert whole == (f + cps <= nch), (nch, k)
            for j in range(cps):
                c = f + j
                if c >= nch:
                    assert not whole
                    continue
                assert c % w == (r0 + j if not two else (k >= npass0) * cps + j), (nch, k, j)
                acc[r0 + j] = np.float32(acc[r0 + j] + terms[c])
                seen.append(c)
        assert sorted(seen) == list(range(nch))
        for r in range(w):  # each residue's chunks in increasing order
            mine = [c for c in seen if c % w == r]
            assert mine == sorted(mine)
        if two:
            if v is None:  # no second pass (nch <= CPS): v = P0 .. P3 at the end, then + the empty P4 .. P7
                v = acc[0]
                for r in range(1, len(acc)):
                    v = np.float32(v + acc[r])
                acc = [np.float32(0)] * len(acc)
            for r in range(len(acc)):
                v = np.float32(v + acc[r])
        else:
            v = acc[0]
            for r in range(1, w):
                v = np.float32(v + acc[r])
        assert v.view(np.uint32) == ref.view(np.uint32), (nl, nch)


def test_n32_activation_pieces_are_the_general_forms():
    """gemv8w_q4_n32's one-base activation copies (thread = lane tid / 4's piece tid % 4 of chunk e) are the
    general form's (p = tid + 128 e), and its 16-byte chunk-scale pieces read lanes 4 ap .. 4 ap + 3 from
    GemvPlan's two-half scales: [2][kpad8 / 64][16] floats, half h at h * ldq / 4."""
    nl, cps = 32, C.GWG_CPS
    s = _src()
    assert "xs + (ap >> 2) * (ldq >> 2) + (c + aj) * GEMV_MAX_LANES + (ap & 3) * 4" in s
    assert "const int ln = tid >> 2, q = tid & 3;" in s and "xsrc[e] = src + e * 64;" in s
    xp = cps * nl * 4 // 128
    for tid in range(128):
        for e in range(xp):
            p = tid + e * 128
            assert (p // (nl * 4), (p >> 2) % nl, p & 3) == (e, tid >> 2, tid & 3)
    kpad8 = 17408
    ldq, chunks = kpad8, kpad8 // 64
    xs = np.arange(2 * chunks * 16, dtype=np.int64).reshape(2, chunks, 16)  # element ids of the layout
    flat = xs.reshape(-1)
    for c in (0, 5, chunks - cps):
        for tid in range(cps * nl // 4):
            aj, ap = tid // (nl // 4), tid % (nl // 4)
            off = (ap >> 2) * (ldq >> 2) + (c + aj) * 16 + (ap & 3) * 4
            lanes = [4 * ap + i for i in range(4)]
            assert list(flat[off: off + 4]) == [xs[ln // 16, c + aj, ln % 16] for ln in lanes]


# ---------------------------------------------------------------- GemvPlan's launches, recorded (no GPU)
class _Dev(np.ndarray):
    """numpy standing in for a cupy array: .data.ptr is its host address (slices keep their offset)."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.__array_interface__["data"][0])


class _PlanRt:
    """Runtime.get() for building and running GemvPlans: an H100-like sm_90 card, launches recorded."""

    sm_count, cc, smem_optin = 132, (9, 0), 227 * 1024

    def __init__(self):
        self.calls = []
        dev = lambda a: np.asarray(a).view(_Dev)  # noqa: E731
        self.cp = SimpleNamespace(zeros=lambda shape, dtype=np.float32: dev(np.zeros(shape, dtype)),
                                  asarray=dev, uint8=np.uint8, float32=np.float32, int32=np.int32)

    def launch(self, module, kernel, grid, block, args, shared_mem=0, cluster=1):
        grid = tuple(grid) if isinstance(grid, tuple) else (grid,)
        self.calls.append(SimpleNamespace(module=module, kernel=kernel, grid=grid, block=block, args=args,
                                          smem=shared_mem, cluster=cluster))


@pytest.fixture
def plan_rt(monkeypatch):
    from q27py.gpu import kernels as K

    rt = _PlanRt()
    monkeypatch.setattr(K.Runtime, "get", staticmethod(lambda: rt))
    return rt


def _plan(rt, specs, wgmma="all", partition=None):
    """A GemvPlan over stand-in matrices [(rows, cols, fmt)] (pointers only), its outputs 48 lanes tall."""
    from q27py.gpu import kernels as K

    mats = [K.GpuMatrix(L.matrix_shape(r, c, f), rt.cp.zeros(64, np.uint8), rt.cp.zeros(64, np.uint32))
            for r, c, f in specs]
    ys = [rt.cp.zeros((48, r), np.float32) for r, _, _ in specs]
    return K.GemvPlan(mats, [(y, y.shape[1]) for y in ys], K.Workspace(), impl="a8", partition=partition,
                      wgmma=wgmma)


def _ptr(a) -> int:
    return 0 if a is None else a.data.ptr if hasattr(a, "data") else int(a)


def _lanes(c) -> tuple[int, int]:
    """(lanes, lane0) of a recorded GEMV launch."""
    a = c.args
    if c.module == "gemv_wg" or c.kernel.startswith("gemv8_"):
        return int(a[7]), int(a[8])
    if c.module == "gemv2":  # desc, nmat, x, ldx, nlanes, lane0
        return int(a[4]), int(a[5])
    return int(a[5]), int(a[6])  # v1: desc, nmat, units, x, ldx, nlanes, lane0


# q4 1024 x 512 beside q8 256 x 512 and bf16 96 x 512: three launches, the q4 one last (largest)
MIXED = [(1024, 512, L.FMT_Q4), (256, 512, L.FMT_Q8), (96, 512, L.FMT_BF16)]


@pytest.mark.parametrize("n", [17, 24, 32, 40])
def test_wide_blocks_run_each_q4_launch_once_on_n32(plan_rt, n):
    """17-32 lanes (and the first 32 of 40): the activations quantized as two 16-lane halves into the
    32-lane buffers (rows 16.. of xq, the second half of xs), then ONE gemv8w_q4_n32 launch over the block
    for the q4 launch (shared memory for 32 lanes, the whole xq / xs), the q8 and bf16 launches as two
    16-lane launches on the halves; the 8 lanes past 32 as a narrow block (gemv8w_q4_n8 under "all")."""
    rt = plan_rt
    plan = _plan(rt, MIXED)
    assert plan.wide and plan.xq.shape == (32, 512) and plan.xs.shape == (2, 8, 16)
    kpad = plan.kpad
    x = rt.cp.zeros((48, kpad), np.float32)
    plan.run(x, kpad, n, allow_gemm=False)
    calls = rt.calls
    wide = min(n, 32)
    quant = [c for c in calls if c.kernel == "quant_act8"]
    assert [c.grid[1] for c in quant[:2]] == [16, wide - 16]  # the block's two halves: all its lanes
    half_x = [_ptr(c.args[0]) for c in quant[:2]]
    assert half_x == [x.data.ptr, x.data.ptr + 16 * kpad * 4]
    assert [_ptr(c.args[3]) for c in quant[:2]] == [plan.xq.data.ptr, plan.xq.data.ptr + 16 * kpad]
    assert [_ptr(c.args[5]) for c in quant[:2]] == [plan.xs.data.ptr, plan.xs.data.ptr + 8 * 16 * 4]
    assert all(int(c.args[4]) == kpad for c in quant)
    n32 = [c for c in calls if c.kernel == "gemv8w_q4_n32"]
    assert len(n32) == 1
    c = n32[0]
    assert _lanes(c) == (wide, 0) and c.smem == 87040 and c.block == 128
    assert _ptr(c.args[3]) == plan.xq.data.ptr and _ptr(c.args[5]) == plan.xs.data.ptr and int(c.args[4]) == kpad
    first = calls[: calls.index(c) + 1]
    kernels = [c.kernel for c in first]
    assert kernels == ["quant_act8", "quant_act8", "gemv_bf16_nt2", "gemv_bf16_nt" + ("2" if wide > 24 else "1"),
                       "gemv8_q8_nt2", "gemv8_q8_nt" + ("2" if wide > 24 else "1"), "gemv8w_q4_n32"]
    for k in ("gemv_bf16", "gemv8_q8"):
        halves = [c for c in first if c.kernel.startswith(k)]
        assert [_lanes(c) for c in halves] == [(16, 0), (wide - 16, 16)]
    q8 = [c for c in first if c.kernel.startswith("gemv8_q8")]
    assert [_ptr(c.args[3]) for c in q8] == [plan.xq.data.ptr, plan.xq.data.ptr + 16 * kpad]
    assert [_ptr(c.args[5]) for c in q8] == [plan.xs.data.ptr, plan.xs.data.ptr + 8 * 16 * 4]
    rest = calls[len(first):]
    if n == 40:
        assert [c.kernel for c in rest] == ["quant_act8", "gemv_bf16_nt1", "gemv8_q8_nt1", "gemv8w_q4_n8"]
        assert rest[0].grid[1] == 8 and _ptr(rest[0].args[0]) == x.data.ptr + 32 * kpad * 4
        assert [_lanes(c) for c in rest[1:]] == [(8, 32)] * 3
    else:
        assert rest == []


@pytest.mark.parametrize("n", [1, 8, 9, 16])
def test_sixteen_lanes_and_fewer_launch_as_before(plan_rt, n):
    """A plan able to run n32 launches 1-16 lanes exactly as the narrow loop always has: one quant_act8 of n
    lanes into rows 0.. of xq, then one launch per matrix group, q4 on gemv8w_q4_n8 / _n16."""
    rt = plan_rt
    plan = _plan(rt, MIXED)
    x = rt.cp.zeros((48, plan.kpad), np.float32)
    plan.run(x, plan.kpad, n)
    nt = 1 if n <= 8 else 2
    assert [c.kernel for c in rt.calls] == ["quant_act8", f"gemv_bf16_nt{nt}", f"gemv8_q8_nt{nt}",
                                            f"gemv8w_q4_n{8 * nt}"]
    assert rt.calls[0].grid[1] == n and _ptr(rt.calls[0].args[3]) == plan.xq.data.ptr
    c = rt.calls[-1]
    assert _lanes(c) == (n, 0) and _ptr(c.args[3]) == plan.xq.data.ptr and _ptr(c.args[5]) == plan.xs.data.ptr
    assert c.smem == (54400 if n <= 8 else 65280)


@pytest.mark.parametrize("n", [9, 16, 24, 32])
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_three_cta_entries_by_launch(plan_rt, monkeypatch, n, mode):
    """GWG_N16_TWO / GWG_N32_SUB = 2 (the default): a q4 launch of more units than one wave of the plain entry
    (2 CTAs per SM: 264 on this 132-SM card) runs the 3-CTA entry (n16t / n32s, with its shared memory), a launch
    of at most one wave the plain one -- the H200 measured the 3-CTA entries faster only on the former (gate_up's
    544 units, lm_head's 3,880) and slower on every launch of <= 256 units. 0: never; 1: every launch."""
    rt = plan_rt
    monkeypatch.setattr(C, "GWG_N16_TWO", mode)
    monkeypatch.setattr(C, "GWG_N32_SUB", mode)
    wide = n > 16
    for rows, many in ((64 * 265, True), (64 * 264, False)):
        rt.calls.clear()
        plan = _plan(rt, [(rows, 512, L.FMT_Q4)])
        x = rt.cp.zeros((48, plan.kpad), np.float32)
        plan.run(x, plan.kpad, n, allow_gemm=False)
        (c,) = [c for c in rt.calls if c.module == "gemv_wg"]
        assert c.grid == (rows // 64,)
        three = mode == 1 or (mode == 2 and many)
        if wide:
            assert (c.kernel, c.smem) == (("gemv8w_q4_n32s", 69632) if three else ("gemv8w_q4_n32", 87040))
        else:
            assert (c.kernel, c.smem) == (("gemv8w_q4_n16t", 65280) if three else ("gemv8w_q4_n16", 65280))
        assert _lanes(c) == (n, 0)
    # 1-8 lanes have no 3-CTA twin
    rt.calls.clear()
    plan.run(x, plan.kpad, 8, allow_gemm=False)
    assert [c.kernel for c in rt.calls if c.module == "gemv_wg"] == ["gemv8w_q4_n8"]


def test_deep_ring_entry_by_launch(plan_rt, monkeypatch):
    """GWG_DEEP (default on): a 1-8-lane q4 launch of at most 2 CTAs an SM (264 units on this 132-SM card) whose units
    stream at least GWG_DEEP_MIN_CHUNKS chunks runs gemv8w_q4_n8d with its 8-stage ring (87,040 B); more units, shorter
    units, 9-16 lanes or the switch off keep their entries (the H100 measured 4-8% on gdn_in / attn_in / down and a
    loss on the 32-chunk units of gdn_out / attn_o, docs/PERF.md)."""
    rt = plan_rt
    assert C.GWG_DEEP == 1 and C.GWG_DEEP_MIN_CHUNKS == 64  # the shipped default
    for rows, cols, n, want in ((64 * 264, 4096, 1, ("gemv8w_q4_n8d", 87040)), (64 * 264, 4096, 8, ("gemv8w_q4_n8d", 87040)),
                                (64 * 265, 4096, 1, ("gemv8w_q4_n8", 54400)), (64 * 8, 4032, 1, ("gemv8w_q4_n8", 54400)),
                                (64 * 8, 4096, 16, ("gemv8w_q4_n16", 65280))):
        rt.calls.clear()
        plan = _plan(rt, [(rows, cols, L.FMT_Q4)], partition=(1, 1))
        x = rt.cp.zeros((16, plan.kpad), np.float32)
        plan.run(x, plan.kpad, n, allow_gemm=False)
        (c,) = [c for c in rt.calls if c.module == "gemv_wg"]
        assert (c.kernel, c.smem) == want, (rows, cols, n, c.kernel, c.smem)
    monkeypatch.setattr(C, "GWG_DEEP", 0)
    rt.calls.clear()
    plan = _plan(rt, [(64 * 8, 4096, L.FMT_Q4)], partition=(1, 1))
    plan.run(rt.cp.zeros((16, plan.kpad), np.float32), plan.kpad, 1, allow_gemm=False)
    assert [c.kernel for c in rt.calls if c.module == "gemv_wg"] == ["gemv8w_q4_n8"]
    # the split K range counts: 4 splits of 80 chunks are 20 a unit, too short
    monkeypatch.setattr(C, "GWG_DEEP", 1)
    rt.calls.clear()
    plan = _plan(rt, [(64 * 8, 5120, L.FMT_Q4)], partition=(1, 4))
    plan.run(rt.cp.zeros((16, plan.kpad), np.float32), plan.kpad, 1, allow_gemm=False)
    assert [c.kernel for c in rt.calls if c.module == "gemv_wg"] == ["gemv8w_q4_n8"]


def test_place2_pads_only_plain_one_wave_eight_lane_launches(plan_rt, monkeypatch):
    """GWG_PLACE2 (an experiment, off): a plain 8-lane launch of at most 2 x SMs units asks for GWG_PLACE2_BYTES (so
    at most 2 of its CTAs share an SM); n8d launches, larger launches and 16-lane ones keep their shared memory."""
    rt = plan_rt
    assert C.GWG_PLACE2 == 0
    monkeypatch.setattr(C, "GWG_PLACE2", 1)
    for rows, cols, n, want in ((64 * 8, 2048, 1, ("gemv8w_q4_n8", C.GWG_PLACE2_BYTES)),
                                (64 * 264, 2048, 8, ("gemv8w_q4_n8", C.GWG_PLACE2_BYTES)),
                                (64 * 265, 2048, 1, ("gemv8w_q4_n8", 54400)),
                                (64 * 8, 4096, 1, ("gemv8w_q4_n8d", 87040)),
                                (64 * 8, 2048, 16, ("gemv8w_q4_n16", 65280))):
        rt.calls.clear()
        plan = _plan(rt, [(rows, cols, L.FMT_Q4)], partition=(1, 1))
        plan.run(rt.cp.zeros((16, plan.kpad), np.float32), plan.kpad, n, allow_gemm=False)
        (c,) = [c for c in rt.calls if c.module == "gemv_wg"]
        assert (c.kernel, c.smem) == want, (rows, cols, n, c.kernel, c.smem)


@pytest.mark.parametrize("n", [24, 32])
def test_without_n32_wide_blocks_are_two_narrow_blocks(plan_rt, n):
    """wgmma "off" (and a plan without the wide buffers) keeps today's loop: two 16-lane blocks, each
    quantized into rows 0.. and launched, the q4 launches on gemv8_q4_*."""
    rt = plan_rt
    plan = _plan(rt, MIXED, wgmma="off")
    assert not plan.wide and plan.xq.shape == (16, 512) and plan.xs.shape == (8, 16)
    x = rt.cp.zeros((48, plan.kpad), np.float32)
    plan.run(x, plan.kpad, n, allow_gemm=False)
    nt = 2 if n > 24 else 1
    assert [c.kernel for c in rt.calls] == ["quant_act8", "gemv_bf16_nt2", "gemv8_q8_nt2", "gemv8_q4_nt2",
                                            "quant_act8", f"gemv_bf16_nt{nt}", f"gemv8_q8_nt{nt}", f"gemv8_q4_nt{nt}"]
    assert {_ptr(c.args[3]) for c in rt.calls if c.kernel.startswith("gemv8")} == {plan.xq.data.ptr}
    assert [_lanes(c)[1] for c in rt.calls if c.kernel != "quant_act8"] == [0, 0, 0, 16, 16, 16]


@pytest.mark.parametrize("impl", ["v1", "v2"])
def test_other_implementations_keep_16_lane_blocks(plan_rt, impl):
    """v1 / v2 plans (fp32 activations, no a8 buffers) run 24 lanes as 16 + 8, as always."""
    from q27py.gpu import kernels as K

    rt = plan_rt
    mats = [K.GpuMatrix(L.matrix_shape(r, c, f), rt.cp.zeros(64, np.uint8), rt.cp.zeros(64, np.uint32))
            for r, c, f in MIXED]
    ys = [rt.cp.zeros((48, r), np.float32) for r, _, _ in MIXED]
    plan = K.GemvPlan(mats, [(y, y.shape[1]) for y in ys], K.Workspace(), impl=impl, wgmma="all")
    assert not plan.wide and plan.xq is None
    x = rt.cp.zeros((48, plan.kpad), np.float32)
    plan.run(x, plan.kpad, 24, allow_gemm=False)
    pre = "gemv2_" if impl == "v2" else "gemv_"
    assert [c.kernel for c in rt.calls] == [f"{pre}{f}_nt{nt}" for nt in (2, 1) for f in ("bf16", "q8", "q4")]
    assert [_lanes(c) for c in rt.calls] == [(16, 0)] * 3 + [(8, 16)] * 3


def test_prefetching_and_cluster_launches_keep_the_16_lane_loop(plan_rt, monkeypatch):
    """The next-launch prefetch (the final block's last launch) and thread-block clusters are gemv.cu's: in a
    wide block such a launch runs as its two 16-lane launches (the prefetch on the second, as the narrow
    loop's last block has it), beside the q4 launch on n32; a plan whose q4 launch is clustered has no n32
    launch at all and runs the narrow loop."""
    from q27py.gpu import kernels as K

    rt = plan_rt
    plan = _plan(rt, [(256, 512, L.FMT_Q4), (2048, 512, L.FMT_Q8)])  # the q8 launch last: it prefetches
    plan.pf = rt.cp.zeros((8, C.GEMV_PF_PER), np.uint64)
    x = rt.cp.zeros((48, plan.kpad), np.float32)
    plan.run(x, plan.kpad, 24, allow_gemm=False)
    assert [c.kernel for c in rt.calls] == ["quant_act8", "quant_act8", "gemv8w_q4_n32", "gemv8_q8_nt2", "gemv8_q8_nt1"]
    assert [_ptr(c.args[9]) for c in rt.calls[3:]] == [0, plan.pf.data.ptr]
    rt.calls.clear()
    monkeypatch.setattr(C, "GEMV_CLUSTER_MAX", 8)
    plan = _plan(rt, [(1024, 512, L.FMT_Q4)], partition=(1, 2))
    assert plan.clusters == [2]
    plan.run(x, plan.kpad, 24, allow_gemm=False)
    assert [(c.kernel, c.cluster) for c in rt.calls] == [("quant_act8", 1), ("gemv8_q4_nt2", 2),
                                                         ("quant_act8", 1), ("gemv8_q4_nt1", 2)]
    assert K.GWG_MAX_LANES == 32


def test_wide_plans_size_their_split_partials_for_32_lanes(plan_rt):
    """gemv_unit_finish<32> writes 64 x 32 floats per split unit: a wide plan's descriptors give each unit
    that much of the workspace (a narrow plan 64 x 16)."""
    rt = plan_rt
    for mode, lanes in (("all", 32), ("off", 16)):
        plan = _plan(rt, [(1024, 5120, L.FMT_Q4)], wgmma=mode, partition=(1, 3))
        _fmt, desc, _units = plan.desc_host[0]
        assert int(desc[0, C.D_SPLITS]) == 3
        assert plan.workspace.floats == 16 * 3 * 64 * lanes


def test_n16t_selection(monkeypatch):
    """GWG_N16_TWO picks the two-pass 16-lane entry and its residency; other widths keep theirs. Without a
    launch in view (units None) the by-launch default (2) keeps the plain entries."""
    from q27py.gpu import kernels as K

    assert C.GWG_N16_TWO == 2 and C.GWG_N32_SUB == 2
    assert [K.gemv_wg_kernel(nl) for nl in (8, 16, 32)] == ["gemv8w_q4_n8", "gemv8w_q4_n16", "gemv8w_q4_n32"]
    assert K.gemv_wg_ctas(16) == C.GWG_CTAS_N16
    monkeypatch.setattr(C, "GWG_N16_TWO", 0)
    monkeypatch.setattr(C, "GWG_N32_SUB", 0)
    assert [K.gemv_wg_kernel(nl, 10**6) for nl in (8, 16, 32)] == ["gemv8w_q4_n8", "gemv8w_q4_n16", "gemv8w_q4_n32"]
    monkeypatch.setattr(C, "GWG_N16_TWO", 1)
    assert [K.gemv_wg_kernel(nl) for nl in (8, 16, 32)] == ["gemv8w_q4_n8", "gemv8w_q4_n16t", "gemv8w_q4_n32"]
    assert K.gemv_wg_ctas(16) == C.GWG_CTAS_N16T == 3
    assert K.gemv_wg_ctas(32) == C.GWG_CTAS_N32
    monkeypatch.setattr(C, "GWG_N32_SUB", 1)
    assert K.gemv_wg_kernel(32) == "gemv8w_q4_n32s" and K.gemv_wg_ctas(32) == C.GWG_CTAS_N32S == 3


def test_selection_rule(monkeypatch):
    from q27py.gpu import kernels as K

    assert K.gemv_wgmma_supported((9, 0), 227 * 1024)
    assert K.gemv_wgmma_supported((9, 0), 227 * 1024, lanes=32)
    assert K.gemv_wgmma_supported((9, 0), 80 * 1024) and not K.gemv_wgmma_supported((9, 0), 80 * 1024, lanes=32)
    assert [K.gemv_wg_width(n) for n in (1, 8, 9, 16, 17, 24, 32)] == [8, 8, 16, 16, 32, 32, 32]
    assert not K.gemv_wgmma_supported((8, 9), 227 * 1024) and not K.gemv_wgmma_supported((12, 0), 227 * 1024)
    assert not K.gemv_wgmma_supported((9, 0), 48 * 1024)
    with pytest.raises(ValueError):
        K.gemv_wgmma_mode("yes")
    assert K.gemv_wgmma_mode("wide") == "wide"


def test_engine_config_maps_the_switch(monkeypatch):
    from q27py.config import Q27Config, apply_env

    assert Q27Config().engine.gemv_wgmma == "all"
    monkeypatch.setenv("Q27_GEMV_WGMMA", "auto")
    assert apply_env(Q27Config()).engine.gemv_wgmma == "auto"


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_sm90a_build_keeps_wgmma_async_and_does_not_spill(tmp_path):
    rep = nvcc_build.sm90a_report(tmp_path, "gemv_wg")
    assert sorted(rep) == sorted(["gemv8w_q4_n16", "gemv8w_q4_n16_g", "gemv8w_q4_n16q", "gemv8w_q4_n16t", "gemv8w_q4_n16w",
                           "gemv8w_q4_n32", "gemv8w_q4_n32s", "gemv8w_q4_n8", "gemv8w_q4_n8_g", "gemv8w_q4_n8_gf",
                           "gemv8w_q4_n8_nf", "gemv8w_q4_n8d", "gemv8w_q4_n8d_g", "gemv8w_q4_n8d_gf", "gemv8w_q4_n8d_nf",
                           "gemv8w_q4_n8q", "gemv8w_q4_n8w", "gemv8w_q4_n16t_walk", "gemv8w_q4_n8_walk",
                           "gemv8w_q4_n8d_walk", "gemv8w_q4_n8_nt", "gemv8w_q4_n8d_nt"]), rep
    ctas = {"gemv8w_q4_n8": C.GWG_CTAS_N8, "gemv8w_q4_n16": C.GWG_CTAS_N16, "gemv8w_q4_n32": C.GWG_CTAS_N32,
            "gemv8w_q4_n16t": C.GWG_CTAS_N16T, "gemv8w_q4_n32s": C.GWG_CTAS_N32S,
            "gemv8w_q4_n8w": C.GWG_CTAS_N8, "gemv8w_q4_n16w": C.GWG_CTAS_N16, "gemv8w_q4_n8q": C.GWG_CTAS_N8Q,
            "gemv8w_q4_n16q": C.GWG_CTAS_N16Q, "gemv8w_q4_n8d": C.GWG_CTAS_N8D}
    ctas.update({k + "_g": ctas[k] for k in ("gemv8w_q4_n8", "gemv8w_q4_n8d", "gemv8w_q4_n16")})  # GEMV_MERGE's twins
    ctas.update({k + sfx: ctas[k] for k in ("gemv8w_q4_n8", "gemv8w_q4_n8d") for sfx in ("_nf", "_gf")})  # the folds
    ctas.update({k + "_walk": ctas[k] for k in ("gemv8w_q4_n8", "gemv8w_q4_n8d", "gemv8w_q4_n16t")})  # MLP_WALK
    ctas.update({k + "_nt": ctas[k] for k in ("gemv8w_q4_n8", "gemv8w_q4_n8d")})  # NORM_TAIL
    bound = {k: min(255, 65536 // (128 * ctas[k])) for k in rep}
    assert all(regs <= bound[k] for k, (regs, _spill) in rep.items()), rep
    # n32s (launches of more than a wave at 32 lanes, which the engine does not run yet) spills ~120 bytes at 3
    # CTAs per SM, and the 16-lane MLP walk (an experiment, off: MLP_WALK_LANES 8) 24 bytes; every other entry none
    tolerated = {"gemv8w_q4_n32s": 128, "gemv8w_q4_n16t_walk": 32}
    assert all(spill <= tolerated.get(k, 0) for k, (_regs, spill) in rep.items()), rep


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_trace_build_stamps_every_phase(tmp_path, monkeypatch):
    """tools/gemv_trace.py --impl a8w: with GEMV_TRACE = 1 gemv_wg.cu builds for sm_90a with its own gemv_trace
    buffer, wg_body stamping phases 0-5 and 7 in order (6, the ticket, in gemv_unit_finish); with it 0 the stamps
    compile out (the SASS-identity of that build is what the other tests of this file see)."""
    from q27py.gpu.runtime import CUDA_DIR

    src = (CUDA_DIR / "gemv_wg.cu").read_text()
    body = src[src.index("void wg_body("):]
    body = body[: body.index("\n}\n")]
    stamps = [int(v) for v in re.findall(r"GSTAMP\((\d)\)", body)]
    assert stamps == [0, 1, 2, 3, 4, 4, 5, 7], stamps  # 4 once in each walk's branch
    assert "GSTAMP(6)" in (CUDA_DIR / "gemv_common.cuh").read_text()
    for on in (0, 1):
        monkeypatch.setattr(C, "GEMV_TRACE", on)
        r = nvcc_build.build_with(tmp_path, "gemv_wg", nvcc_build.SM90A)
        assert r.returncode == 0, r.stderr[-2000:]
        assert (b"gemv_trace" in (tmp_path / "gemv_wg.cubin").read_bytes()) == bool(on)


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


def plan_inputs(cp, K, specs, n, seed):
    """(matrices, kpad, rows, x) of one GEMV plan test: seeded matrices specs [(rows, cols, fmt, mode)] and n lanes
    of uniform activations in a buffer of max(16, n) rows."""
    mats = [K.random_matrix(r, c, f, seed=seed + 7 * j, scale=0.01 if f != L.FMT_BF16 else 0.05, mode=mode)
            for j, (r, c, f, mode) in enumerate(specs)]
    kpad = mats[0].shape.kpad
    rows = max(16, n)
    x = cp.zeros((rows, kpad), dtype=cp.float32)
    K.fill_uniform(x, seed + 3, -1.0, 1.0)
    return mats, kpad, rows, x


def run_plan(rt, plan, x, kpad, n, record=None) -> None:
    """plan.run on the GEMV (no GEMM route); record: a list that gets each launch's (module, kernel)."""
    if record is None:
        plan.run(x, kpad, n, allow_gemm=False)
        return
    real = rt.launch

    def rec(module, kernel, *a, **kw):
        record.append((module, kernel))
        return real(module, kernel, *a, **kw)

    rt.launch = rec
    try:
        plan.run(x, kpad, n, allow_gemm=False)
    finally:
        del rt.launch  # the instance attribute: back to the class's method


def _pair(cp, K, specs, n, partition=None, seed=0, record=None):
    """(wgmma outputs, mma.sync outputs) of one plan over matrices specs [(rows, cols, fmt, mode)]; past 16
    lanes "off" runs gemv8_q4_* as 16-lane blocks, "all" one gemv8w_q4_n32 launch per block of <= 32.
    record: a list that gets the "all" run's (module, kernel) launches."""
    from q27py.gpu.runtime import Runtime

    mats, kpad, rows, x = plan_inputs(cp, K, specs, n, seed)
    outs = {}
    rt = Runtime.get()
    for wg in ("all", "off"):
        ws = K.Workspace()
        ys = []
        for (r, _, _, mode), m in zip(specs, mats):
            rows_out = r // 2 if mode == K.MODE_SWIGLU else r
            y = cp.full((rows, rows_out), 0.25 if mode == K.MODE_ADD else np.nan, dtype=cp.float32)
            ys.append(y)
        plan = K.GemvPlan(mats, [(y, y.shape[1]) for y in ys], ws, impl="a8", partition=partition, wgmma=wg)
        run_plan(rt, plan, x, kpad, n, record if wg == "all" else None)
        outs[wg] = [y[:n].get() for y in ys]
    return outs["all"], outs["off"]


def _specs_27b(name: str) -> list[tuple[int, int, int, int]]:
    """The 27B's launch `name` (q4s tier) as _pair's matrix specs."""
    from q27py.gpu import kernels as K

    return {
        "gate_up": [(34816, 5120, L.FMT_Q4, K.MODE_SWIGLU)],
        "down": [(5120, 17408, L.FMT_Q4, K.MODE_ADD)],
        "gdn_in": [(16384, 5120, L.FMT_Q4, K.MODE_STORE), (96, 5120, L.FMT_BF16, K.MODE_STORE)],
        "attn_in": [(12288, 5120, L.FMT_Q4, K.MODE_STORE), (2048, 5120, L.FMT_Q8, K.MODE_STORE)],
        "gdn_out": [(5120, 6144, L.FMT_Q4, K.MODE_ADD)],
        "lm_head": [(248320, 5120, L.FMT_Q4, K.MODE_STORE)],
    }[name]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gate_up", "down", "gdn_in", "attn_in", "gdn_out", "lm_head"])
@pytest.mark.parametrize("n", [1, 3, 8, 9, 16])
def test_wg_is_bitwise_gemv8_on_the_27b_launches(cp, name, n):
    from q27py.gpu import kernels as K

    got, ref = _pair(cp, K, _specs_27b(name), n, seed=n)
    for a, b in zip(got, ref):
        assert np.isfinite(b).all()
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gate_up", "down", "gdn_in", "attn_in", "gdn_out", "lm_head"])
@pytest.mark.parametrize("n", [17, 24, 32])
def test_n32_is_bitwise_gemv8_on_the_27b_launches(cp, name, n):
    """17-32 lanes: each q4 launch as ONE gemv8w_q4_n32 launch (its two-pass walk, the two-half scales)
    against gemv8_q4_* run as two 16-lane blocks, bit for bit; the q8 / bf16 launches beside it on their
    16-lane launches."""
    from q27py.gpu import kernels as K

    seen = []
    got, ref = _pair(cp, K, _specs_27b(name), n, seed=n, record=seen)
    # one 32-lane launch: the plain entry, or where kernels._wg_three says so (GWG_N32_SUB; by default 2, launches of
    # more than one wave: gate_up and the lm_head) its 3-CTA twin gemv8w_q4_n32s, bitwise the same
    wg = [k for m, k in seen if m == "gemv_wg"]
    allowed = {0: [["gemv8w_q4_n32"]], 1: [["gemv8w_q4_n32s"]]}.get(C.GWG_N32_SUB, [["gemv8w_q4_n32"], ["gemv8w_q4_n32s"]])
    assert wg in allowed, seen
    assert [k for _, k in seen].count("quant_act8") == 2
    for a, b in zip(got, ref):
        assert np.isfinite(b).all()
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols,splits", [(300, 640, 1), (300, 640, 2), (1040, 5120, 7), (64, 4096, 9),
                                              (200, 320, 1), (5120, 17408, 5)])
@pytest.mark.parametrize("n", [1, 9, 16, 17, 32])
def test_wg_is_bitwise_gemv8_under_forced_splits(cp, rows, cols, splits, n):
    """Splits whose K ranges are not whole stages (partial last stages; at 17 / 32 lanes those of either
    pass), units of fewer than 8 chunks (200 x 320: 5 chunks, residues that stay empty), the ticket path's
    ordered sums (32-lane partial tiles)."""
    from q27py.gpu import kernels as K

    got, ref = _pair(cp, K, [(rows, cols, L.FMT_Q4, K.MODE_STORE)], n, partition=(1, splits), seed=rows + splits)
    np.testing.assert_array_equal(got[0].view(np.uint32), ref[0].view(np.uint32))
    assert np.isfinite(ref[0]).all()


def _switched_pair(cp, monkeypatch, switch, specs, n, seed, partition=None):
    """_pair with the constants table's `switch` on (an experimental gemv_wg entry); the outputs are asserted bit
    for bit equal and finite here, the "all" run's launches returned for the caller's entry check."""
    from q27py.gpu import kernels as K

    monkeypatch.setattr(C, "GWG_DEEP", 0)  # the default deep-ring entry would take some 8-lane launches first
    monkeypatch.setattr(C, switch, 1)
    if switch == "GWG_DEEP":  # every launch of one wave at its residency, whatever its units' length (short K ranges too)
        monkeypatch.setattr(C, "GWG_DEEP_MIN_CHUNKS", 1)
    seen = []
    got, ref = _pair(cp, K, specs, n, partition=partition, seed=seed, record=seen)
    for a, b in zip(got, ref):
        assert np.isfinite(b).all()
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    return [k for m, k in seen if m == "gemv_wg"]


# The experimental gemv_wg entries, each behind its constants-table switch: (switch, the entries it may launch, lane
# counts, a seed offset, the test id's name). Each must give gemv8_q4_*'s bits at every width it takes.
SWITCHED = [
    ("GWG_N16_TWO", ("gemv8w_q4_n16t",), (9, 16), 5, "n16t"),  # the two-pass walk at 16 lanes, 3 CTAs an SM
    ("GWG_N32_SUB", ("gemv8w_q4_n32s",), (17, 32), 7, "n32s"),  # two chunks a tensor-core batch at 32, 3 CTAs an SM
    ("GWG_WIDE_STAGE", ("gemv8w_q4_n8w", "gemv8w_q4_n16w"), (1, 8, 9, 16), 11, "wide"),  # 8 chunks a stage
    ("GWG_N8_FOUR", ("gemv8w_q4_n8q",), (1, 5, 8), 17, "n8q"),  # the two-pass walk at 8 lanes, 4 CTAs an SM
    ("GWG_N16_FOUR", ("gemv8w_q4_n16q",), (9, 16), 19, "n16q"),  # ... at 16, a chunk a batch, 4 CTAs an SM
    ("GWG_DEEP", ("gemv8w_q4_n8d",), (1, 5, 8), 23, "n8d"),  # the plain walk, an 8-stage ring, 2 CTAs an SM
]
SWITCHED_LANES = [(sw, entries, n, off) for sw, entries, lanes, off, _ in SWITCHED for n in lanes]
SWITCHED_IDS = [f"{tag}-{n}" for _, _, lanes, _, tag in SWITCHED for n in lanes]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["gate_up", "down", "gdn_in", "attn_in", "gdn_out", "lm_head"])
@pytest.mark.parametrize("switch,entries,n,off", SWITCHED_LANES, ids=SWITCHED_IDS)
def test_switched_entries_are_bitwise_gemv8_on_the_27b_launches(cp, monkeypatch, name, switch, entries, n, off):
    wg = _switched_pair(cp, monkeypatch, switch, _specs_27b(name), n, n + off)
    if switch == "GWG_N32_SUB":
        assert wg == ["gemv8w_q4_n32s"], wg  # one 32-lane launch
    elif switch == "GWG_DEEP":
        # only launches of one wave at 2 CTAs an SM (not gate_up's 544 units nor the lm_head's 3,880)
        assert ("gemv8w_q4_n8d" in wg) == (name not in ("gate_up", "lm_head")), wg
    elif switch == "GWG_WIDE_STAGE" and n > 8:
        # at 9-16 lanes only the launches on the plain 2-CTA entry (gate_up and the lm_head keep n16t)
        assert set(wg) <= {"gemv8w_q4_n16w", "gemv8w_q4_n16t"} and wg, wg
    else:
        assert any(k in entries for k in wg), wg


@pytest.mark.gpu
@pytest.mark.parametrize("rows,cols,splits", [(300, 640, 1), (300, 640, 2), (1040, 5120, 7), (64, 4096, 9),
                                              (200, 320, 1), (5120, 17408, 5)])
@pytest.mark.parametrize("switch,entries,n,off", SWITCHED_LANES, ids=SWITCHED_IDS)
def test_switched_entries_are_bitwise_gemv8_under_forced_splits(cp, monkeypatch, rows, cols, splits, switch, entries, n,
                                                                off):
    """Partial last stages (K ranges that are not whole stages, of either pass), units shorter than a stage."""
    _switched_pair(cp, monkeypatch, switch, [(rows, cols, L.FMT_Q4, 0)], n, rows + splits + off,
                   partition=(1, splits))


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


def test_four_cta_8_lane_entry_selection_and_fit(monkeypatch):
    """GWG_N8_FOUR: 1-8 lanes on gemv8w_q4_n8q (the two-pass walk, GWG_CTAS_N8Q CTAs an SM in the plain ring's shared
    memory); 16 / 32 lanes keep theirs."""
    from q27py.gpu import kernels as K

    monkeypatch.setattr(C, "GWG_N8_FOUR", 1)
    assert K.gemv_wg_kernel(8) == "gemv8w_q4_n8q" and K.gemv_wg_ctas(8) == C.GWG_CTAS_N8Q == 4
    assert K.gemv_wg_kernel(16) == "gemv8w_q4_n16" and K.gemv_wg_kernel(32) == "gemv8w_q4_n32"
    assert C.GWG_CTAS_N8Q * (K.gemv_wg_shared_bytes(8) + 128 + 1024) <= 228 * 1024
    monkeypatch.setattr(C, "GWG_N8_FOUR", 0)
    assert K.gemv_wg_kernel(8) == "gemv8w_q4_n8" and K.gemv_wg_ctas(8) == C.GWG_CTAS_N8
    monkeypatch.setattr(C, "GWG_N16_FOUR", 1)
    assert K.gemv_wg_kernel(16) == K.gemv_wg_kernel(16, 10**6) == "gemv8w_q4_n16q"
    assert K.gemv_wg_ctas(16) == K.gemv_wg_ctas(16, 10**6) == C.GWG_CTAS_N16Q == 4
    stage = C.GWG_CPS * (C.GEMV_R * 512 + C.GEMV_R * 32 + 16 * 64 + 16 * 4)
    assert K.gemv_wg_shared_bytes(16) == C.GWG_STAGES_N16Q * stage == 52224
    assert C.GWG_CTAS_N16Q * (K.gemv_wg_shared_bytes(16) + 128 + 1024) <= 228 * 1024
    assert C.GWG_CPS % C.GWG_SUB_N16Q == 0
