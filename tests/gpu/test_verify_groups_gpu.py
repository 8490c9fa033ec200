"""FastModel.verify_batch / commit_batch (speculative drafts inside the shared weight sweep, issue 15)
against solo verify forwards and commits, bitwise.

verify_batch(states, groups)'s contract (model/interface.py): output i is forward(states[i], groups[i],
logits_rows="all", verify=True)'s -- logits [W_i, V], device greedy ids, hidden rows -- and
commit_batch(states, traces, ns) leaves states[i] as commit(ns[i]) after that solo verify does: KV rows up
to the position, GDN state, conv windows, position; the next decode step's logits agree too. Each case
prefills pairs of twin states to different lengths (a fresh state included), runs several rounds
(graphs: eager, capture, replays) of verify_batch over random groups and drafts with random kept
counts (some groups not committed at all), the solo twins doing the same one call at a time, and
compares after every round. One case puts a group across the split kernel's split-size step (pos0 +
16 = 4096), where a lane run at its own position would take another split size than its round.

Device command: python3 -m pytest -q tests/gpu/test_verify_groups_gpu.py tests/gpu/test_verify_groups_layout.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).parent))
from test_decode_batch import heads27b, read, states_equal, tiny, twins  # noqa: E402


def full_read(out) -> dict:
    """read() plus the trace's width and the device copy of the hidden rows."""
    got = read(out)
    got["owned"] = out.hidden_owned().get()
    return got


def verify_round(model, batch, solo, groups, ns, what=""):
    """verify_batch over `batch` + commit_batch of the groups with ns[i] > 0, vs forward(verify) + commit on
    each twin in `solo`: outputs, then states, then one decode step's logits, bitwise."""
    outs = model.verify_batch(batch, groups)
    assert len(outs) == len(batch)
    got = [full_read(o) for o in outs]  # read before any other call reuses the scratch
    keep = [i for i, n in enumerate(ns) if n]
    model.commit_batch([batch[i] for i in keep], [outs[i].trace for i in keep], [ns[i] for i in keep])
    for i, (st, g) in enumerate(zip(solo, groups)):
        v = model.forward(st, g, logits_rows="all", verify=True)
        want = read(v)
        for k in want:
            np.testing.assert_array_equal(got[i][k], want[k], err_msg=f"{what} group {i}: {k}")
        np.testing.assert_array_equal(got[i]["owned"], want["hidden"], err_msg=f"{what} group {i}: hidden_owned")
        w = len(g)
        assert got[i]["logits"].shape == (w, model.cfg.vocab_size) and got[i]["greedy"].shape == (w,)
        assert outs[i].trace.n_tokens == w and outs[i].trace.state_id == batch[i].id
        if ns[i]:
            model.commit(st, v.trace, ns[i])
    for i, (a, b) in enumerate(zip(batch, solo)):
        states_equal(a, b, f"{what} group {i}")


def next_step(model, batch, solo, seed, what=""):
    """One plain decode step on every pair: the committed states feed the same logits."""
    ids = np.random.default_rng(seed).integers(0, model.cfg.vocab_size, len(batch))
    for i, (a, b, t) in enumerate(zip(batch, solo, ids)):
        la = model.forward(a, [int(t)]).logits.copy()
        lb = model.forward(b, [int(t)]).logits
        np.testing.assert_array_equal(la, lb, err_msg=f"{what} pair {i}: the next step's logits")
        states_equal(a, b, f"{what} pair {i} after the next step")


def random_groups(model, widths, rng):
    return [rng.integers(0, model.cfg.vocab_size, w).tolist() for w in widths]


def run_rounds(model, lengths, width_sets, seed=0):
    batch, solo = twins(model, lengths, seed)
    rng = np.random.default_rng(1000 + seed)
    for r, widths in enumerate(width_sets):
        sel = list(range(len(widths)))
        rng.shuffle(sel)  # the states of a round in another order each time (one graph per lanes, groups)
        b, s = [batch[i] for i in sel], [solo[i] for i in sel]
        groups = random_groups(model, widths, rng)
        ns = [int(rng.integers(1, w + 1)) for w in widths]
        if r % 2:
            ns[0] = 0  # a group verified but not committed (commit_batch takes any subset)
        verify_round(model, b, s, groups, ns, f"round {r} {widths}")
    next_step(model, batch, solo, seed, "after the rounds")


