"""FastModel.mtp_draft_batch (several sequences' MTP ladders in one MTP sweep per step, issue 15) against solo
mtp_draft_chain calls, bitwise.

mtp_draft_batch(kvs, hiddens, next_ids, starts, depth)'s contract (model/interface.py): output i is
mtp_draft_chain(kvs[i], hiddens[i], next_ids[i], starts[i], depth)'s -- draft ids [depth] and top1 - top2 margins
[depth] -- and each kv is left as that call leaves it: length and mtp_position start + t + depth - 1, the MTP KV
rows written with the same bits. Each case prefills twin states with different prompts, warms their MTP KV up to
a backlog of t_i rows, drafts the batch on one twin of each pair and one solo chain per pair on the other, and
compares outputs, lengths and the MTP KV rows; then both twins, cut back to start + t as the caller does, run
one more solo chain (which reads the rows the batch wrote) with equal results. Rounds repeat over shuffled
chains (graphs: eager, capture, replays of one model-level graph).

Device command: python3 -m pytest -q tests/gpu/test_mtp_draft_batch_gpu.py tests/gpu/test_mtp_draft_batch_layout.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).parent))
from test_decode_batch import tiny  # noqa: E402


def heads27b_mtp(kv="bf16", graphs=False, **kw):
    """The 27B's attention heads (24 q / 4 kv x 256, partial RoPE) and GDN heads at a small width, with an MTP
    layer (random q4s weights): the real MTP attention kernels' shapes (mma d256)."""
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import random_weights
    from q27py.model.config import FULL, LINEAR, qwen36_27b_config

    cfg = dataclasses.replace(qwen36_27b_config(), vocab_size=4096, hidden_size=512, intermediate_size=1024,
                              num_hidden_layers=4, layer_types=(LINEAR, LINEAR, LINEAR, FULL), mtp_num_hidden_layers=1,
                              max_position_embeddings=4096)
    m = FastModel(random_weights(cfg, "q4s", seed=7, with_mtp=True), max_context=2048, kv_dtype=kv, chunk=64,
                  batch_sweep=True, **kw)
    if graphs:
        m.enable_graphs()
    return m


def prefill(model, st, ids) -> np.ndarray:
    """Prefill st with ids one chunk at a time; every row's post-norm hidden state [len, H] (host)."""
    out = []
    for s0 in range(0, len(ids), model.chunk):
        out.append(model.forward(st, ids[s0 : s0 + model.chunk], logits_rows="last").hidden.copy())
    return np.concatenate(out)


@dataclasses.dataclass
class Pair:
    a: object  # the batch's state
    b: object  # the solo chains' twin
    rows: np.ndarray  # backlog hidden rows [t, H]
    nxt: np.ndarray  # their next ids [t]
    start: int
    tail: np.ndarray  # a row for the chain after (any hidden row)


def twins(model, specs, seed=0, device_rows=()):
    """Pairs of twin states, pair i prefilled with its own prompt of specs[i][0] tokens and its MTP KV warmed over
    all but the last specs[i][1] rows (the backlog). device_rows: pairs whose backlog rows are cupy arrays."""
    cp = model.rt.cp
    rng = np.random.default_rng(seed)
    out = []
    for i, (n, t) in enumerate(specs):
        ids = rng.integers(0, model.cfg.vocab_size, n)
        a, b = model.new_state(), model.new_state()
        hid = [prefill(model, st, ids) for st in (a, b)]
        np.testing.assert_array_equal(hid[0], hid[1])
        s = n - t
        for st in (a, b):
            if s:
                model.mtp_forward(st.mtp_kv, hid[0][:s], ids[1 : s + 1], 0, logits_rows="none")
            assert st.mtp_kv.length == s
        rows = hid[0][s:]
        nxt = np.concatenate([ids[s + 1 :], rng.integers(0, model.cfg.vocab_size, 1)])
        out.append(Pair(a, b, cp.asarray(rows) if i in device_rows else rows, nxt, s, hid[0][-1:]))
    return out


def mtp_rows(st, n) -> dict:
    """The MTP KV rows 0 .. n - 1 of a state (K / V and the fp8 exponents), on the host."""
    out = {"k": st.mtp_k[:, :n].get(), "v": st.mtp_v[:, :n].get()}
    for name, arr in st.side_arrays().items():
        if name.startswith("mtp."):
            out[name] = arr[:, :n].get()
    return out


