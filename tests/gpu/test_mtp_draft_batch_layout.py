"""CPU checks of FastModel.mtp_draft_batch's batched MTP chain (no GPU needed).

The GPU tests (test_mtp_draft_batch_gpu.py) hold mtp_draft_batch bitwise to solo mtp_draft_chain calls on the
device. These hold, here, what that rests on: the layout of its tables as the kernels read them (step 0's lane +
group table, the chain steps' lane + group table: pack_mtp_tables / mtp_table_views), how chains are cut into
parts and the argument checks (before any device work), and that a one-chain batch issues exactly the solo
chain's launches -- every kernel with the block, grid, shared memory and arguments of its solo twin, each lane-
table address naming the state's MTP K / V (fp8 exponents), step k of the chain at the solo step's position
with its ids -- the glue kernels (mtp_gather_last, mtp_chain_step_lanes) moving the same rows and ids as the solo
chain's mtp_chain_step does.
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
from nvcc_build import NVCC  # noqa: E402
from test_decode_batch_layout import _entries, _fake_model, _params, _Plan, _Recorder  # noqa: E402
from test_verify_groups_layout import _addr, _canon, _resolve, _strip  # noqa: E402


# ---------------------------------------------------------------- the tables
def test_mtp_tables_layout_matches_the_kernels_reading():
    rng = np.random.default_rng(0)
    widths, starts = [3, 1, 5, 2], [40, 0, 17, 300]
    addrs = rng.integers(1 << 40, 1 << 47, (4, C.LT_NFIELDS)).tolist()
    ids = [rng.integers(0, 1000, w).tolist() for w in widths]
    image = F.pack_mtp_tables(addrs, starts, widths, ids)
    assert image.dtype == np.int64 and image.size == F.mtp_tables_words()
    lanes0, groups0, ids0, lanes1, groups1, ids1 = F.mtp_table_views(image)
    lw, gw = F.lane_table_words(), F.group_table_words()
    # the chain steps' tables start int64-aligned after step 0's, each a lane table then its group table
    assert lanes0.size == lanes1.size == lw and groups0.size == groups1.size == 2 * gw
    assert _addr(lanes1) - _addr(lanes0) == 8 * (lw + gw) and _addr(groups0) - _addr(lanes0) == 8 * lw
    assert _addr(groups1) - _addr(lanes1) == 8 * lw
    # step 0: group g = chain g's rows, every row its addresses, positions start .., its next ids
    np.testing.assert_array_equal(groups0, F.pack_group_table(widths))
    pos0 = lanes0.view(np.int32)[2 * C.LANES_MAX * C.LT_NFIELDS :][: C.LANES_MAX]
    r = 0
    for g, (w, s) in enumerate(zip(widths, starts)):
        for j in range(w):
            assert lanes0[(r + j) * C.LT_NFIELDS : (r + j + 1) * C.LT_NFIELDS].tolist() == addrs[g]
            assert pos0[r + j] == s + j and ids0[r + j] == ids[g][j]
        r += w
    assert (pos0[r:] == 0).all() and (ids0[r:] == 0).all()
    # the chain steps: lane g = chain g at step 1's position start + t, ids left for the device, groups of one
    np.testing.assert_array_equal(groups1, F.pack_group_table([1] * 4))
    pos1 = lanes1.view(np.int32)[2 * C.LANES_MAX * C.LT_NFIELDS :][: C.LANES_MAX]
    for g, (w, s) in enumerate(zip(widths, starts)):
        assert lanes1[g * C.LT_NFIELDS : (g + 1) * C.LT_NFIELDS].tolist() == addrs[g]
        assert pos1[g] == s + w
    assert (ids1 == 0).all()


def test_mtp_tables_refuse_bad_shapes():
    a = [[0] * C.LT_NFIELDS]
    for args in ((a, [0], [2], [[1]]), (a * 2, [0], [1], [[1]]), (a, [0], [0], [[]]), (a * 2, [0, 0], [9, 8],
                                                                                      [[1] * 9, [1] * 8])):
        with pytest.raises(ValueError):
            F.pack_mtp_tables(*args)
    F.pack_mtp_tables(a * 16, [0] * 16, [1] * 16, [[1]] * 16)
    F.pack_mtp_tables(a, [5], [16], [list(range(16))])


def test_mtp_lane_addresses_name_the_mtp_kv():
    fake = lambda p: types.SimpleNamespace(data=types.SimpleNamespace(ptr=p))  # noqa: E731
    st = types.SimpleNamespace(mtp_k=fake(100), mtp_v=fake(200), mtp_k_exp=fake(300), mtp_v_exp=fake(400))
    row = F.FastModel._mtp_lane_addresses(st)
    assert row[C.LT_K] == 100 and row[C.LT_V] == 200 and row[C.LT_KX] == 300 and row[C.LT_VX] == 400
    assert row[C.LT_GDN] == row[C.LT_WIN] == 0 and len(row) == C.LT_NFIELDS
    st.mtp_k_exp = st.mtp_v_exp = None
    assert F.FastModel._mtp_lane_addresses(st)[C.LT_KX] == 0


def test_mtp_batch_parts():
    assert F.mtp_batch_parts([3, 1, 16, 2], 16) == [[0, 1], [2], [3]]
    assert F.mtp_batch_parts([1] * 17, 16) == [list(range(16)), [16]]
    assert F.mtp_batch_parts([4, 4, 4, 4], 16) == [[0, 1, 2, 3]]
    assert F.mtp_batch_parts([8, 9, 7], 16) == [[0], [1, 2]]


# ---------------------------------------------------------------- the argument checks and the parts
def _shell(lanes=16):
    m = F.FastModel.__new__(F.FastModel)
    m.has_mtp, m.verify_lanes, m.max_pos = True, lanes, 100  # mtp_batch_lanes follows verify_lanes
    m.cfg = types.SimpleNamespace(vocab_size=50)
    return m


def _kv(m, length, max_pos=100):
    st = types.SimpleNamespace(model=m, mtp_k=np.zeros((2, max_pos, 4)))
    kv = types.SimpleNamespace(state=st, length=length)
    return kv


def test_mtp_draft_batch_checks_before_any_device_work():
    m = _shell()
    m._mtp_batch_part = lambda chains, depth: pytest.fail("device work before the checks")
    kv = lambda n=10: _kv(m, n)  # noqa: E731
    rows = np.zeros((3, 4), np.float32)
    for args, why in [
        (([kv()], [rows], [[1, 2]], [0, 1], 2), "lists of different lengths"),
        (([kv(), kv()], [rows, rows], [[1], [2]], [0, 0], F.MTP_CHAIN_DEPTH + 1), "too deep"),
        (([kv(), kv()], [rows, rows], [[1], []], [0, 0], 2), "an empty chain"),
        (([kv(), kv()], [rows, rows], [[1], [50]], [0, 0], 2), "id out of range"),
        (([kv(), kv()], [rows, rows], [[1], [-1]], [0, 0], 2), "negative id"),
        (([kv(), kv(3)], [rows, rows], [[1], [2]], [0, 4], 2), "rows not contiguous"),
        (([kv(), kv(99)], [rows, rows], [[1], [2, 3]], [0, 99], 2), "the backlog past the window"),
        (([kv(), _kv(m, 3, max_pos=64)], [rows, rows], [[1], [2]], [0, 0], 2), "another window"),
    ]:
        with pytest.raises(ValueError):
            m.mtp_draft_batch(*args)
            pytest.fail(why)
    other = _kv(F.FastModel.__new__(F.FastModel), 5)
    with pytest.raises(ValueError):
        m.mtp_draft_batch([kv(), other], [rows, rows], [[1], [2]], [0, 0], 2)
    m.has_mtp = False
    with pytest.raises(RuntimeError):
        m.mtp_draft_batch([kv()], [rows], [[1]], [0], 2)


def test_mtp_draft_batch_runs_parts_in_order_and_falls_back_to_chains():
    m = _shell()
    parts = []

    def part(chains, depth):
        parts.append([(c[3], len(c[2])) for c in chains])
        return [(np.full(depth, c[3]), np.zeros(depth, np.float32)) for c in chains]

    m._mtp_batch_part = part
    kvs = [_kv(m, 90) for _ in range(5)]
    widths, starts = [3, 20, 16, 2, 1], [10, 20, 30, 40, 50]
    rows = [np.zeros((w, 4), np.float32) for w in widths]
    ids = [np.ones(w, np.int64) for w in widths]
    out = m.mtp_draft_batch(kvs, rows, ids, starts, 3)
    # a backlog over VERIFY_SPAN rows counts its last row only (the rest are warmed first, as the solo chain)
    assert parts == [[(10, 3), (20, 20)], [(30, 16)], [(40, 2), (50, 1)]]
    assert [int(o[0][0]) for o in out] == starts and all(o[0].size == 3 for o in out)
    # no batch lanes, or a state twice: one solo chain per sequence, in order
    chains = []
    m.mtp_draft_chain = lambda kv, h, x, s, d: chains.append((id(kv), s, d)) or (np.zeros(d), np.zeros(d))
    m.verify_lanes = 0  # (mtp_batch_lanes follows it)
    m.mtp_draft_batch(kvs[:2], rows[:2], ids[:2], starts[:2], 4)
    assert chains == [(id(kvs[0]), 10, 4), (id(kvs[1]), 20, 4)]
    chains.clear()
    m.verify_lanes = 16
    m.mtp_draft_batch([kvs[0], kvs[0]], rows[:2], ids[:2], starts[:2], 2)
    assert chains == [(id(kvs[0]), 10, 2), (id(kvs[0]), 20, 2)]


def test_a_chain_near_the_window_end_runs_as_deep_as_its_rows_allow():
    """A chain whose step rows would pass max_pos (the batch's depth is the deepest chain's) runs alone: the solo
    chain of the steps its rows allow (its first steps' bits), the rest padded with id 0 and margin -inf; the
    chains with room go to the batch."""
    m = _shell()
    parts, chains = [], []

    def part(cs, depth):
        parts.append([c[3] for c in cs])
        return [(np.full(depth, 7), np.ones(depth, np.float32)) for _ in cs]

    def solo(kv, h, x, s, d):
        chains.append((s, len(x), d))
        return np.arange(1, d + 1, dtype=np.int64), np.full(d, 2.5, np.float32)

    m._mtp_batch_part, m.mtp_draft_chain = part, solo
    kvs = [_kv(m, 99) for _ in range(4)]
    starts, widths = [10, 97, 95, 96], [2, 2, 2, 4]  # rows end at 12, 99, 97 and 100 of a 100-row window
    rows = [np.zeros((w, 4), np.float32) for w in widths]
    out = m.mtp_draft_batch(kvs, rows, [np.ones(w, np.int64) for w in widths], starts, 4)
    # room = max_pos - (start + t) + 1 steps: 2 at 97 + 2 rows, 1 at 96 + 4; 95 + 2 leaves 4 (rows 97 .. 99)
    assert chains == [(97, 2, 2), (96, 4, 1)] and parts == [[10, 95]]
    assert out[1][0].tolist() == [1, 2, 0, 0] and out[1][1].tolist() == [2.5, 2.5, -np.inf, -np.inf]
    assert out[3][0].tolist() == [1, 0, 0, 0] and out[3][1][0] == 2.5 and np.isneginf(out[3][1][1:]).all()
    assert out[1][0].dtype == np.int64 and out[1][1].dtype == np.float32
    assert out[0][0].tolist() == [7] * 4 and out[2][0].tolist() == [7] * 4


# ---------------------------------------------------------------- the batched chain's launches
@pytest.fixture
def rec(monkeypatch):
    from q27py.gpu import kernels as K

    r = _Recorder()
    monkeypatch.setattr(K.Runtime, "get", staticmethod(lambda: r))
    monkeypatch.setattr(F, "ptr", lambda a, off=0: np.uint64(4096 + off))
    return r


class _XPlan(_Plan):
    """_Plan that also records what the GEMV reads: x's address and leading dimension."""

    def run(self, x, ldx, nlanes, lane0=0, allow_gemm=True, prequantized=False, x_bf16=None, y_bf16=None, norm=None):
        super().run(x, ldx, nlanes, lane0, allow_gemm, prequantized, x_bf16, y_bf16, norm=norm)
        self.rec.calls[-1].args = (("at", _addr(x)), ldx)


def _mtp_model(rec, kv, mma):
    """_fake_model with an MTP head (its own plans, an attention layer) and MTP buffers, a state whose MTP K / V
    (and fp8 exponents) have the real layout [nkv][max_pos][hd] ([nkv][max_pos])."""
    from q27py.model.config import FULL

    m, _ = _fake_model(rec, kv, mma, fused=False)
    x = np.zeros(1, np.float32)
    m.rt = rec
    m.max_pos = 64
    m.ld_qg, m.ld_xa, m.ld_xo, m.ld_act = 130, 132, 134, 136  # apart: a leading dimension passed for another is seen
    m.w.mtp = types.SimpleNamespace(pre_e=np.zeros(2, np.float32), pre_h=np.zeros(3, np.float32),
                                    norm=np.zeros(4, np.float32),
                                    layer=types.SimpleNamespace(kind=FULL, input_ln=x, post_ln=x,
                                                                attn=types.SimpleNamespace(q_norm=x, k_norm=x)))
    m.mtp_fc_plan, m.lm_plan = _XPlan(rec, "fc"), _XPlan(rec, "lm")
    m.mtp_layer_plan = {k: _XPlan(rec, f"mtp_{k}") for k in ("in", "out", "up", "down")}
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    m.ld_cat = 2 * m.cfg.hidden_size
    m.cat, m.mtp_hidden_in, m.mtp_out = z(16, m.ld_cat), z(16, 64), z(16, 64)
    m.tok, m.top1, m.margin = np.zeros(16, np.int32), z(16), z(16)
    m.mtp_ids = np.zeros(16, np.int32)
    m._chain_draft, m._chain_margin = np.zeros(8, np.int32), z(8)
    m.mtp_lane_buf = np.zeros(F.mtp_tables_words(), np.int64)
    (m.mtp_lanes0, m.mtp_groups0, m.mtp_ids0, m.mtp_lanes1, m.mtp_groups1, m.mtp_ids1) = F.mtp_table_views(m.mtp_lane_buf)
    m.mtp_batch_out = np.zeros(16 * 2 * 8, np.int32)
    cfg = m.cfg
    kvt = {"bf16": np.uint16, "fp8": np.uint8}.get(kv, np.float32)
    nkv, hd = cfg.num_key_value_heads, cfg.head_dim
    side = (np.zeros((nkv, m.max_pos), np.int8), np.zeros((nkv, m.max_pos), np.int8)) if kv == "fp8" else ()
    st = types.SimpleNamespace(mtp_k=np.zeros((nkv, m.max_pos, hd), kvt), mtp_v=np.zeros((nkv, m.max_pos, hd), kvt),
                               ctl=np.zeros(4, np.int32), side_rows=lambda ai: side if ai is None else ())
    st.mtp_k_exp, st.mtp_v_exp = side if side else (None, None)
    return m, st


def _steps(calls):
    """Launches cut into chain steps: each step starts at its embed."""
    out = []
    for c in calls:
        if c.kernel == "embed_rows":
            out.append([])
        out[-1].append(c)
    return out


def _solo_args(call):
    pos0 = ("uint64", 4096 + 4)  # ptr(state.ctl, 4): the MTP pos0
    return ["pos0" if x == pos0 else x for x in (_canon(a) for a in call.args)]


@pytest.mark.parametrize("kv,mma", [("bf16", True), ("bf16", False), ("f32", False), ("fp8", False), ("fp8", True)])
@pytest.mark.parametrize("t,depth", [(1, 1), (3, 4), (16, 2), (5, 8)])
def test_one_chain_batch_issues_the_solo_chains_launches(rec, kv, mma, t, depth):
    """enqueue_mtp_batch(t, 1, depth) issues enqueue_mtp_chain(t, depth)'s launches step by step, each state
    kernel as its *_lanes (KV store) / *_groups (attention) twin with the solo launch's block, grid, shared
    memory and arguments, every lane-table address naming the MTP K / V (exponents), and steps at the solo
    chain's positions with its ids; plus mtp_gather_last before the lm_head, and mtp_chain_step_lanes in place
    of mtp_chain_step (the same draft, margin and feed)."""
    m, st = _mtp_model(rec, kv, mma)
    start = 11
    m.enqueue_mtp_chain(st, t, depth)
    solo = _steps(rec.calls[:])
    rec.calls.clear()
    nxt = list(range(100, 100 + t))
    m.mtp_lane_buf[:] = F.pack_mtp_tables([F.FastModel._mtp_lane_addresses(types.SimpleNamespace(
        mtp_k=types.SimpleNamespace(data=types.SimpleNamespace(ptr=_addr(st.mtp_k))),
        mtp_v=types.SimpleNamespace(data=types.SimpleNamespace(ptr=_addr(st.mtp_v))),
        mtp_k_exp=None if st.mtp_k_exp is None else types.SimpleNamespace(data=types.SimpleNamespace(
            ptr=_addr(st.mtp_k_exp))),
        mtp_v_exp=None if st.mtp_v_exp is None else types.SimpleNamespace(data=types.SimpleNamespace(
            ptr=_addr(st.mtp_v_exp)))))], [start], [t], [nxt])
    m.enqueue_mtp_batch(t, 1, depth)
    batch = _steps(rec.calls[:])
    assert len(batch) == len(solo) == depth
    # the device-side values the steps read: solo ctl[1] / mtp_ids, batch lane tables (host images + the glue)
    lanes0 = m.mtp_lanes0.view(np.int32)
    lanes1 = m.mtp_lanes1.view(np.int32)
    at_pos = 2 * C.LANES_MAX * C.LT_NFIELDS
    solo_pos, solo_ids = start, nxt[:]
    toks = [7000 + k for k in range(depth)]  # the argmax of each step (what tok[0] would hold)
    mtp = types.SimpleNamespace(k=st.mtp_k, v=st.mtp_v, k_exp=st.mtp_k_exp, v_exp=st.mtp_v_exp, gdn=None, window=None)
    resolved = 0
    for k, (bs, ss) in enumerate(zip(batch, solo)):
        w = t if k == 0 else 1
        tables = types.SimpleNamespace(lane_table=m.mtp_lanes0 if k == 0 else m.mtp_lanes1,
                                       group_table=m.mtp_groups0 if k == 0 else m.mtp_groups1)
        words = lanes0 if k == 0 else lanes1
        # positions and ids of step k's lanes: the solo step's pos0 + j and its ids
        assert words[at_pos : at_pos + w].tolist() == list(range(solo_pos, solo_pos + w)), k
        ids_now = (m.mtp_ids0 if k == 0 else m.mtp_ids1)[:w].tolist()
        assert ids_now == solo_ids[:w], k
        glue = [c for c in bs if c.module == "chain"]
        assert [c.kernel for c in glue] == ["mtp_gather_last", "mtp_chain_step_lanes"]
        bs = [c for c in bs if c.module != "chain"]
        step = ss[-1] if ss[-1].kernel == "mtp_chain_step" else None
        ss = [c for c in ss if c.kernel != "mtp_chain_step"]
        assert step is not None
        assert len(bs) == len(ss) > 15, (k, [c.kernel for c in bs], [c.kernel for c in ss])
        for g, s in zip(bs, ss):
            assert g.kernel.replace("_groups", "").replace("_lanes", "") == s.kernel and g.module == s.module, \
                (g.kernel, s.kernel)
            assert g.block == s.block and g.smem == s.smem, g.kernel
            assert _strip(g.grid) == _strip(s.grid), (g.kernel, g.grid, s.grid)
            if g.module == "plan":  # the same rows, but the lm_head's: the gathered ones (checked below)
                assert g.kernel == "lm" or g.args == s.args, (k, g.kernel)
                continue
            assert len(g.args) == _params(g.module, g.kernel), g.kernel
            got = _resolve(g, mtp, tables, w, False)
            want = _solo_args(s)
            if got is None:
                got = [_canon(a) for a in g.args]
                if g.kernel == "embed_rows":  # the ids: the step's lane table's instead of mtp_ids
                    assert g.args[0] is (m.mtp_ids0 if k == 0 else m.mtp_ids1) and s.args[0] is m.mtp_ids
                    got, want = got[1:], want[1:]
            else:
                resolved += 1
            assert got == want, (k, g.kernel)
        # the gather: the row the solo chain's lm_head reads (its last row of the step) to mtp_hidden_in row 0
        gather, chain = glue
        src, lds, groups, dst, ldd, h = gather.args
        assert src is m.mtp_out and dst is m.mtp_hidden_in and groups is tables.group_table
        assert lds.item() == ldd.item() == m.hp and h.item() == m.cfg.hidden_size and gather.grid == (1,)
        row = int(groups[C.GT_FIRST * C.LANES_MAX]) + int(groups[C.GT_COUNT * C.LANES_MAX]) - 1
        assert row == (t - 1 if k == 0 else 0)
        lm, lm_solo = [c for c in bs if c.kernel == "lm"], [c for c in ss if c.kernel == "lm"]
        assert len(lm) == len(lm_solo) == 1 and lm[0].grid == lm_solo[0].grid == (1, 0)
        assert lm[0].args == (("at", _addr(m.mtp_hidden_in)), m.hp)  # row 0 of the gathered rows ...
        assert lm_solo[0].args == (("at", _addr(m.mtp_out[row])), m.hp)  # ... = the row the solo lm_head reads
        # the step glue: the same draft slot, margin and feed; the next step's id and position
        s_tok, s_margin, _, _, s_k, s_feed, s_ids, s_hid, s_src, s_h, _, s_adv = step.args
        b_tok, b_margin, out, b_depth, b_k, b_feed, b_lanes, b_adv, b_n = chain.args
        assert b_tok is s_tok and b_margin is s_margin and out is m.mtp_batch_out and b_lanes is m.mtp_lanes1
        assert b_k.item() == s_k.item() == k and b_feed.item() == s_feed.item() == int(k + 1 < depth)
        assert b_depth.item() == depth and b_n.item() == 1 and chain.grid == (1,) and chain.block >= 1
        assert _addr(s_src) == _addr(m.mtp_out[row]) and s_hid is m.mtp_hidden_in and s_ids is m.mtp_ids
        assert s_h.item() == m.cfg.hidden_size
        if s_feed.item():  # what the two glue kernels leave for step k + 1 (the kernels' bodies, on the host)
            solo_pos += s_adv.item()
            solo_ids = [toks[k]]
            lanes1[at_pos] += b_adv.item()
            m.mtp_ids1[0] = toks[k]
    assert resolved == depth * 3  # per step: the KV store, the attention and its combine


@pytest.mark.parametrize("mma", [True, False])
def test_chains_widen_the_lane_and_group_dimensions(rec, mma):
    """Step 0 of 4 chains of 11 rows runs every launch on the 11 lanes (attention per group: grid z = the 4 groups
    for mma, whose block covers the widest possible group, 11 - 4 + 1 lanes), later steps on 4 lanes; the lm_head,
    argmax and glue on the 4 chains."""
    from q27py.gpu import kernels as K

    m, _ = _mtp_model(rec, "bf16", mma)
    m.enqueue_mtp_batch(11, 4, 3)
    steps = _steps(rec.calls)
    assert len(steps) == 3
    for k, step in enumerate(steps):
        n = 11 if k == 0 else 4
        for a in step:
            if a.module == "plan":
                assert a.grid == ((4, 0) if a.kernel == "lm" else (n, 0)), (k, a.kernel, a.grid)
            elif a.kernel.startswith("attn_mma_groups"):
                assert a.grid[2] == 4 and a.block == 32 * K.attention_mma_warps(n - 4 + 1, 6), (k, a.grid, a.block)
            elif a.kernel.startswith("attn_split_groups"):
                assert a.grid[2] == n
            elif a.kernel in ("mtp_gather_last", "top2_final"):
                assert a.grid == (4,)
            elif a.kernel == "top2_partial":
                assert a.grid[0] == 4
            elif a.kernel == "mtp_chain_step_lanes":
                assert a.args[-1].item() == 4 and a.args[3].item() == 3 and a.args[4].item() == k
            else:
                assert a.grid[0] == n, (k, a.kernel, a.grid)
        assert [a.kernel for a in step if a.module == "chain"] == ["mtp_gather_last", "mtp_chain_step_lanes"]


# ---------------------------------------------------------------- the glue kernels (nvcc)
@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_chain_glue_builds_and_copies_only(tmp_path):
    """chain.cu builds with the glue entries; they move ids and rows without floating-point math (a copy
    cannot change a bit), and their parameter lists are what the wrappers pass."""
    src = tmp_path / "chain.cu"
    src.write_text(source_text("chain"), encoding="utf-8")
    out = tmp_path / "chain.ptx"
    r = subprocess.run([NVCC, *compile_options(), "-arch=sm_90", "-ptx", "-o", str(out), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    ent = _entries(out.read_text())
    assert {"mtp_chain_step", "mtp_gather_last", "mtp_chain_step_lanes"} <= set(ent)
    for k in ("mtp_gather_last", "mtp_chain_step_lanes"):
        body = ent[k]
        assert not any(op in body for op in ("add.f32", "mul.f32", "fma.rn.f32", "cvt.rn")), k
    assert _params("chain", "mtp_gather_last") == 6 and _params("chain", "mtp_chain_step_lanes") == 9