WIDTHS = [[3, 1, 5, 2], [3, 1, 5, 2], [2, 6, 1, 4], [3, 1, 5, 2], [1, 1, 1, 1], [4, 4, 4, 4]]

MODELS = {
    "tiny-bf16-f32kv": lambda g: tiny("bf16", "f32", g, verify_groups=True),  # split attention on fp32 rows, v1 GEMV
    "tiny-q4s-bf16kv": lambda g: tiny("q4s", "bf16", g, verify_groups=True),  # a8 GEMV, the default attention
    "tiny-q4s-bf16kv-mma": lambda g: tiny("q4s", "bf16", g, attn_decode="mma", verify_groups=True),
    "tiny-q4s-bf16kv-split": lambda g: tiny("q4s", "bf16", g, attn_decode="split", verify_groups=True),
    "tiny-q4s-fp8kv": lambda g: tiny("q4s", "fp8", g, verify_groups=True),
    "tiny-q4s-fused": lambda g: tiny("q4s", "bf16", g, gdn_fused=True, verify_groups=True),  # solo: fused kernel
}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_verify_batch_equals_solo_verify_and_commit(name, graphs):
    model = MODELS[name](graphs)
    assert model.verify_lanes == 16
    run_rounds(model, [0, 37, 150, 301], WIDTHS, seed=len(name))
    if graphs:
        assert model.graphs.model_replays > 0, "the grouped sweep never replayed its graph"
        # per-state keys are (state id, kind, ..): no grouped sweep or commit among them, both at model level
        assert not any(k[1] in ("groups", "commit-groups") for k in model.graphs.graphs), "group graphs keyed per state"
        assert {k[0] for k in model.graphs.model_graphs} >= {"groups", "commit-groups"}, list(model.graphs.model_graphs)


@pytest.mark.parametrize("widths", [[16], [1] * 16, [5, 3, 8], [1, 15]], ids=["one16", "sixteen1", "5-3-8", "1-15"])
def test_extreme_splits(widths):
    """The whole width in one group, one lane per group (16 states), and lopsided splits."""
    model = tiny("q4s", "bf16", graphs=True, verify_groups=True)
    lengths = sorted(np.random.default_rng(len(widths)).choice(np.arange(1, 400), size=len(widths), replace=False))
    run_rounds(model, [int(x) for x in lengths], [widths] * 3, seed=sum(widths) + len(widths))


@pytest.mark.parametrize("kv,attn", [("bf16", "mma"), ("bf16", "split"), ("fp8", "mma"), ("fp8", "split")])
def test_verify_batch_on_27b_heads(kv, attn):
    """The 27B's head shapes: attention d256 (mma: rows of 6 q heads per lane over warps), GDN k4."""
    from q27py.gpu import forward

    if kv == "fp8" and attn == "mma":
        forward.FP8_ATTN_MMA, saved = True, forward.FP8_ATTN_MMA
    try:
        model = heads27b(kv, graphs=True, attn_decode=attn, verify_groups=True)
    finally:
        if kv == "fp8" and attn == "mma":
            forward.FP8_ATTN_MMA = saved
    assert model.attn_mma == (attn == "mma") and model.verify_lanes == 16
    run_rounds(model, [0, 700, 1300, 1900], [[3, 1, 5, 2], [6, 2, 7, 1], [3, 1, 5, 2]], seed=13)