def rows_equal(a, b, n, what):
    ra, rb = mtp_rows(a, n), mtp_rows(b, n)
    for k in ra:
        np.testing.assert_array_equal(ra[k], rb[k], err_msg=f"{what}: MTP KV {k} rows differ")


def draft_round(model, pairs, depth, what=""):
    """One mtp_draft_batch over every pair's a-state vs mtp_draft_chain on each b-state: outputs, lengths and the
    MTP KV rows bitwise. Both cut back to start + t afterwards (the caller's truncation)."""
    for p in pairs:  # the caller re-drafts the same backlog: rows past start go
        p.a.mtp_kv.truncate(min(p.a.mtp_kv.length, p.start))
        p.b.mtp_kv.truncate(min(p.b.mtp_kv.length, p.start))
    outs = model.mtp_draft_batch([p.a.mtp_kv for p in pairs], [p.rows for p in pairs], [p.nxt for p in pairs],
                                 [p.start for p in pairs], depth)
    assert len(outs) == len(pairs)
    for i, (p, (ids, margins)) in enumerate(zip(pairs, outs)):
        want_ids, want_margins = model.mtp_draft_chain(p.b.mtp_kv, p.rows, p.nxt, p.start, depth)
        assert ids.dtype == want_ids.dtype == np.int64 and margins.dtype == want_margins.dtype == np.float32
        assert ids.shape == margins.shape == (depth,)
        np.testing.assert_array_equal(ids, want_ids, err_msg=f"{what} chain {i}: draft ids")
        np.testing.assert_array_equal(margins, want_margins, err_msg=f"{what} chain {i}: margins")
        t = len(p.nxt)
        assert p.a.mtp_kv.length == p.b.mtp_kv.length == p.start + t + depth - 1, what
        assert p.a.mtp_position == p.b.mtp_position == p.a.mtp_kv.length, what
        rows_equal(p.a, p.b, p.a.mtp_kv.length, f"{what} chain {i}")
    return outs


def chain_after(model, pairs, depth, seed, what=""):
    """Cut back to start + t (the drafts' rows go), then one solo chain on both twins from one more row: it reads
    the rows the batch wrote, so its drafts agree."""
    rng = np.random.default_rng(seed)
    for i, p in enumerate(pairs):
        end = p.start + len(p.nxt)
        nxt = rng.integers(0, model.cfg.vocab_size, 1)
        got = []
        for st in (p.a, p.b):
            st.mtp_kv.truncate(end)
            got.append(model.mtp_draft_chain(st.mtp_kv, p.tail, nxt, end, depth))
        np.testing.assert_array_equal(got[0][0], got[1][0], err_msg=f"{what} chain {i}: the next chain's ids")
        np.testing.assert_array_equal(got[0][1], got[1][1], err_msg=f"{what} chain {i}: the next chain's margins")
        rows_equal(p.a, p.b, p.a.mtp_kv.length, f"{what} chain {i} after the next chain")


def run_rounds(model, specs, depths, rounds=3, seed=0, device_rows=()):
    pairs = twins(model, specs, seed, device_rows)
    rng = np.random.default_rng(100 + seed)
    for depth in depths:
        for r in range(rounds):
            sel = list(range(len(pairs)))
            if r:
                rng.shuffle(sel)  # another order: other tables, the same (rows, chains, depth) graph
            draft_round(model, [pairs[i] for i in sel], depth, f"depth {depth} round {r}")
        chain_after(model, pairs, depth, seed + depth, f"depth {depth}")
    return pairs


