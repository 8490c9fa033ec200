"""Prefill attention v3 (cuda/attention_prefill3.cu): v2's contract on sm_90a warpgroup MMA.

v3 is v2 with the products moved from mma.sync to wgmma: the same 128-row tiles, 64-key tiles, key
blocks and combine, the same bf16 rounding of Q and P and the same order of every softmax step, so
it belongs to v2's tolerance class (test_attention_prefill2.py: TOL_V2 against float64, TOL_EMU
against the emulation). Whether its bits equal v2's depends only on how the tensor core sums one
k16 step inside mma.sync and inside wgmma; the GPU test reports it and holds v3 to TOL_EMU of v2.

CPU tests: the shared-memory image the kernel writes (pf3_off) read back through the wgmma
descriptors it builds (pf3_desc), decoded by the PTX ISA's canonical layouts (K-major and MN-major,
128-byte swizzle) -- every operand element of every k16 step lands where the math needs it; the
sm_90a build (no spills, no serialized wgmma) and the guard against a plain sm_90 build; the
selection rule. GPU tests (marked): v3 against float64, the emulation and v2; chunking-invariant
bits; a warm turn over a 20K-token cache.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from q27py.gpu import constants as C

sys.path.insert(0, str(Path(__file__).parent))  # helpers beside this file (tests/ is no package)
import nvcc_build  # noqa: E402
from nvcc_build import NVCC  # noqa: E402

HD, NK, ROWS = C.PF3_HD, C.PF3_NK, 16 * C.PF3_WARPS


# ---------------------------------------------------------------- CPU: tiles and descriptors
def pf3_off(rows: int, r: int, cc: int) -> int:
    """cuda/attention_prefill3.cu pf3_off: byte offset of 16-byte chunk cc of row r in a [HD/64][rows][128 B] tile."""
    return (cc >> 3) * rows * 128 + r * 128 + (((cc & 7) ^ (r & 7)) << 4)


def pf3_desc(addr: int, lbo: int, sbo: int) -> int:
    """cuda/attention_prefill3.cu pf3_desc (128-byte swizzle)."""
    return ((addr & 0x3FFFF) >> 4) | (((lbo & 0x3FFFF) >> 4) << 16) | (((sbo & 0x3FFFF) >> 4) << 32) | (1 << 62)


def decode(desc: int) -> tuple[int, int, int, int]:
    """PTX ISA "Matrix Descriptor Format": start, leading / stride byte offsets, swizzle mode."""
    return (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4, (desc >> 62) & 3


def swizzle128(a: int) -> int:
    """Swizzle<3,4,3> on byte addresses: the 16-byte chunk bits 4-6 XOR the 128-byte row bits 7-9."""
    return a ^ (((a >> 7) & 7) << 4)


def read_kmajor(smem: np.ndarray, desc: int, rows: int) -> np.ndarray:
    """A K-major 128B-swizzled operand of one k16 step ([rows][16] bf16 bits) as the tensor core reads it:
    ((8, m), (T, 2)) : ((8T, SBO), (1, T)) elements, T = 8 bf16 per 16 bytes (PTX canonical layouts)."""
    start, _, sbo, mode = decode(desc)
    assert mode == 1
    out = np.empty((rows, 16), np.uint16)
    for r in range(rows):
        for k in range(16):
            a = start + (r % 8) * 128 + (r // 8) * sbo + 2 * k
            out[r, k] = smem[swizzle128(a) // 2]
    return out


def read_mnmajor(smem: np.ndarray, desc: int, n: int) -> np.ndarray:
    """An MN-major 128B-swizzled B operand of one k16 step ([16 k][n] bf16 bits):
    ((T, 8, m), (8, k)) : ((1, T, LBO), (8T, SBO)) elements."""
    start, lbo, sbo, mode = decode(desc)
    assert mode == 1
    out = np.empty((16, n), np.uint16)
    for k in range(16):
        for j in range(n):
            a = start + 2 * (j % 64) + (j // 64) * lbo + (k % 8) * 128 + (k // 8) * sbo
            out[k, j] = smem[swizzle128(a) // 2]
    return out


def write_tile(smem: np.ndarray, base: int, mat: np.ndarray) -> None:
    """The kernel's 16-byte chunk stores of a [rows][HD] bf16 matrix at byte `base`."""
    rows = mat.shape[0]
    for r in range(rows):
        for cc in range(HD // 8):
            off = base + pf3_off(rows, r, cc)
            smem[off // 2 : off // 2 + 8] = mat[r, cc * 8 : cc * 8 + 8]


def test_descriptors_read_the_tiles_the_kernel_writes():
    """Q (A of S, per warpgroup), K (B of S) and V (B of O, transposed) through the kernel's own
    descriptor arithmetic: every k16 step reads exactly the logical operand."""
    rng = np.random.default_rng(3)
    q = rng.integers(0, 1 << 16, (ROWS, HD), dtype=np.uint16)
    k = rng.integers(0, 1 << 16, (NK, HD), dtype=np.uint16)
    v = rng.integers(0, 1 << 16, (NK, HD), dtype=np.uint16)
    q_base = 1024 * 5  # any 1024-aligned base (the kernel aligns its dynamic shared memory)
    st = q_base + ROWS * HD * 2
    kv_bytes = NK * HD * 2
    smem = np.zeros((st + 2 * kv_bytes) // 2, np.uint16)
    write_tile(smem, q_base, q)
    write_tile(smem, st, k)
    write_tile(smem, st + kv_bytes, v)
    for wg in range(2):
        for kk in range(HD // 16):
            da = pf3_desc(q_base + (kk >> 2) * ROWS * 128 + wg * 64 * 128 + (kk & 3) * 32, 16, 1024)
            np.testing.assert_array_equal(read_kmajor(smem, da, 64), q[wg * 64 : wg * 64 + 64, kk * 16 : kk * 16 + 16])
    for kk in range(HD // 16):
        db = pf3_desc(st + (kk >> 2) * NK * 128 + (kk & 3) * 32, 16, 1024)
        # B of S = Q K^T is K^T: element (k = dim, n = key) = K[key][dim]; K-major means [n][k] rows
        np.testing.assert_array_equal(read_kmajor(smem, db, NK), k[:, kk * 16 : kk * 16 + 16])
    for kk in range(NK // 16):
        dv = pf3_desc(st + kv_bytes + kk * 16 * 128, NK * 128, 1024)
        np.testing.assert_array_equal(read_mnmajor(smem, dv, HD), v[kk * 16 : kk * 16 + 16, :])


def test_tiles_are_bank_conflict_free_for_the_chunk_stores():
    """8 consecutive rows' stores of one logical chunk (a quarter warp's 16-byte stores) hit 8 distinct
    16-byte bank groups of a 128-byte line: the swizzle keeps the cp.async and Q stores conflict-free."""
    for rows in (ROWS, NK):
        for r0 in range(0, rows, 8):
            for cc in range(HD // 8):
                groups = {(pf3_off(rows, r0 + i, cc) % 128) // 16 for i in range(8)}
                assert len(groups) == 8


def test_selection_rule(monkeypatch):
    from q27py.config import Q27Config, apply_env
    from q27py.gpu import kernels as K

    assert apply_env(Q27Config(), {"Q27_ATTN_PREFILL_WGMMA": "1"}).engine.attn_prefill_wgmma is True
    assert apply_env(Q27Config(), {"Q27_ATTN_PREFILL_WGMMA": "0"}).engine.attn_prefill_wgmma is False
    monkeypatch.setattr(K, "ATTN_PREFILL_WGMMA", True)
    big = 227 * 1024
    assert all(K.attention_prefill3_bytes(f) <= big for f in K.PF3_FORMS)  # sm_90's opt-in: every form fits
    assert K.attention_prefill3_supported(256, False, (9, 0), big)
    assert not K.attention_prefill3_supported(256, True, (9, 0), big)  # fp8 KV keeps v2
    assert not K.attention_prefill3_supported(128, False, (9, 0), big)  # one head dim
    assert not K.attention_prefill3_supported(256, False, (8, 0), 163 * 1024)  # no wgmma before sm_90
    assert not K.attention_prefill3_supported(256, False, (12, 0), big)  # no sm_90a build on sm_120
    monkeypatch.setattr(K, "ATTN_PREFILL_WGMMA", False)
    assert not K.attention_prefill3_supported(256, False, (9, 0), big)


# ---------------------------------------------------------------- CPU: build
@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_sm90a_build_keeps_registers_and_async_wgmma(tmp_path):
    """The sm_90a build: no spills under the 255-register bound of 8 warps, and no ptxas C7510
    ("wgmma serialized"), which would wait after every wgmma."""
    rep = nvcc_build.sm90a_report(tmp_path, "attention_prefill3")
    assert sorted(rep) == ["attn_prefill3_bf16_d256", "attn_prefill3_bf16_d256_pipe", "attn_prefill3_bf16_d256_ws"], rep
    assert all(spill == 0 and regs <= 255 for regs, spill in rep.values()), rep


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_plain_sm90_build_is_refused_when_sm90a_was_asked(tmp_path):
    nvcc_build.assert_refused_without_sm90a(tmp_path, "attention_prefill3", "sm_90")


# ---------------------------------------------------------------- GPU
@pytest.fixture(scope="module")
def cp():
    import cupy

    from q27py.gpu import kernels as K
    from q27py.gpu.runtime import Runtime

    rt = Runtime.get()
    if rt.arch_target("attention_prefill3") is None:
        pytest.skip("no sm_90a build on this card")
    rt.module("attention_prefill3")
    rt.module("attention_prefill2")
    K.ATTN_PREFILL_WGMMA = False  # each test selects per call
    return cupy


@pytest.fixture(scope="module")
def v2t():
    import test_attention_prefill2 as v2t  # the v2 test harness (Case, emulation, tolerances)

    return v2t


def run(case, cp, K, wgmma: bool, form: str = "sync", **kw):
    saved = K.ATTN_PREFILL_WGMMA, K.PF3_FORM
    K.ATTN_PREFILL_WGMMA, K.PF3_FORM = wgmma, form
    try:
        assert K.attention_prefill3_supported(case.hd, case.fp8) == wgmma
        return case.run(cp, K, **kw)
    finally:
        K.ATTN_PREFILL_WGMMA, K.PF3_FORM = saved


CASES = [(17, 300), (64, 0), (600, 700), (600, 5000), (2048, 0), (2048, 3000), (4096, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["sync", "ws", "pipe"])
@pytest.mark.parametrize("t,pos0", CASES)
def test_v3_matches_float64_the_emulation_and_v2(cp, v2t, t, pos0, form):
    from q27py.gpu import kernels as K

    case = v2t.Case(t, pos0, 256, 24, 4, False, seed=t + pos0 + 7)
    got = run(case, cp, K, True, form)
    two = run(case, cp, K, False)
    lanes = v2t.sample_lanes(t, seed=t)
    err = v2t.rel(got[lanes], case.reference(lanes))
    err_emu = v2t.rel(got[lanes], case.emulation(lanes, C.PF2_NK_A))
    err_v2 = v2t.rel(got, two)
    print(f"\nv3 {form} 27B T={t} pos0={pos0}: rel L2 vs float64 {err:.3g}, vs emulation {err_emu:.3g}, vs v2 {err_v2:.3g} "
          f"({'bitwise v2' if np.array_equal(got, two) else 'not bitwise v2'})")
    assert err < v2t.TOL_V2
    assert err_emu < v2t.TOL_EMU
    assert err_v2 < v2t.TOL_EMU


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["sync", "ws", "pipe"])
def test_v3_bits_do_not_depend_on_chunking(cp, v2t, form):
    """As v2's: one launch of 900 lanes at 3800, two launches split off a tile boundary, and lane pieces
    forced by a small partials scratch all give identical bits (and the two forms the same bits)."""
    from q27py.gpu import kernels as K

    case = v2t.Case(900, 3800, 256, 24, 4, False, seed=11)
    whole = run(case, cp, K, True, form)
    parts = run(case, cp, K, True, form, lanes=(0, 333))
    rest = run(case, cp, K, True, form, lanes=(333, 900))
    parts[333:] = rest[333:]
    assert np.array_equal(whole, parts)
    nblk = K.attention_prefill2_blocks(case.pos0 + case.t)
    pieces = run(case, cp, K, True, form, part_floats=K.attention_prefill2_part_floats(100, 24, 256, nblk))
    assert np.array_equal(whole, pieces)
    for other in ("sync", "ws", "pipe"):
        assert np.array_equal(whole, run(case, cp, K, True, other)), other


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["sync", "ws", "pipe"])
def test_v3_warm_turn_over_a_long_cache(cp, v2t, form):
    from q27py.gpu import kernels as K

    case = v2t.Case(80, 20000, 256, 24, 4, False, seed=5)
    got = run(case, cp, K, True, form)
    lanes = v2t.sample_lanes(80, n=12)
    assert v2t.rel(got[lanes], case.reference(lanes)) < v2t.TOL_V2