def test_group_across_the_split_size_step():
    """A group whose lanes straddle the split kernel's split-size step (split_size(pos0, 16) turns from 64
    to 128 positions at pos0 = 4081): every lane takes its round's split size (from the group's pos0), as
    the solo verify does -- a lane run as a decode at its own position would take the other one."""
    from q27py import DEFAULT_MODEL_DIR
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint

    model = FastModel(from_checkpoint(Checkpoint.open(DEFAULT_MODEL_DIR), "q4s", progress=False), max_context=4608,
                      kv_dtype="bf16", chunk=64, attn_decode="split", batch_sweep=True, verify_groups=True)
    batch, solo = twins(model, [4076, 4079, 4090, 30], seed=21)
    rng = np.random.default_rng(5)
    for r in range(3):
        groups = random_groups(model, [6, 4, 3, 3], rng)
        verify_round(model, batch, solo, groups, [1, 2, 1, 3], f"round {r}")
    next_step(model, batch, solo, 3, "after the rounds")


def test_graphs_serve_every_split_of_one_shape():
    """Calls of one (lanes, groups) shape over other widths and states replay one graph (the widths and
    the state pointers live in the tables); the commit has one graph per group count."""
    model = tiny("q4s", "bf16", graphs=True, verify_groups=True)
    batch, solo = twins(model, [3, 90, 17, 250, 1, 64], seed=11)
    rng = np.random.default_rng(2)
    for r, (sel, widths) in enumerate([([0, 1, 2], [3, 4, 4]), ([5, 1, 3], [1, 1, 9]), ([4, 0, 2], [5, 5, 1]),
                                       ([3, 4, 5], [2, 8, 1]), ([2, 1, 0], [4, 3, 4])]):
        groups = random_groups(model, widths, rng)
        verify_round(model, [batch[i] for i in sel], [solo[i] for i in sel], groups, [w for w in widths], f"call {r}")
    keys = [k for k in model.graphs.model_graphs if k[:3] == ("groups", 11, 3)]
    assert len(keys) == 1 and model.graphs.model_replays >= 6


def test_verify_lanes_follow_the_switches(monkeypatch):
    assert tiny("q4s", "bf16", verify_groups=True).verify_lanes == 16
    off = tiny("q4s", "bf16", verify_groups=False)
    assert off.verify_lanes == 0
    st = off.new_state()
    with pytest.raises(ValueError):
        off.verify_batch([st], [[1, 2]])
    with pytest.raises(ValueError):
        off.commit_batch([st], [None], [1])
    assert tiny("q4s", "bf16", verify_groups=True, batch_sweep=False).verify_lanes == 0
    assert tiny("q4s", "k5v3", verify_groups=True).verify_lanes == 0  # rotated KV: no lane kernels
    monkeypatch.setenv("Q27_VERIFY_GROUPS", "1")
    assert tiny("q4s", "bf16").verify_lanes == 16  # None: EngineConfig.verify_groups with the environment
    monkeypatch.setenv("Q27_VERIFY_GROUPS", "0")
    assert tiny("q4s", "bf16").verify_lanes == 0


def test_commit_batch_must_follow_its_verify_batch():
    model = tiny("q4s", "bf16", verify_groups=True)
    batch, _ = twins(model, [10, 40, 70], seed=1)
    groups = [[1, 2], [3], [4, 5, 6]]
    for interloper in (lambda: model.forward(batch[0], [9]), lambda: model.decode_batch(batch[1:], [7, 8]),
                       lambda: model.verify_batch(batch[:1], [[5]])):
        outs = model.verify_batch(batch, groups)
        interloper()
        pos = [s.position for s in batch]
        with pytest.raises(RuntimeError):
            model.commit_batch(batch, [o.trace for o in outs], [1, 1, 1])
        assert [s.position for s in batch] == pos  # refused: nothing moved
    outs = model.verify_batch(batch, groups)
    with pytest.raises(RuntimeError):
        model.commit(batch[0], outs[0].trace, 1)  # a group's trace is no solo verify's
    with pytest.raises(RuntimeError):
        model.commit_batch([batch[1]], [outs[0].trace], [1])  # another state's trace
    with pytest.raises(ValueError):
        model.commit_batch([batch[0]], [outs[0].trace], [3])  # more than the group's lanes
    with pytest.raises(ValueError):
        model.commit_batch([batch[0]], [outs[0].trace], [0])
    with pytest.raises(ValueError):
        model.commit_batch([batch[0], batch[0]], [outs[0].trace] * 2, [1, 1])  # a group twice
    pos = [s.position for s in batch]
    model.commit_batch([batch[2], batch[0]], [outs[2].trace, outs[0].trace], [3, 2])  # any order, a subset
    assert [s.position for s in batch] == [pos[0] + 2, pos[1], pos[2] + 3]
    with pytest.raises(RuntimeError):
        model.commit_batch([batch[1]], [outs[1].trace], [1])  # once per verify_batch
    solo = model.forward(batch[1], [1, 2], verify=True)
    with pytest.raises(RuntimeError):
        model.commit_batch([batch[1]], [solo.trace], [1])  # a solo verify's trace
    model.commit(batch[1], solo.trace, 1)


