"""The tensor-core decode / verify attention (cuda/attention.cu attn_mma_*, kernels.attention_mma).

CPU (no GPU needed): the numpy transliteration of the kernel (attn_mma_emu.py: staging swizzle,
ldmatrix / movmatrix / mma fragment maps, online softmax, partials, combine) against float64
attention, and the split / shared-memory arithmetic.
GPU: the kernel against float64 attention over the cache as stored (bf16 rows; fp8 rows
dequantized by kvformat) and against the split kernel; bitwise lane-width invariance; the
partials it writes agree with kernels.attention_mma_split_size; FastModel with
attn_decode="mma" against "split".

Tolerances: hi + lo kernels (Q and P as bf16 pairs): 2e-5 relative, the split kernel's class;
the "_bq" kernels (Q, P rounded to bf16 once: sm_80-89 at head dim 256): 5e-3.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.gpu import constants as C
from q27py.gpu import kernels as K
from q27py.gpu import layout as L
from q27py.model import kvformat as F
from q27py.model import ops

sys.path.insert(0, str(Path(__file__).parent))  # the emulator beside this file (tests/ is no package)
import attn_mma_emu as E  # noqa: E402

TOL, TOL_BQ = 2e-5, 5e-3
SPAN = 16


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make_case(seed, nlanes, nq, nkv, hd, pos0, fp8, pad=5):
    """q, gate, the cache as stored (bf16 values / e4m3 codes + exponents) and as attention sees it."""
    rng = np.random.default_rng(seed)
    max_pos = pos0 + SPAN + pad
    q = rng.standard_normal((nlanes, nq, hd)).astype(np.float32)
    kf = rng.standard_normal((nkv, max_pos, hd)).astype(np.float32) * 1.5
    vf = rng.standard_normal((nkv, max_pos, hd)).astype(np.float32)
    gate = rng.standard_normal((nlanes, nq, hd)).astype(np.float32)
    if fp8:
        kc, kx = F.fp8_quantize(kf)
        vc, vx = F.fp8_quantize(vf)
        kd, vd = F.fp8_dequantize(kc, kx), F.fp8_dequantize(vc, vx)
        return dict(q=q, gate=gate, kc=kc, vc=vc, kx=kx, vx=vx, kd=kd, vd=vd, max_pos=max_pos)
    kd, vd = F.bf16_round(kf), F.bf16_round(vf)
    return dict(q=q, gate=gate, kc=kd, vc=vd, kx=None, vx=None, kd=kd, vd=vd, max_pos=max_pos)


def reference(case, pos0):
    q, gate = case["q"], case["gate"]
    n = pos0 + q.shape[0]
    keys = case["kd"][:, :n].transpose(1, 0, 2).astype(np.float64)
    vals = case["vd"][:, :n].transpose(1, 0, 2).astype(np.float64)
    return ops.attention(q.astype(np.float64), keys, vals, np.arange(pos0, n), q.shape[2] ** -0.5) * ops.sigmoid(
        gate.astype(np.float64))


# ---------------------------------------------------------------- CPU: the transliteration
@pytest.mark.parametrize("hd,nq,nkv,nlanes,pos0,fp8,qsplit", [
    (64, 4, 2, 3, 63, False, True),      # the tiny models' heads; pos0 + span straddles a split
    (32, 4, 1, 5, 40, True, True),
    (64, 4, 2, 16, 0, False, True),      # first positions: partial first tile, splits past the end
    (64, 4, 2, 2, 97, True, False),      # the _bq variant: Q, P rounded once
    (256, 12, 2, 16, 30, False, True),   # 27B heads (rep 6) at full verify width: 12 warps of 8 rows
])
def test_emulated_kernel_matches_attention(hd, nq, nkv, nlanes, pos0, fp8, qsplit):
    case = make_case(hd + pos0, nlanes, nq, nkv, hd, pos0, fp8)
    nsplit = 2
    kx = None if case["kx"] is None else case["kx"].astype(np.int32)
    vx = None if case["vx"] is None else case["vx"].astype(np.int32)
    part = E.attn_mma(case["q"], case["kc"], case["vc"], pos0, SPAN, nsplit, nq, nkv, qsplit, kx, vx)
    got = E.combine(part, pos0, SPAN, nsplit, case["gate"])
    assert rel(got, reference(case, pos0)) < (TOL if qsplit else TOL_BQ)


def test_emulated_lane_bits_do_not_depend_on_width():
    """Lane t's partials are the same bits at W = t + 1 and W = 16 (the extra tiles and rows a wider
    launch walks leave a row's accumulators untouched), in the transliteration's arithmetic."""
    hd, nq, nkv, pos0 = 64, 4, 2, 60
    case = make_case(3, 16, nq, nkv, hd, pos0, False)
    full = E.attn_mma(case["q"], case["kc"], case["vc"], pos0, SPAN, 2, nq, nkv)
    ssz = K.attention_mma_split_size(pos0, SPAN, 2)
    for w in (1, 5, 9):
        part = E.attn_mma(case["q"][:w], case["kc"], case["vc"], pos0, SPAN, 2, nq, nkv)
        for t in range(w):  # the splits the combine reads for lane t (a wider launch also writes later ones)
            ns = -(-(pos0 + t + 1) // ssz)
            np.testing.assert_array_equal(part[t, :, :ns], full[t, :, :ns])


def test_split_sizes_cover_the_positions_in_fixed_tiles():
    for nkv, sms in ((4, 132), (4, 82), (2, 128), (1, 108), (8, 132)):
        ns = K.attention_mma_splits(nkv, sms)
        assert 1 <= ns <= C.ATTD_NSPLIT_MAX
        for pos0 in (0, 1, 63, 64, 2047, 2048, 32767, 131071, 262143):
            ssz = K.attention_mma_split_size(pos0, SPAN, ns)
            assert ssz % C.ATTD_KT == 0 and ssz >= C.ATTD_MIN_SPLIT
            assert ssz * ns >= pos0 + SPAN  # every position of the last lane has a split
    assert C.ATTD_MIN_SPLIT % C.ATTD_KT == 0
    # all SMs stream at 2K / 32K / 128K on the H200 (4 kv heads): >= 1 CTA per SM
    ns = K.attention_mma_splits(4, 132)
    for ctx in (2048, 32768, 131072):
        ssz = K.attention_mma_split_size(ctx, SPAN, ns)
        assert 4 * -(-(ctx + SPAN) // ssz) >= 132


def test_shared_memory_fits_99kb_cards():
    """sm_86 / sm_89 grant 99 KB per block: the bf16 ring and the fp8 tiles + exponents at 262K fit."""
    optin = 101376
    assert K.attention_mma_shared_bytes(256, False, 262144, SPAN, K.attention_mma_splits(4, 82)) <= optin
    assert K.attention_mma_shared_bytes(256, True, 262144, SPAN, K.attention_mma_splits(4, 82)) <= optin
    assert C.ATTD_MAX_WARPS * C.ATTD_ROWS >= SPAN * 6  # the 27B's verify rows fit one CTA


# The 27B attention shapes (24 q heads, 4 kv heads, head dim 256) as the engine and attn_probe launch them:
# partials sized for VERIFY_SPAN lanes and max(NSPLIT, mma splits), q with VERIFY_SPAN rows.
PROBE_CASES = [  # (SMs, ctx, max_pos, W, fp8): attn_probe (max_pos = ctx + 16) and engine-sized caches
    (132, 2048, 2048 + SPAN, 1, True), (132, 2048, 2048 + SPAN, 16, True),
    (132, 32768, 32768 + SPAN, 1, True), (132, 32768, 32768 + SPAN, 16, True),
    (132, 131072, 131072 + SPAN, 1, True), (132, 131072, 131072 + SPAN, 16, True),
    (132, 131072, 131072 + SPAN, 16, False),
    (132, 40960, 131072 + 64, 8, True),        # the long-context GPU test below
    (132, 2048, 262144, 16, True),             # a short sequence in a 256K cache
    (82, 262144 - SPAN, 262144, 16, True),     # sm_86 (82 SMs) at a full 256K cache
    (170, 131072, 131072 + SPAN, 8, True),     # sm_120 (170 SMs)
]


@pytest.mark.parametrize("sms,ctx,max_pos,w,fp8", PROBE_CASES)
def test_index_math_at_27b_shapes_stays_in_bounds(sms, ctx, max_pos, w, fp8):
    """Every address attn_mma_body / attn_mma_combine form at the 27B shapes (cp.async sources, ring
    slots, the fp8 conversion tile and row exponents in shared memory, ldmatrix rows, q, partials) lies
    in its buffer, 16-byte aligned where the instruction needs it, and no 32-bit index overflows --
    the long-context fp8 launches the 27B probe made (issue 17) included. The split kernel likewise."""
    nq, nkv, hd = 24, 4, 256
    ns = K.attention_mma_splits(nkv, sms)
    pos0 = ctx - w  # the last lane sees ctx positions
    buf = dict(part_lanes=SPAN, part_nsplit=max(C.NSPLIT, ns), q_rows=SPAN)
    assert E.mma_index_check(hd, nq, nkv, w, pos0, SPAN, ns, max_pos, fp8, **buf) == []
    if ctx <= 32768:
        assert E.split_index_check(hd, nq, nkv, w, pos0, SPAN, max_pos, fp8, SPAN, buf["part_nsplit"]) == []


@pytest.mark.parametrize("fp8", [False, True])
def test_index_check_sees_a_position_past_the_cache(fp8):
    """The check is not vacuous: a pos0 beyond the cache (what a kernel sees when it reads a pos0 that
    was never written -- the probe's stream race, issue 17) reads past K / V and, for fp8, past the row
    exponents and the shared exponent table; likewise a partials buffer sized for fewer splits."""
    nq, nkv, hd, ns = 24, 4, 256, K.attention_mma_splits(4, 132)
    bad = E.mma_index_check(hd, nq, nkv, 1, 5000, SPAN, ns, 2048 + SPAN, fp8, part_lanes=SPAN, part_nsplit=ns)
    what = {w for w, _ in bad}
    assert "cp.async K/V source" in what
    assert ("kx / vx rows" in what and "exponent smem" in what) == fp8
    assert {w for w, _ in E.split_index_check(hd, nq, nkv, 1, 5000, SPAN, 2048 + SPAN, fp8)} >= {"K/V row"}
    short = E.mma_index_check(hd, nq, nkv, 16, 32768 - 16, SPAN, ns, 32768 + SPAN, fp8, part_lanes=SPAN,
                              part_nsplit=C.NSPLIT - 8)
    assert "partials" in {w for w, _ in short}


def test_env_selects_the_kernel(monkeypatch):
    from q27py.config import Q27Config, apply_env

    monkeypatch.setattr(K, "ATTN_DECODE", None)
    monkeypatch.setenv("Q27_ATTN_DECODE", "split")
    assert K.attn_decode_default() == "split"  # what FastModel takes when not told (tests/gpu under the env)
    monkeypatch.setattr(K, "ATTN_DECODE", None)
    monkeypatch.delenv("Q27_ATTN_DECODE")
    assert K.attn_decode_default() == "mma"

    assert Q27Config().engine.attn_decode == "mma"  # the default since device run 3 (docs/PERF.md)
    assert apply_env(Q27Config(), {"Q27_ATTN_DECODE": "split"}).engine.attn_decode == "split"
    assert K.attn_decode_mode("mma") == "mma"
    with pytest.raises(ValueError):
        K.attn_decode_mode("flash")


def test_env_selects_fp8_on_the_mma_kernel(monkeypatch):
    """fp8 KV's route onto attn_mma: EngineConfig.attn_decode_fp8 (on since device run c3, issue 17),
    env Q27_ATTN_DECODE_FP8=0|1, read once by kernels.attn_decode_fp8_default (forward.FP8_ATTN_MMA =
    None defers to it; tests force True / False)."""
    from q27py.config import Q27Config, apply_env
    from q27py.gpu import forward

    assert Q27Config().engine.attn_decode_fp8 is True
    assert forward.FP8_ATTN_MMA is None
    assert apply_env(Q27Config(), {"Q27_ATTN_DECODE_FP8": "1"}).engine.attn_decode_fp8 is True
    with pytest.raises(ValueError):
        apply_env(Q27Config(), {"Q27_ATTN_DECODE_FP8": "yes"})
    for env, want in (("1", True), ("0", False)):
        monkeypatch.setattr(K, "ATTN_DECODE_FP8", None)
        monkeypatch.setenv("Q27_ATTN_DECODE_FP8", env)
        assert K.attn_decode_fp8_default() is want
    monkeypatch.setattr(K, "ATTN_DECODE_FP8", None)
    monkeypatch.delenv("Q27_ATTN_DECODE_FP8")
    assert K.attn_decode_fp8_default() is True


# ---------------------------------------------------------------- GPU: the kernel
@pytest.fixture(scope="module")
def cp():
    import cupy

    from q27py.gpu.runtime import Runtime

    Runtime.get().module("attention")
    return cupy


def run_mma(cp, case, pos0, nlanes=None, qsplit=None, poison=False, a8=None):
    """attention_mma on the case's first nlanes lanes -> (out [nlanes, nq, hd], partials); a8: the out plan
    whose int8 activations the combine writes as well."""
    from q27py.gpu.runtime import Runtime

    q, gate = case["q"], case["gate"]
    nlanes = q.shape[0] if nlanes is None else nlanes
    _, nq, hd = q.shape
    nkv, max_pos = case["kc"].shape[0], case["max_pos"]
    fp8 = case["kx"] is not None
    if fp8:
        kd, vd = cp.asarray(case["kc"]), cp.asarray(case["vc"])
        kx, vx = cp.asarray(case["kx"]), cp.asarray(case["vx"])
    else:
        kd, vd = cp.asarray(L.bf16_bits(case["kc"])), cp.asarray(L.bf16_bits(case["vc"]))
        kx = vx = None
    qg = np.zeros((nlanes, nq, 2 * hd), np.float32)
    qg[..., hd:] = gate[:nlanes]
    out = cp.full((nlanes, nq * hd), np.nan, cp.float32)
    nsplit = K.attention_mma_splits(nkv, Runtime.get().sm_count)
    part = cp.full(K.attention_partials_floats(nlanes, nq, hd, nsplit), np.nan if poison else 0, dtype=cp.float32)
    K.attention_mma(cp.asarray(q[:nlanes].reshape(nlanes, -1)), nq * hd, kd, vd, kx, vx, fp8, max_pos, nq, nkv, hd,
                    cp.asarray(np.array([pos0], np.int32)), SPAN, part, cp.asarray(qg.reshape(nlanes, -1)),
                    2 * nq * hd, out, nq * hd, nlanes, qsplit=qsplit, a8=a8)
    return out.get().reshape(nlanes, nq, hd), part.get().reshape(nlanes, nq, nsplit, hd + 2)


def a8_plans(cp, k: int, n: int):
    """Two a8 plans of one random q4 matrix of K = k (the attention out projection's shape)."""
    rng = np.random.default_rng(k + n)
    m = K.upload_packed(L.pack_matrix(rng.standard_normal((80, k)).astype(np.float32) * 0.05, L.FMT_Q4))
    ws = K.Workspace()
    ya, yb = cp.full((n, 80), np.nan, cp.float32), cp.full((n, 80), np.nan, cp.float32)
    return (K.GemvPlan([m], [(ya, 80)], ws, impl="a8"), ya), (K.GemvPlan([m], [(yb, 80)], ws, impl="a8"), yb)


@pytest.mark.gpu
@pytest.mark.parametrize("hd,nq,nkv", [(64, 4, 2), (256, 24, 4)])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("kernel", ["mma", "split"])
def test_combine_writes_the_out_plans_a8_activations(cp, hd, nq, nkv, fp8, kernel):
    """With a8 (attention_a8_fuses) the combine writes, beside the same gated rows, the bytes quant_act8 makes
    from them (codes and chunk scales), so the out projection runs prequantized with the unfused GEMV bits."""
    pos0 = 777
    for t in (1, 9, 16):
        case = make_case(31 + t, t, nq, nkv, hd, pos0, fp8)
        (pa, ya), (pb, yb) = a8_plans(cp, nq * hd, t)
        assert K.attention_a8_fuses(pb, t, nq, hd) and not K.attention_a8_fuses(pb, 17, nq, hd)
        pb.xq.fill(0xAB)
        pb.xs.fill(np.nan)
        if kernel == "mma":
            want, _ = run_mma(cp, case, pos0)
            got, _ = run_mma(cp, case, pos0, a8=pb)
        else:
            qg = np.zeros((t, nq, 2 * hd), np.float32)
            qg[..., hd:] = case["gate"]
            outs = []
            for a8 in (None, pb):
                out = cp.full((t, nq * hd), np.nan, cp.float32)
                part = cp.zeros(K.attention_partials_floats(t, nq, hd), dtype=cp.float32)
                args = (cp.asarray(np.array([pos0], np.int32)), SPAN, part, cp.asarray(qg.reshape(t, -1)), 2 * nq * hd,
                        out, nq * hd, t)
                q = cp.asarray(case["q"].reshape(t, -1))
                if fp8:
                    K.attention_fp8(q, nq * hd, cp.asarray(case["kc"]), cp.asarray(case["vc"]), cp.asarray(case["kx"]),
                                    cp.asarray(case["vx"]), case["max_pos"], nq, nkv, hd, *args, a8=a8)
                else:
                    K.attention(q, nq * hd, cp.asarray(L.bf16_bits(case["kc"])), cp.asarray(L.bf16_bits(case["vc"])),
                                True, case["max_pos"], nq, nkv, hd, *args, a8=a8)
                outs.append(out.get().reshape(t, nq, hd))
            want, got = outs
        np.testing.assert_array_equal(got, want)
        x = cp.asarray(want.reshape(t, -1))
        pa.run(x, nq * hd, t)  # quant_act8 from the rows, then the GEMV
        pb.run(x, nq * hd, t, prequantized=True)
        k = nq * hd
        np.testing.assert_array_equal(pb.xq.get()[:t, :k], pa.xq.get()[:t, :k], err_msg=f"codes t={t}")
        sa, sb = (p.xs.get().reshape(-1, k // 64, 16)[0, :, :t] for p in (pa, pb))  # lanes 0-15's half
        np.testing.assert_array_equal(sb, sa, err_msg=f"scales t={t}")
        np.testing.assert_array_equal(yb.get(), ya.get())


@pytest.mark.gpu
@pytest.mark.parametrize("hd", [32, 256])
def test_staged_combine_keeps_the_sequential_bits(cp, hd):
    """attn_mma_combine merges the splits from shared memory with its acc loads 8 ahead (combine_body); the bits are
    those of the one-split-at-a-time loop it replaced (attn_combine_seq_ref): random partials, 1 .. 128 splits a row
    (ATTD_NSPLIT_MAX, past the 32-thread block at hd 32, and partial groups of 8), the gate at 0 (sigmoid 0.5)."""
    from q27py.gpu import constants as C
    from q27py.gpu.runtime import Runtime, i32

    rt = Runtime.get()
    nq, stride, ssz = 3, C.ATTD_NSPLIT_MAX, 64
    rng = np.random.default_rng(hd)
    for pos0 in (0, 63, 64, 8 * 64 + 5, 17 * 64, stride * ssz - 40):
        nlanes = 16
        n = min(pos0 + nlanes, stride * ssz) - pos0
        part = rng.standard_normal((n, nq, stride, hd + 2)).astype(np.float32)
        part[..., 0] *= 8.0  # m: spread maxima
        part[..., 1] = np.abs(part[..., 1]) + 0.5  # l > 0
        dpart = cp.asarray(part)
        ref = cp.full((n, nq * hd), np.nan, cp.float32)
        rt.launch("attention", "attn_combine_seq_ref", (n, nq), hd,
                  (dpart, i32(nq), i32(hd), i32(pos0), i32(ssz), i32(stride), ref))
        qg = cp.zeros((n, 2 * nq * hd), cp.float32)
        out = cp.full((n, nq * hd), np.nan, cp.float32)
        span = stride * ssz - pos0  # attention_mma_split_size(pos0, span, stride) == ssz: 64-position splits
        assert K.attention_mma_split_size(pos0, span, stride) == ssz
        rt.launch("attention", "attn_mma_combine", (n, nq), hd,
                  (dpart, i32(nq), i32(hd), cp.asarray(np.array([pos0], np.int32)), i32(span), i32(stride), qg,
                   i32(2 * nq * hd), out, i32(nq * hd), None, i32(0), None))
        np.testing.assert_array_equal(out.get(), ref.get() * np.float32(0.5), err_msg=f"pos0 {pos0}")


def boundary_pos0(nkv):
    """pos0 values just below / at / past a split boundary of this card (and the first positions)."""
    from q27py.gpu.runtime import Runtime

    ns = K.attention_mma_splits(nkv, Runtime.get().sm_count)
    ssz = K.attention_mma_split_size(4096, SPAN, ns)
    return [0, 5, ssz - 1, ssz, 4096 - 3]


HEADS = [(32, 4, 1), (64, 4, 2), (128, 8, 2), (256, 24, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("hd,nq,nkv", HEADS)
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("nlanes", [1, 3, 16])
def test_mma_matches_float64_attention(cp, hd, nq, nkv, fp8, nlanes):
    for pos0 in boundary_pos0(nkv):
        case = make_case(pos0 * 7 + hd + nlanes, nlanes, nq, nkv, hd, pos0, fp8)
        got, _ = run_mma(cp, case, pos0)
        tol = TOL if K.attention_mma_qsplit(hd, _cc()) else TOL_BQ
        assert rel(got, reference(case, pos0)) < tol, (pos0, rel(got, reference(case, pos0)))


def _cc():
    from q27py.gpu.runtime import Runtime

    return Runtime.get().cc


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_bf16_q_variant_matches_float64_attention(cp, fp8):
    """The _bq kernels (what sm_80-89 run at head dim 256), run here on purpose."""
    pos0 = 700
    case = make_case(11, 16, 24, 4, 256, pos0, fp8)
    got, _ = run_mma(cp, case, pos0, qsplit=False)
    assert rel(got, reference(case, pos0)) < TOL_BQ


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_mma_matches_split_kernel(cp, fp8):
    hd, nq, nkv, pos0, t = 256, 24, 4, 3000, 9
    case = make_case(5, t, nq, nkv, hd, pos0, fp8)
    got, _ = run_mma(cp, case, pos0)
    qg = np.zeros((t, nq, 2 * hd), np.float32)
    qg[..., hd:] = case["gate"]
    out = cp.full((t, nq * hd), np.nan, cp.float32)
    part = cp.zeros(K.attention_partials_floats(t, nq, hd), dtype=cp.float32)
    args = (cp.asarray(np.array([pos0], np.int32)), SPAN, part, cp.asarray(qg.reshape(t, -1)), 2 * nq * hd, out,
            nq * hd, t)
    q = cp.asarray(case["q"].reshape(t, -1))
    if fp8:
        K.attention_fp8(q, nq * hd, cp.asarray(case["kc"]), cp.asarray(case["vc"]), cp.asarray(case["kx"]),
                        cp.asarray(case["vx"]), case["max_pos"], nq, nkv, hd, *args)
    else:
        K.attention(q, nq * hd, cp.asarray(L.bf16_bits(case["kc"])), cp.asarray(L.bf16_bits(case["vc"])), True,
                    case["max_pos"], nq, nkv, hd, *args)
    old = out.get().reshape(t, nq, hd)
    tol = TOL if K.attention_mma_qsplit(hd, _cc()) else TOL_BQ
    assert rel(got, old) < 2 * tol


@pytest.mark.gpu
@pytest.mark.parametrize("hd,nq,nkv", [(64, 4, 2), (256, 24, 4)])
@pytest.mark.parametrize("fp8", [False, True])
def test_mma_lanes_are_width_invariant_bitwise(cp, hd, nq, nkv, fp8):
    """Lane t's output is the same bits at every width W > t (1..16), pos0 at split boundaries."""
    for pos0 in boundary_pos0(nkv)[1:4]:
        case = make_case(pos0 + 1, SPAN, nq, nkv, hd, pos0, fp8)
        full, _ = run_mma(cp, case, pos0)
        for w in range(1, SPAN):
            got, _ = run_mma(cp, case, pos0, nlanes=w)
            np.testing.assert_array_equal(got, full[:w], err_msg=f"W={w} pos0={pos0}")


@pytest.mark.gpu
def test_partials_follow_the_python_split_size(cp):
    """The kernel writes exactly the splits attention_mma_split_size says each lane needs (NaN-poisoned
    buffer): the device formula (attd_split_size) and the Python one agree."""
    from q27py.gpu.runtime import Runtime

    hd, nq, nkv = 64, 4, 2
    ns = K.attention_mma_splits(nkv, Runtime.get().sm_count)
    for pos0 in boundary_pos0(nkv):
        case = make_case(2, SPAN, nq, nkv, hd, pos0, False)
        _, part = run_mma(cp, case, pos0, poison=True)
        ssz = K.attention_mma_split_size(pos0, SPAN, ns)
        need_last = -(-(pos0 + SPAN) // ssz)
        assert np.isfinite(part[:, :, :need_last - 1]).all()
        if need_last < ns:
            assert np.isnan(part[:, :, need_last:]).all()
        for t in range(SPAN):  # the split holding lane t's last position is written for lane t
            assert np.isfinite(part[t, :, (pos0 + t) // ssz]).all()


LONG_POS0, LONG_MAX_POS = 40960 - SPAN, 131072 + 64  # 40K positions in a 128K+ cache (the 27B's long rows)


@pytest.fixture(scope="module")
def long_fp8_case():
    """27B heads (24 q / 4 kv, head dim 256), fp8 KV of LONG_POS0 + 16 positions in a LONG_MAX_POS cache,
    and the numpy spec's output for the 16 lanes (lane t at LONG_POS0 + t; a narrower launch's lanes
    are its first rows). Per kv head: ops.attention's GQA grouping, a quarter of the memory."""
    nq, nkv, hd, n = 24, 4, 256, LONG_POS0 + SPAN
    rng = np.random.default_rng(17)
    kc = np.zeros((nkv, LONG_MAX_POS, hd), np.uint8)
    vc = np.zeros_like(kc)
    kx = np.zeros((nkv, LONG_MAX_POS), np.int8)
    vx = np.zeros_like(kx)
    kc[:, :n], kx[:, :n] = F.fp8_quantize(rng.standard_normal((nkv, n, hd), np.float32) * 1.5)
    vc[:, :n], vx[:, :n] = F.fp8_quantize(rng.standard_normal((nkv, n, hd), np.float32))
    q = rng.standard_normal((SPAN, nq, hd)).astype(np.float32)
    gate = rng.standard_normal((SPAN, nq, hd)).astype(np.float32)
    rep = nq // nkv
    want = np.zeros((SPAN, nq, hd))
    for g in range(nkv):
        keys = F.fp8_dequantize(kc[g, :n], kx[g, :n])[:, None].astype(np.float64)
        vals = F.fp8_dequantize(vc[g, :n], vx[g, :n])[:, None].astype(np.float64)
        hs = slice(g * rep, (g + 1) * rep)
        want[:, hs] = ops.attention(q[:, hs].astype(np.float64), keys, vals, np.arange(LONG_POS0, n), hd ** -0.5)
    want *= ops.sigmoid(gate.astype(np.float64))
    return dict(q=q, gate=gate, kc=kc, vc=vc, kx=kx, vx=vx, max_pos=LONG_MAX_POS, want=want)


@pytest.mark.gpu
@pytest.mark.parametrize("nlanes", [1, 8, 16])
def test_mma_fp8_long_context_27b_shapes(cp, long_fp8_case, nlanes):
    """fp8 KV at the 27B attention shapes, 40K positions in a 128K+ cache, W = 1 / 8 / 16: the tensor-core
    kernel against the numpy spec and the split fp8 kernel (issue 17: the 27B probe's fp8 mma rows
    died with an illegal address). The rows past the launch's last lane hold NaN codes and an
    exponent of 120 (2^128 = inf): any load past the valid rows, any exponent read past them, poisons
    the output."""
    case = dict(long_fp8_case)
    hd, nq, nkv = 256, 24, 4
    end = LONG_POS0 + nlanes
    for name, code, e in (("kc", 0x7F, None), ("vc", 0xFF, None), ("kx", None, 120), ("vx", None, 120)):
        a = case[name].copy()
        a[:, end:] = code if e is None else e
        case[name] = a
    sub = dict(case, q=case["q"][:nlanes], gate=case["gate"][:nlanes])
    got, part = run_mma(cp, sub, LONG_POS0, poison=True)
    assert np.isfinite(got).all()
    tol = TOL if K.attention_mma_qsplit(hd, _cc()) else TOL_BQ
    assert rel(got, case["want"][:nlanes]) < tol
    # the split fp8 kernel over the same (poisoned) cache
    qg = np.zeros((nlanes, nq, 2 * hd), np.float32)
    qg[..., hd:] = sub["gate"]
    out = cp.full((nlanes, nq * hd), np.nan, cp.float32)
    spart = cp.zeros(K.attention_partials_floats(nlanes, nq, hd), dtype=cp.float32)
    K.attention_fp8(cp.asarray(sub["q"].reshape(nlanes, -1)), nq * hd, cp.asarray(case["kc"]), cp.asarray(case["vc"]),
                    cp.asarray(case["kx"]), cp.asarray(case["vx"]), LONG_MAX_POS, nq, nkv, hd,
                    cp.asarray(np.array([LONG_POS0], np.int32)), SPAN, spart, cp.asarray(qg.reshape(nlanes, -1)),
                    2 * nq * hd, out, nq * hd, nlanes)
    split = out.get().reshape(nlanes, nq, hd)
    assert rel(split, case["want"][:nlanes]) < TOL
    assert rel(got, split) < 2 * tol


@pytest.mark.gpu
def test_mma_fp8_long_context_lanes_are_width_invariant_bitwise(cp, long_fp8_case):
    """At 40K positions in a 128K+ cache, lane t's fp8 output is the same bits at W = 1, 8, 16."""
    full, _ = run_mma(cp, long_fp8_case, LONG_POS0)
    for w in (1, 8):
        sub = dict(long_fp8_case, q=long_fp8_case["q"][:w], gate=long_fp8_case["gate"][:w])
        got, _ = run_mma(cp, sub, LONG_POS0)
        np.testing.assert_array_equal(got, full[:w], err_msg=f"W={w}")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["split", "mma"])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_attn_probe_rows_match_the_spec(cp, impl, kv):
    """q27py.bench.attn_probe's own inputs (made on the round's stream, issue 17) give the numpy spec's
    attention at 2K, W = 1 and 16, two layers: its rows time a correct computation."""
    from q27py.bench import attn_probe as P
    from q27py.gpu.runtime import Runtime

    sh = dict(P.SHAPE_27B, layers=2)
    bq = impl == "mma" and not K.attention_mma_qsplit(sh["hd"], Runtime.get().cc)
    for w in (1, 16):
        ms, err = P.measure(2048, w, kv, impl, **sh, reps=3, check=True)
        assert ms > 0 and err < (P.CHECK_TOL_BQ if bq else P.CHECK_TOL), (w, err)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_fast_model_mma_tracks_split(kv, monkeypatch):
    """FastModel decode + verify with attn_decode="mma" against "split" (tolerance), and its verify
    lanes width-invariant bitwise. The MTP layer's attention goes through the same path. (fp8 KV
    keeps split in the engine -- forward.FP8_ATTN_MMA -- and is exercised here with the switch on.)"""
    from q27py.gpu import forward
    from q27py.gpu.forward import FastModel

    monkeypatch.setattr(forward, "FP8_ATTN_MMA", True)
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint

    w = from_checkpoint(Checkpoint.open(DEFAULT_MODEL_DIR), "bf16", progress=False)
    models = {m: FastModel(w, max_context=512, kv_dtype=kv, chunk=64, attn_decode=m) for m in ("split", "mma")}
    assert models["mma"].attn_mma and not models["split"].attn_mma
    ids = [int(x) for x in np.random.default_rng(0).integers(0, 16000, 37)]
    lanes = [21, 22, 23, 24, 25, 26, 27, 28, 29]
    got = {}
    for name, m in models.items():
        st = m.new_state()
        out = m.forward(st, ids, logits_rows="last")
        res = []
        if m.has_mtp:  # the MTP layer's attention: one row per prompt position, then a 1-lane step
            nxt = np.concatenate([ids[1:], [int(out.greedy_ids()[0])]])
            lg, hm = m.mtp_forward(st.mtp_kv, out.hidden, nxt, 0)
            lg2, _ = m.mtp_forward(st.mtp_kv, hm[-1:], [int(np.argmax(lg[-1]))], len(ids))
            res += [lg[-1:], lg2]
        res.append(np.stack([m.forward(st, [t]).logits[0] for t in (40, 41, 42)]))
        res.append(m.forward(st, lanes, verify=True).logits)
        got[name] = res
    for a, b in zip(got["mma"], got["split"]):
        scale = float(np.abs(b).max())
        assert float(np.abs(a - b).max()) <= 2e-3 * scale
    m = models["mma"]
    res = {}
    for wdt in (1, 4, 9):
        st = m.new_state()
        m.forward(st, ids, logits_rows="last")
        res[wdt] = m.forward(st, lanes[:wdt], verify=True).logits
    for wdt, lg in res.items():
        np.testing.assert_array_equal(lg, res[9][:wdt])