MODELS = {
    "tiny-bf16-f32kv": lambda g: tiny("bf16", "f32", g, verify_groups=True),  # split attention on fp32 rows
    "tiny-q4s-bf16kv": lambda g: tiny("q4s", "bf16", g, verify_groups=True),  # a8 GEMV, the default attention
    "tiny-q4s-bf16kv-mma": lambda g: tiny("q4s", "bf16", g, attn_decode="mma", verify_groups=True),
    "tiny-q4s-bf16kv-split": lambda g: tiny("q4s", "bf16", g, attn_decode="split", verify_groups=True),
    "tiny-q4s-fp8kv": lambda g: tiny("q4s", "fp8", g, verify_groups=True),
}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_mtp_draft_batch_equals_solo_chains(name, graphs):
    model = MODELS[name](graphs)
    assert model.mtp_batch_lanes == 16
    run_rounds(model, [(20, 1), (37, 3), (150, 2), (9, 1)], depths=(1, 4), seed=len(name), device_rows=(1,))
    if graphs:
        assert model.graphs.model_replays > 0, "the batched chain never replayed its graph"
        assert {("mtp-batch", 7, 4, 1), ("mtp-batch", 7, 4, 4)} <= set(model.graphs.model_graphs), \
            list(model.graphs.model_graphs)
        assert not any(k[1] == "mtp-batch" for k in model.graphs.graphs), "batched chains keyed per state"


def test_fp8_mma_attention(monkeypatch):
    """fp8 KV on the mma kernel (forward.FP8_ATTN_MMA forced on)."""
    from q27py.gpu import forward

    monkeypatch.setattr(forward, "FP8_ATTN_MMA", True)
    model = tiny("q4s", "fp8", graphs=True, attn_decode="mma", verify_groups=True)
    run_rounds(model, [(20, 1), (37, 3), (150, 2), (9, 1)], depths=(1, 4), seed=3)


@pytest.mark.parametrize("specs", [[(40, 16)], [(30, 1)] * 16, [(50, 8), (60, 6), (70, 5)], [(64, 20), (30, 3), (45, 1)],
                                   [(25, 2), (80, 14)]],
                         ids=["one16", "sixteen1", "parts-8-6-5", "long-backlog", "2-14"])
def test_extreme_and_split_batches(specs):
    """A whole 16-row chain, sixteen one-row chains, more rows than one sweep holds (two parts), a backlog over
    VERIFY_SPAN rows (warmed first, its last row in the batch) beside others, and a lopsided split."""
    model = tiny("q4s", "bf16", graphs=True, verify_groups=True)
    run_rounds(model, specs, depths=(3,), seed=sum(n for n, _ in specs))


@pytest.mark.parametrize("kv,attn", [("bf16", "mma"), ("bf16", "split"), ("fp8", "split"), ("fp8", "mma")])
def test_on_27b_heads(kv, attn):
    """The 27B's head shapes (d256 attention: mma with 6 q heads per lane, or split), longer contexts."""
    from q27py.gpu import forward

    saved = forward.FP8_ATTN_MMA
    forward.FP8_ATTN_MMA = kv == "fp8" and attn == "mma" or saved
    try:
        model = heads27b_mtp(kv, graphs=True, attn_decode=attn, verify_groups=True)
    finally:
        forward.FP8_ATTN_MMA = saved
    assert model.attn_mma == (attn == "mma") and model.mtp_batch_lanes == 16
    run_rounds(model, [(700, 2), (64, 5), (1300, 1), (1900, 3)], depths=(4,), seed=13)


def test_chains_near_the_window_end():
    """Chains whose step rows would pass the window at the batch's depth (the deepest chain's): each runs the
    steps its rows allow (the solo chain of that depth, bitwise), padded with id 0 / margin -inf; the others
    batch as usual. The tiny model's window is 512 rows."""
    model = tiny("q4s", "bf16", graphs=True, verify_groups=True)
    assert model.max_pos == 512
    pairs = twins(model, [(510, 2), (40, 3), (512, 1), (200, 2)], seed=9)
    depth = 4
    for r in range(3):
        for p in pairs:
            p.a.mtp_kv.truncate(p.start)
        outs = model.mtp_draft_batch([p.a.mtp_kv for p in pairs], [p.rows for p in pairs], [p.nxt for p in pairs],
                                     [p.start for p in pairs], depth)
        for i, (p, (ids, margins)) in enumerate(zip(pairs, outs)):
            end = p.start + len(p.nxt)
            room = min(depth, model.max_pos - end + 1)
            p.b.mtp_kv.truncate(p.start)
            want = model.mtp_draft_chain(p.b.mtp_kv, p.rows, p.nxt, p.start, room)
            np.testing.assert_array_equal(ids[:room], want[0], err_msg=f"round {r} chain {i}")
            np.testing.assert_array_equal(margins[:room], want[1], err_msg=f"round {r} chain {i}")
            assert ids[room:].tolist() == [0] * (depth - room) and np.isneginf(margins[room:]).all()
            assert p.a.mtp_kv.length == p.b.mtp_kv.length == end + room - 1 <= model.max_pos
            rows_equal(p.a, p.b, p.a.mtp_kv.length, f"round {r} chain {i}")
    assert [min(depth, model.max_pos - p.start - len(p.nxt) + 1) for p in pairs] == [3, 4, 1, 4]