def test_outputs_surface_and_freshness():
    model = tiny("q4s", "bf16", verify_groups=True)
    batch, _ = twins(model, [10, 40, 70], seed=1)
    outs = model.verify_batch(batch, [[5, 6], [7], [8, 9, 10]])
    v = model.cfg.vocab_size
    words = np.zeros((2, -(-v // 32)), dtype=np.uint32)
    allowed = [3, 99, 1000]
    for a in allowed:
        words[:, a // 32] |= np.uint32(1 << (a % 32))
    for o, w in zip(outs, (2, 1, 3)):
        assert o.rows.tolist() == list(range(w))
        greedy = o.greedy_ids()  # the device argmax (once the logits are on the host, greedy_ids is the host's)
        picks = [w - 1, 0][: min(2, w)]
        dev = o.masked_greedy_ids(picks, words[: len(picks)])
        host = [int(np.argmax(np.where(np.isin(np.arange(v), allowed), o.logits[p], -np.inf))) for p in picks]
        assert dev.tolist() == host and all(d in allowed for d in host)
        np.testing.assert_array_equal(greedy, np.argmax(o.logits, axis=1))
        np.testing.assert_array_equal(o.hidden_device.get()[:, : model.cfg.hidden_size], o.hidden)
        with pytest.raises(IndexError):
            o.masked_greedy_ids([w], words[:1])
    assert [s.position for s in batch] == [10, 40, 70]  # a verify commits nothing
    stale = model.verify_batch(batch, [[1], [2], [3]])
    model.forward(batch[0], [4])
    with pytest.raises(RuntimeError):
        stale[1].logits
    with pytest.raises(RuntimeError):
        stale[2].greedy_ids()
    with pytest.raises(RuntimeError):
        stale[0].hidden_owned()


def test_arguments_are_checked():
    model = tiny("q4s", "bf16", verify_groups=True)
    states = [model.new_state() for _ in range(model.max_batch + 1)]
    for st in states[:3]:
        model.forward(st, [1, 2, 3])
    for args in [
        (states[:2], [[1] * 9, [2] * 8]),  # 17 lanes > verify_lanes
        (states[:1], [[1] * 17]),  # a group over VERIFY_SPAN
        (states[:2], [[1], []]),  # an empty group
        ([states[0], states[0]], [[1], [2]]),  # the same state twice
        (states[:2], [[1]]),  # a group short
        (states[:2], [[1], [model.cfg.vocab_size]]),  # id out of range
        (states, [[1]] * len(states)),  # more than max_batch
        ([], []),
    ]:
        with pytest.raises(ValueError):
            model.verify_batch(*args)
    other = tiny("q4s", "bf16", verify_groups=True)
    with pytest.raises(ValueError):
        model.verify_batch([states[0], other.new_state()], [[1], [2]])  # another model's state
    states[1].position = model.max_pos - 1  # room for one position only
    with pytest.raises(ValueError):
        model.verify_batch(states[:2], [[1], [2, 3]])
    assert states[0].position == 3  # refused calls change nothing
    one = model.verify_batch(states[:1], [[7, 8]])  # one group is fine (the engine may send one)
    assert one[0].logits.shape == (2, model.cfg.vocab_size)
