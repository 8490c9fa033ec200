"""CPU checks of verify_batch's group kernels (no GPU needed).

The GPU tests (test_verify_groups_gpu.py) hold verify_batch / commit_batch bitwise to solo verify
forwards and commits on the device. These hold, here, what that rests on: the group table's layout
as the kernels read it (common.cuh group_field), the argument checks, that each group wrapper passes
its kernel's parameters and launches it with the block and shared memory of the solo launch it stands
for, that a one-group verify_batch issues exactly a solo verify's launches (and a one-group
commit_batch a commit's), and (nvcc) that every *_groups entry builds for sm_80 and sm_90 and compiles
to the same floating-point instruction sequence as its one-sequence entry -- the same math in the same
order, so the same bits.
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from q27py.gpu import constants as C
from q27py.gpu import forward as F
from q27py.gpu.runtime import compile_options, source_text

sys.path.insert(0, str(Path(__file__).parent))
import nvcc_build  # noqa: E402
from nvcc_build import NVCC  # noqa: E402
from test_decode_batch_layout import _entries, _fake_model, _fp_ops, _params, _Recorder  # noqa: E402


# ---------------------------------------------------------------- the group table
def test_group_table_layout_matches_the_kernels_reading():
    widths = [3, 1, 5, 2]
    buf = F.pack_group_table(widths)
    assert buf.dtype == np.int32 and buf.size == 2 * F.group_table_words() == C.GT_NFIELDS * C.LANES_MAX
    field = lambda f, i: int(buf[f * C.LANES_MAX + i])  # noqa: E731  (common.cuh group_field)
    first = [0, 3, 4, 9]
    for g, w in enumerate(widths):
        assert field(C.GT_FIRST, g) == first[g] and field(C.GT_COUNT, g) == w and field(C.GT_KEEP, g) == 0
        for j in range(w):  # group_first_of_lane: lane b's group's first row, b - that = its lane in the group
            b = first[g] + j
            assert field(C.GT_GROUP, b) == g and b - field(C.GT_FIRST, field(C.GT_GROUP, b)) == j
    assert all(field(f, i) == 0 for f in range(C.GT_NFIELDS) for i in range(len(widths) if f != C.GT_GROUP else 11,
                                                                            C.LANES_MAX))
    kept = F.pack_group_table(widths, keep=[2, 1, 5, 1])
    assert [int(kept[C.GT_KEEP * C.LANES_MAX + g]) for g in range(4)] == [2, 1, 5, 1]
    # one buffer with the lane table: the group table starts right after it, int64-aligned
    image = np.concatenate([F.pack_lane_table([[0] * C.LT_NFIELDS], [7], [1]), buf.view(np.int64)])
    assert image.size == F.lane_table_words() + F.group_table_words()
    np.testing.assert_array_equal(image[F.lane_table_words():].view(np.int32), buf)


def test_group_table_refuses_bad_widths():
    for widths in ([], [0, 2], [C.LANES_MAX, 1], [-1]):
        with pytest.raises(ValueError):
            F.pack_group_table(widths)
    F.pack_group_table([1] * C.LANES_MAX)
    F.pack_group_table([C.LANES_MAX])


class _FakeState:
    def __init__(self, position):
        self.position = position


def test_check_groups():
    mk = lambda *p: [_FakeState(x) for x in p]  # noqa: E731
    out = F.check_groups(mk(0, 5), [[1, 2, 3], [4]], 16, 16, 10, 100)
    assert [g.tolist() for g in out] == [[1, 2, 3], [4]] and out[0].dtype == np.int64
    s = _FakeState(1)
    for states, groups, why in [
        ([], [], "empty"),
        (mk(1, 2), [[1]], "a group short"),
        (mk(*range(17)), [[1]] * 17, "over max_batch"),
        ([s, s], [[1], [2]], "a state twice"),
        (mk(1, 2), [[1], []], "an empty group"),
        (mk(1), [list(range(17))], "a group over VERIFY_SPAN"),
        (mk(1, 2), [[1] * 9, [2] * 8], "over the lanes"),
        (mk(1, 2), [[1], [100]], "id out of range"),
        (mk(1, 2), [[-1], [3]], "negative id"),
        (mk(1, 8), [[1], [2, 3, 4]], "context overflow"),
    ]:
        with pytest.raises(ValueError):
            F.check_groups(states, groups, 16, 16, 10, 100)
            pytest.fail(why)


def test_verify_groups_follows_the_environment(monkeypatch):
    monkeypatch.setenv("Q27_VERIFY_GROUPS", "1")
    assert F.verify_groups_default() is True
    monkeypatch.setenv("Q27_VERIFY_GROUPS", "0")
    assert F.verify_groups_default() is False


# ---------------------------------------------------------------- wrappers vs kernels
@pytest.fixture
def rec(monkeypatch):
    from q27py.gpu import kernels as K

    r = _Recorder()
    monkeypatch.setattr(K.Runtime, "get", staticmethod(lambda: r))
    return r


def _cases(w: int):
    """(group wrapper call, solo wrapper call) pairs at the 27B shapes: one group of w lanes."""
    from q27py.gpu import kernels as K

    nq, nkv, hd, hk, hv, dk, dv, kw = 24, 4, 256, 16, 48, 128, 128, 4
    c = 2 * hk * dk + hv * dv
    x = object()
    span, max_pos = 16, 4096
    return [
        (lambda: K.gdn_conv_groups(x, 1, x, x, 8, x, x, 1, x, x, hk, hv, dk, dv, kw, x, x, w),
         lambda: K.gdn_conv(x, 1, x, x, x, 1, x, x, hk, hv, dk, dv, kw, x, x, w)),
        (lambda: K.gdn_step_groups(x, x, C.GT_COUNT, 8, 0, x, 0, x, 0, x, 1, hk, hv, dk, dv, 1),
         lambda: K.gdn_step(x, 0, x, 0, x, 0, x, 1, hk, hv, dk, dv, w, emit=True, write_state=False)),
        (lambda: K.gdn_step_groups(x, x, C.GT_KEEP, 0, 8, x, 4, x, 4, None, 0, hk, hv, dk, dv, 1, layers=3, emit=False,
                                   write_state=True),
         lambda: K.gdn_step(x, 4, x, 4, x, 4, None, 0, hk, hv, dk, dv, 16, layers=3, n_dev=x, emit=False,
                            write_state=True)),
        (lambda: K.gdn_conv_commit_groups(x, x, 8, x, 1, 4, c, kw, 3, 1),
         lambda: K.gdn_conv_commit(x, 2, x, 1, 4, c, kw, 3, n_dev=x)),
        (lambda: K.attention_groups(x, 2, x, x, 8, 4, "bf16", max_pos, nq, nkv, hd, span, x, x, 2, x, 2, w),
         lambda: K.attention(x, 2, x, x, True, max_pos, nq, nkv, hd, x, span, x, x, 2, x, 2, w)),
        (lambda: K.attention_groups(x, 2, x, x, 8, 4, "fp8", max_pos, nq, nkv, hd, span, x, x, 2, x, 2, w),
         lambda: K.attention_fp8(x, 2, x, x, x, x, max_pos, nq, nkv, hd, x, span, x, x, 2, x, 2, w)),
        (lambda: K.attention_mma_groups(x, 2, x, x, 8, 4, False, max_pos, nq, nkv, hd, span, x, x, 2, x, 2, w, 1, w),
         lambda: K.attention_mma(x, 2, x, x, None, None, False, max_pos, nq, nkv, hd, x, span, x, x, 2, x, 2, w)),
        (lambda: K.attention_mma_groups(x, 2, x, x, 8, 4, True, max_pos, nq, nkv, hd, span, x, x, 2, x, 2, w, 1, w),
         lambda: K.attention_mma(x, 2, x, x, x, x, True, max_pos, nq, nkv, hd, x, span, x, x, 2, x, 2, w)),
    ]


def _strip(grid):
    """A grid without its trailing 1s: (a, b, 1) launches what (a, b) does."""
    g = list(grid)
    while len(g) > 1 and g[-1] == 1:
        g.pop()
    return tuple(g)


@pytest.mark.parametrize("w", [1, 5, 16])
@pytest.mark.parametrize("i", range(8))
def test_group_wrappers_launch_as_the_solo_launch(rec, i, w):
    group_call, solo_call = _cases(w)[i]
    group_call()
    got = rec.calls[:]
    rec.calls.clear()
    solo_call()
    want = rec.calls[:]
    assert len(got) == len(want)
    for g, s in zip(got, want):
        assert g.module == s.module
        assert g.kernel.replace("_groups", "") == s.kernel, (g.kernel, s.kernel)
        assert len(g.args) == _params(g.module, g.kernel), g.kernel
        assert len(s.args) == _params(s.module, s.kernel), s.kernel
        assert g.block == s.block and g.smem == s.smem, g.kernel
        assert _strip(g.grid) == _strip(s.grid), (g.kernel, g.grid, s.grid)


def test_mma_groups_block_covers_the_widest_group(rec):
    """The block of a multi-group mma launch is the widest group's (what its solo round uses: the extra
    warps of narrower groups only stage tiles); too small a max_width is refused."""
    from q27py.gpu import kernels as K

    x = object()
    K.attention_mma_groups(x, 2, x, x, 0, 0, False, 4096, 24, 4, 256, 16, x, x, 2, x, 2, 11, 4, 8)
    mma, comb = rec.calls
    assert mma.grid == (4, mma.grid[1], 4) and mma.block == 32 * K.attention_mma_warps(8, 6)
    assert comb.grid == (11, 24)
    with pytest.raises(ValueError):
        K.attention_mma_groups(x, 2, x, x, 0, 0, False, 4096, 24, 4, 256, 16, x, x, 2, x, 2, 11, 4, 7)
    with pytest.raises(ValueError):
        K.attention_mma_groups(x, 2, x, x, 0, 0, False, 4096, 24, 4, 256, 16, x, x, 2, x, 2, 17, 1, 16)


# ---------------------------------------------------------------- the grouped forward's launches
def _group_model(rec, kv, mma):
    m, st = _fake_model(rec, kv, mma, fused=False)
    m.group_table = np.zeros(1, np.float32)
    return m, st


@pytest.mark.parametrize("kv,mma", [("bf16", True), ("bf16", False), ("f32", False), ("fp8", False), ("fp8", True)])
@pytest.mark.parametrize("w", [1, 3, 16])
def test_one_group_launches_the_solo_verify(rec, kv, mma, w):
    """enqueue_groups(w, 1) issues enqueue_main(t = w, verify)'s launches in order, each state kernel as its
    *_lanes (KV store) or *_groups twin with the same block and shared memory, every GEMV plan with the
    same lanes and prequantization; at 11 lanes in 4 groups the lane / group dimensions follow."""
    m, st = _group_model(rec, kv, mma)
    m.enqueue_main(st, w, True, np.arange(w))
    solo = rec.calls[:]
    rec.calls.clear()
    offs = (4096, 64, 512, 256)
    m.enqueue_groups(w, 1, offs)
    grp = rec.calls[:]
    assert len(grp) == len(solo) > 20
    for a, b in zip(grp, solo):
        assert a.kernel.replace("_groups", "").replace("_lanes", "") == b.kernel and a.module == b.module, \
            (a.kernel, b.kernel)
        assert a.block == b.block and a.smem == b.smem, a.kernel
        assert _strip(a.grid) == _strip(b.grid), (a.kernel, a.grid, b.grid)
        if a.module != "plan":
            assert len(a.args) == _params(a.module, a.kernel), a.kernel
    renamed = {a.kernel for a in grp if "_groups" in a.kernel or "_lanes" in a.kernel}
    want = {"gdn_conv_groups", "gdn_step_groups_k4"}
    want |= {"qk_norm_rope_store_fp8_lanes" if kv == "fp8" else "qk_norm_rope_store_lanes"}
    want |= ({f"attn_mma_groups_{'fp8' if kv == 'fp8' else 'bf16'}_d256", "attn_mma_combine_groups"} if mma
             else {f"attn_split_groups_{kv}_d8", "attn_combine_groups"})
    assert renamed == want
    assert "gdn_conv_commit" not in {a.kernel for a in grp}  # a verify never slides the window
    rec.calls.clear()
    m.enqueue_groups(11, 4, offs)
    from q27py.gpu import kernels as K

    for a in rec.calls:
        if a.module == "plan":
            assert a.grid == (11, 0), (a.kernel, a.grid)  # every lane in one GEMV sweep
        elif a.kernel.startswith(("gdn_step_groups", "attn_mma_groups")):
            assert a.grid[2] == 4, (a.kernel, a.grid)  # one block column per group
        elif a.kernel.startswith("attn_split_groups"):
            assert a.grid[2] == 11, (a.kernel, a.grid)
        elif "_groups" in a.kernel or "_lanes" in a.kernel:
            assert a.grid[0] == 11, (a.kernel, a.grid)
        if a.kernel.startswith("attn_mma_groups"):  # the block of the widest possible group: 11 - 4 + 1 lanes
            assert a.block == 32 * K.attention_mma_warps(8, 6)


def test_one_group_commit_launches_the_solo_commit(rec, monkeypatch):
    """enqueue_commit_groups(1) issues enqueue_commit's two launches (window slide, replay over every GDN
    layer) as their *_groups twins; more groups widen the group dimension only."""
    m, st = _group_model(rec, "bf16", False)
    st.ctl = np.zeros(4, np.int32)
    monkeypatch.setattr(F, "ptr", lambda a, off=0: 4096 + off)
    m.enqueue_commit(st)
    solo = rec.calls[:]
    rec.calls.clear()
    m.enqueue_commit_groups(1, (4096, 64, 512, 256))
    grp = rec.calls[:]
    assert [a.kernel for a in grp] == ["gdn_conv_commit_groups", "gdn_step_groups_k4"]
    assert len(grp) == len(solo)
    for a, b in zip(grp, solo):
        assert a.kernel.replace("_groups", "") == b.kernel and a.block == b.block and a.smem == b.smem
        assert _strip(a.grid) == _strip(b.grid) and a.grid[1] == 2, (a.kernel, a.grid, b.grid)  # both GDN layers
        assert len(a.args) == _params(a.module, a.kernel), a.kernel
    rec.calls.clear()
    m.enqueue_commit_groups(5, (4096, 64, 512, 256))
    assert all(a.grid[2] == 5 for a in rec.calls)


# ---------------------------------------------------------------- the same math (nvcc)
@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("module", ["conv", "gdn", "attention"])
def test_group_entries_compute_what_their_one_sequence_entries_do(tmp_path, module):
    src = tmp_path / f"{module}.cu"
    src.write_text(source_text(module), encoding="utf-8")
    out = tmp_path / f"{module}.ptx"
    r = subprocess.run([NVCC, *compile_options(), "-arch=sm_90", "-ptx", "-o", str(out), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    ent = _entries(out.read_text())
    groups = [k for k in ent if "_groups" in k]
    want = {"conv": 2, "gdn": 3, "attention": 12 + 1 + 16 + 1}[module]
    assert len(groups) == want, sorted(groups)
    counted = 0
    for k in groups:
        solo = k.replace("_groups", "")
        assert solo in ent, k
        a, b = _fp_ops(ent[k]), _fp_ops(ent[solo])
        assert a == b, f"{k}: {len(a)} fp instructions vs {solo}'s {len(b)}"
        counted += len(a)
    assert counted, "no floating-point instruction found: the PTX filter is broken"


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("module", ["conv", "gdn"])
def test_group_entries_build_without_spills(tmp_path, module, arch):
    """The GDN group entries build for the oldest and the newest supported arch, in registers as their
    one-sequence twins (attention's are held by test_compile's mma spill check on every arch)."""
    rc, err = nvcc_build.build(tmp_path, module, arch)
    assert rc == 0, err[-2000:]
    rep = nvcc_build.ptxas_report(err)
    groups = {k: v for k, v in rep.items() if "_groups" in k}
    assert len(groups) == {"conv": 2, "gdn": 3}[module], sorted(rep)
    assert all(spill == 0 for _, spill in groups.values()), groups


def test_groups_entries_live_in_pdl_modules():
    from q27py.gpu.runtime import CUDA_DIR, PDL_MODULES

    for p in sorted(CUDA_DIR.glob("*.cu")):
        if "_groups(" in p.read_text() or "GROUPS_KERNEL(" in p.read_text():
            assert p.stem in PDL_MODULES, p.stem


def test_fast_model_verify_surface_without_a_gpu():
    """verify_batch / commit_batch refuse a model without verify lanes (ValueError, before any device
    work), and commit() refuses a group trace (its rows are not a solo verify's)."""
    m = F.FastModel.__new__(F.FastModel)
    m.verify_lanes = 0
    with pytest.raises(ValueError):
        m.verify_batch([object()], [[1]])
    with pytest.raises(ValueError):
        m.commit_batch([object()], [None], [1])
    m._pending = None
    st = types.SimpleNamespace(id=3)
    with pytest.raises(RuntimeError):
        m.commit(st, F.FastGroupTrace(2, 1, 3, 0, 0), 1)


# ---------------------------------------------------------------- the same buffers and offsets
def _addr(a) -> int:
    return int(a.__array_interface__["data"][0])


def _canon(a):
    """A launch argument as comparable data: an array by its address, a scalar by its type and value."""
    if a is None:
        return None
    if isinstance(a, np.ndarray):
        return ("at", _addr(a))
    if isinstance(a, np.generic):
        return (type(a).__name__, a.item())
    return ("obj", id(a))


def _two_attention_layers(rec, kv, mma):
    """_group_model with a second attention layer (so a layer's KV offset is not 0) and a state whose arrays
    have the real layouts: K / V [layers][nkv][max_pos][hd], fp8 exponents [layers][nkv][max_pos], GDN S
    [layers][hv][dv][dk], windows [layers][kw - 1][C]."""
    import dataclasses

    from q27py.model.config import FULL

    m, _ = _group_model(rec, kv, mma)
    m.cfg = dataclasses.replace(m.cfg, num_hidden_layers=4, layer_types=m.cfg.layer_types + (FULL,))
    x = np.zeros(1, np.float32)
    m.w.layers.append(types.SimpleNamespace(kind=FULL, input_ln=x, post_ln=x,
                                            attn=types.SimpleNamespace(q_norm=x, k_norm=x)))
    from test_decode_batch_layout import _Plan

    m.layer_plans.append({k: _Plan(rec, f"{k}3") for k in ("in", "out", "up", "down")})
    m.max_pos = 64
    m.ld_qg, m.ld_xa, m.ld_xo, m.ld_act = 130, 132, 134, 136  # apart: a leading dimension passed for another is seen
    m.lane_table, m.group_table = np.zeros(8, np.int64), np.zeros(8, np.int32)
    cfg, z = m.cfg, (lambda dt, *s: np.zeros(s, dt))  # noqa: E731
    kvt = {"bf16": np.uint16, "fp8": np.uint8}.get(kv, np.float32)
    nkv, hd, hv = cfg.num_key_value_heads, cfg.head_dim, cfg.linear_num_value_heads
    side = (z(np.int8, 2, nkv, m.max_pos), z(np.int8, 2, nkv, m.max_pos)) if kv == "fp8" else ()
    st = types.SimpleNamespace(
        k=z(kvt, 2, nkv, m.max_pos, hd), v=z(kvt, 2, nkv, m.max_pos, hd),
        gdn=z(np.float32, 2, hv, cfg.linear_value_head_dim, cfg.linear_key_head_dim),
        window=z(np.float32, 2, cfg.linear_conv_kernel_dim - 1, cfg.gdn_conv_dim), position=7,
        ctl=types.SimpleNamespace(data=types.SimpleNamespace(ptr=4096)),
        side_rows=lambda ai: tuple(a[ai] for a in side) if ai is not None else ())
    st.k_exp, st.v_exp = side if side else (None, None)
    offs = (st.k.strides[0], side[0].strides[0] if side else 0, st.gdn.strides[0], st.window.strides[0])
    return m, st, offs


def _resolve(call, st, m, w: int, commit: bool):
    """The arguments of a *_groups / *_lanes launch of a one-group round (w lanes of state st, row 0) with
    every lane-table address + offset resolved to the address it names and the pos0 pointer as "pos0":
    the argument list of the solo launch it stands for (None: not a state kernel)."""
    base = {C.LT_K: st.k, C.LT_V: st.v, C.LT_KX: st.k_exp, C.LT_VX: st.v_exp, C.LT_GDN: st.gdn,
            C.LT_WIN: st.window}

    def at(field, off):
        return ("at", _addr(base[field]) + int(off))

    a = [_canon(x) for x in call.args]
    k = call.kernel
    if "_lanes" in k or "_groups" in k:
        assert call.args[a.index(("at", _addr(m.lane_table)))] is m.lane_table, k
    if "_groups" in k:
        assert ("at", _addr(m.group_table)) in a, k
    if k in ("qk_norm_rope_store_lanes", "qk_norm_rope_store_fp8_lanes"):
        fp8 = "fp8" in k
        kv_off = call.args[13].item()
        store = [at(C.LT_K, kv_off), at(C.LT_V, kv_off)]
        if fp8:
            x_off = call.args[14].item()
            return a[:12] + ["pos0"] + a[15:17] + store + [at(C.LT_KX, x_off), at(C.LT_VX, x_off)] + a[17:]
        return a[:12] + ["pos0"] + a[14:16] + store + a[16:]
    if k == "gdn_conv_groups":
        return a[:2] + [at(C.LT_WIN, call.args[4].item())] + a[5:]
    if k.startswith("gdn_step_groups"):
        assert call.args[2].item() == (C.GT_KEEP if commit else C.GT_COUNT)
        n = ("int32", F.VERIFY_SPAN if commit else w)
        return ([at(C.LT_GDN, call.args[3].item()), ("int64", call.args[4].item() // 4)] + a[5:15] + [n]
                + ["n_dev" if commit else None] + a[15:])
    if k == "gdn_conv_commit_groups":
        return [at(C.LT_WIN, 0), ("int64", call.args[2].item() // 4)] + a[3:8] + ["n_dev", ("int32", 0)]
    if k.startswith("attn_split_groups"):
        kv_off, x_off = call.args[4].item(), call.args[5].item()
        out = a[:2] + [at(C.LT_K, kv_off), at(C.LT_V, kv_off)] + a[6:10] + ["pos0"] + a[10:]
        return out + ([at(C.LT_KX, x_off), at(C.LT_VX, x_off)] if "fp8" in k else [])
    if k.startswith("attn_mma_groups"):
        kv_off, x_off = call.args[4].item(), call.args[5].item()
        fp8 = "fp8" in k
        return (a[:2] + [at(C.LT_K, kv_off), at(C.LT_V, kv_off)] + a[6:10] + ["pos0"] + a[10:12] + [("int32", w)]
                + a[12:] + ([at(C.LT_KX, x_off), at(C.LT_VX, x_off)] if fp8 else [None, None]))
    if k in ("attn_combine_groups", "attn_mma_combine_groups"):
        return a[:3] + ["pos0"] + a[5:]
    return None


def _solo_args(call, commit: bool):
    a = [_canon(x) for x in call.args]
    k = call.kernel
    pos0 = ("uint64", 4096)  # ptr(state.ctl): the round's pos0
    if k.startswith(("qk_norm_rope_store", "attn_split_", "attn_mma_", "attn_combine")):
        a = ["pos0" if x == pos0 else x for x in a]
    if commit and k.startswith(("gdn_step_k", "gdn_conv_commit")):
        a = ["n_dev" if x == ("uint64", 4096 + 8) else x for x in a]
    return a


@pytest.mark.parametrize("kv,mma", [("bf16", True), ("bf16", False), ("f32", False), ("fp8", False), ("fp8", True)])
@pytest.mark.parametrize("w", [1, 4, 16])
def test_one_group_passes_the_solo_verify_arguments(rec, monkeypatch, kv, mma, w):
    """A one-group verify_batch / commit_batch hands every launch the buffers, leading dimensions, strides
    and scalars its solo verify / commit gives it, and each lane-table address + layer offset names the
    array (layer) the solo launch passes: K / V and fp8 exponents of each attention layer, S and the
    window of each GDN layer, all layers' records for the commit."""
    m, st, offs = _two_attention_layers(rec, kv, mma)
    monkeypatch.setattr(F, "ptr", lambda a, off=0: np.uint64(4096 + off))
    for commit in (False, True):
        rec.calls.clear()
        if commit:
            m.enqueue_commit(st)
        else:
            m.enqueue_main(st, w, True, np.arange(w))
        solo = rec.calls[:]
        rec.calls.clear()
        if commit:
            m.enqueue_commit_groups(1, offs)
        else:
            m.enqueue_groups(w, 1, offs)
        grp = rec.calls[:]
        assert len(grp) == len(solo)
        resolved = 0
        for g, s in zip(grp, solo):
            if g.module == "plan":
                continue
            want = _solo_args(s, commit)
            got = _resolve(g, st, m, w, commit)
            if got is None:  # a launch the group path makes as the solo one does
                if g.kernel == "embed_rows":  # the ids: the lane table's instead of the model's
                    got, want = [_canon(x) for x in g.args[1:]], want[1:]
                else:
                    got = [_canon(x) for x in g.args]
            else:
                resolved += 1
            assert got == want, (g.kernel, s.kernel)
        assert resolved == (2 if commit else 2 * 2 + 2 * 3), resolved