def test_same_state_twice_and_no_lanes_run_solo_chains():
    """A state twice in one call (the engine never sends it) and a model without verify lanes run the chains one
    after the other: the solo chains' outputs, in order."""
    model = tiny("q4s", "bf16", verify_groups=True)
    pairs = twins(model, [(30, 2), (44, 1)], seed=4)
    p = pairs[0]
    kvs = [p.a.mtp_kv, p.a.mtp_kv, pairs[1].a.mtp_kv]
    got = model.mtp_draft_batch(kvs, [p.rows, p.rows, pairs[1].rows], [p.nxt, p.nxt, pairs[1].nxt],
                                [p.start, p.start, pairs[1].start], 2)
    for (ids, margins), q in zip(got, [p, p, pairs[1]]):
        want = model.mtp_draft_chain(q.b.mtp_kv, q.rows, q.nxt, q.start, 2)
        np.testing.assert_array_equal(ids, want[0])
        np.testing.assert_array_equal(margins, want[1])
    off = tiny("q4s", "bf16", verify_groups=False)
    assert off.mtp_batch_lanes == 0
    pairs = twins(off, [(30, 2), (44, 3)], seed=5)
    draft_round(off, pairs, 3, "no lanes")


def test_arguments_are_checked():
    model = tiny("q4s", "bf16", verify_groups=True)
    pairs = twins(model, [(30, 2), (44, 1)], seed=6)
    kvs, rows, nxt, starts = ([p.a.mtp_kv for p in pairs], [p.rows for p in pairs], [p.nxt for p in pairs],
                              [p.start for p in pairs])
    lengths = [kv.length for kv in kvs]
    for args in [
        (kvs, rows, nxt, starts[:1], 2),  # lists of different lengths
        (kvs, rows, nxt, starts, 9),  # deeper than the draft buffers
        (kvs, rows, [nxt[0], []], starts, 2),  # an empty chain
        (kvs, rows, [nxt[0], [model.cfg.vocab_size]], starts, 2),  # id out of range
        (kvs, rows, nxt, [starts[0], lengths[1] + 1], 2),  # rows not contiguous
    ]:
        with pytest.raises(ValueError):
            model.mtp_draft_batch(*args)
    other = tiny("q4s", "bf16", verify_groups=True)
    with pytest.raises(ValueError):
        model.mtp_draft_batch([kvs[0], other.new_state().mtp_kv], rows, nxt, [starts[0], 0], 2)
    assert [kv.length for kv in kvs] == lengths  # refused calls change nothing


def test_a_pending_verify_batch_survives_a_batch_of_chains():
    """The chains' tables are their own: a verify_batch's commit_batch after an mtp_draft_batch still commits
    (its group table intact), as after a solo chain."""
    from test_decode_batch import states_equal

    model = tiny("q4s", "bf16", verify_groups=True)
    pairs = twins(model, [(30, 2), (44, 1), (60, 3)], seed=8)
    groups = [[1, 2, 3], [4], [5, 6]]
    outs = model.verify_batch([p.a for p in pairs], groups)
    model.mtp_draft_batch([p.a.mtp_kv for p in pairs], [p.rows for p in pairs], [p.nxt for p in pairs],
                          [p.start for p in pairs], 3)
    model.commit_batch([p.a for p in pairs], [o.trace for o in outs], [2, 1, 2])
    for p, g, n in zip(pairs, groups, [2, 1, 2]):
        v = model.forward(p.b, g, verify=True)
        model.commit(p.b, v.trace, n)
        states_equal(p.a, p.b, "after verify_batch, chains, commit_batch")
