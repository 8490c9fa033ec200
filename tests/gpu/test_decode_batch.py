"""FastModel.decode_batch (one weight sweep for several sequences) against solo forwards, bitwise.

decode_batch(states, ids) commits one token per sequence; its contract is that every lane's
logits, device greedy id, hidden row and the state afterwards (KV rows, fp8 exponents, GDN state,
conv window, position) are exactly those of forward(state, [id]) on a twin of that state, whatever
the other lanes and their number are. Each case prefills pairs of twin states to very different
lengths (a fresh state at position 0 included), runs several consecutive steps (graphs: eager,
capture, replays), and compares after every step. The set of states changes between calls of one
width (one captured graph, a new lane table), and the KV formats / kernels without lane kernels
take the per-state loop with the same outputs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.gpu


def tiny(tier="bf16", kv="f32", graphs=False, **kw):
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint

    kw.setdefault("batch_sweep", True)
    m = FastModel(from_checkpoint(Checkpoint.open(DEFAULT_MODEL_DIR), tier, progress=False), max_context=512,
                  kv_dtype=kv, chunk=64, **kw)
    if graphs:
        m.enable_graphs()
    return m


def heads27b(kv="bf16", graphs=False, **kw):
    """The 27B's attention and GDN heads (24 q / 4 kv x 256, 16 / 48 x 128, conv 4, partial RoPE) at a
    small width and depth, random q4s weights: the real per-lane kernels' shapes (mma d256, GDN k4)."""
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import random_weights
    from q27py.model.config import FULL, LINEAR, qwen36_27b_config

    cfg = dataclasses.replace(qwen36_27b_config(), vocab_size=4096, hidden_size=512, intermediate_size=1024,
                              num_hidden_layers=4, layer_types=(LINEAR, LINEAR, LINEAR, FULL), mtp_num_hidden_layers=0,
                              max_position_embeddings=4096)
    m = FastModel(random_weights(cfg, "q4s", seed=5, with_mtp=False), max_context=2048, kv_dtype=kv, chunk=64,
                  batch_sweep=True, **kw)
    if graphs:
        m.enable_graphs()
    return m


def twins(model, lengths, seed=0):
    """Two lists of states, pairwise identical: each pair prefilled with its own random prompt."""
    rng = np.random.default_rng(seed)
    a, b = [], []
    for n in lengths:
        sa, sb = model.new_state(), model.new_state()
        if n:
            ids = rng.integers(0, model.cfg.vocab_size, n)
            model.forward(sa, ids, logits_rows="last")
            model.forward(sb, ids, logits_rows="last")
        a.append(sa)
        b.append(sb)
    return a, b


def snapshot(st) -> dict:
    """Everything a committed decode step writes in a state, on the host."""
    n = st.position
    out = {"position": st.position, "k": st.k[:, :, :n].get(), "v": st.v[:, :, :n].get(), "gdn": st.gdn.get(),
           "window": st.window.get()}
    for name, arr in st.side_arrays().items():
        if not name.startswith("mtp."):
            out[name] = arr[:, :, :n].get()
    return out


def states_equal(a, b, what=""):
    sa, sb = snapshot(a), snapshot(b)
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=f"{what}: state {k} differs")


def read(out) -> dict:
    # the device argmax first (once logits are on the host, greedy_ids is the host argmax)
    return {"greedy": np.array(out.greedy_ids()), "logits": np.array(out.logits), "hidden": np.array(out.hidden)}


def step(model, batch, solo, ids, what=""):
    """One decode_batch over `batch` vs one forward per twin in `solo`: outputs and states bitwise."""
    outs = model.decode_batch(batch, ids)
    assert len(outs) == len(batch)
    got = [read(o) for o in outs]  # read before the solo forwards reuse the scratch
    for i, (st, tok) in enumerate(zip(solo, ids)):
        want = read(model.forward(st, [int(tok)]))
        for k in want:
            np.testing.assert_array_equal(got[i][k], want[k], err_msg=f"{what} lane {i}: {k}")
        assert got[i]["logits"].shape == (1, model.cfg.vocab_size) and got[i]["greedy"].shape == (1,)
        assert got[i]["hidden"].shape == (1, model.cfg.hidden_size)
    for i, (a, b) in enumerate(zip(batch, solo)):
        states_equal(a, b, f"{what} lane {i}")


def lengths_for(b, top, seed):
    """b prompt lengths spread over 0..top (one fresh state, the rest random, all different)."""
    rng = np.random.default_rng(seed)
    return [0] + sorted(int(x) for x in rng.choice(np.arange(1, top), size=b - 1, replace=False))


def run_steps(model, b, top, steps=3, seed=0):
    batch, solo = twins(model, lengths_for(b, top, seed), seed)
    for s in range(steps):
        for i, (x, y) in enumerate(zip(batch, solo)):
            states_equal(x, y, f"B={b} before step {s} lane {i}")
        ids = np.random.default_rng(100 + s).integers(0, model.cfg.vocab_size, b)
        step(model, batch, solo, ids, f"B={b} step {s}")


MODELS = {
    "tiny-bf16-f32kv": lambda g: tiny("bf16", "f32", g),  # split attention on fp32 rows, v1 GEMV
    "tiny-q4s-bf16kv": lambda g: tiny("q4s", "bf16", g),  # a8 GEMV, mma attention (the defaults)
    "tiny-q4s-bf16kv-split": lambda g: tiny("q4s", "bf16", g, attn_decode="split"),
    "tiny-q4s-fp8kv": lambda g: tiny("q4s", "fp8", g),  # fp8 codes (mma where EngineConfig.attn_decode_fp8)
    "tiny-q4s-fp8kv-split": lambda g: tiny("q4s", "fp8", g, attn_decode="split"),
    "tiny-q4s-fused": lambda g: tiny("q4s", "bf16", g, gdn_fused=True),  # the fused GDN step
}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("b", [2, 3, 8, 16])
def test_decode_batch_equals_solo_forwards(name, graphs, b):
    model = MODELS[name](graphs)
    run_steps(model, b, top=400, seed=b)
    if graphs and b > 1:
        assert model.graphs.model_replays > 0, "the batched step never replayed its graph"
        assert not any(isinstance(k[0], str) for k in model.graphs.graphs), "batch graphs keyed per state"


@pytest.mark.parametrize("kv,attn", [("bf16", "mma"), ("bf16", "split"), ("fp8", "mma"), ("fp8", "split")])
@pytest.mark.parametrize("b", [2, 16])
def test_decode_batch_on_27b_heads(kv, attn, b):
    from q27py.gpu import forward

    if kv == "fp8" and attn == "mma":
        forward.FP8_ATTN_MMA, saved = True, forward.FP8_ATTN_MMA
    try:
        model = heads27b(kv, graphs=True, attn_decode=attn)
    finally:
        if kv == "fp8" and attn == "mma":
            forward.FP8_ATTN_MMA = saved
    assert model.attn_mma == (attn == "mma")
    run_steps(model, b, top=1500, seed=7 + b)


def test_fp8_mma_lanes(monkeypatch):
    """The fp8 mma kernel forced on (forward.FP8_ATTN_MMA, whatever EngineConfig.attn_decode_fp8 says)."""
    from q27py.gpu import forward

    monkeypatch.setattr(forward, "FP8_ATTN_MMA", True)
    model = tiny("q4s", "fp8", graphs=True)
    assert model.attn_mma
    run_steps(model, 8, top=400, seed=3)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_changing_state_sets_reuse_one_graph(graphs):
    """Calls of one width over different states (and orders) replay one graph with a new lane table."""
    model = tiny("q4s", "bf16", graphs)
    batch, solo = twins(model, [3, 90, 17, 250, 1, 64, 129, 0], seed=11)
    picks = [[0, 1, 2, 3, 4], [5, 1, 7, 3, 2], [4, 6, 0, 5, 7], [7, 6, 5, 4, 3], [0, 1, 2, 3, 4]]
    for s, sel in enumerate(picks):
        ids = np.random.default_rng(s).integers(0, model.cfg.vocab_size, len(sel))
        step(model, [batch[i] for i in sel], [solo[i] for i in sel], ids, f"call {s} {sel}")
    if graphs:
        keys = [k for k in model.graphs.model_graphs if k[:2] == ("batch", 5)]
        assert len(keys) == 1 and model.graphs.model_replays >= 3


def test_rotated_kv_loops_with_the_same_outputs():
    """k5v3 has no lane kernels: decode_batch runs one forward per state, same contract."""
    model = tiny("q4s", "k5v3", graphs=True)
    assert not model._lanes_supported()
    run_steps(model, 5, top=300, seed=2)


def test_wide_fused_gdn_loops():
    """A fused GDN step wider than its lane entry's bounds keeps the solo kernel: the per-state loop."""
    from q27py.gpu import constants as C

    model = tiny("q4s", "bf16", gdn_fused=True)
    model.gdn_fused_warps = C.GDN_FD_LANES_MAX_WARPS * 2
    from q27py.gpu import kernels as K

    cfg = model.cfg
    if not K.gdn_fused_supported(cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                 cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, 1, model.gdn_fused_warps):
        pytest.skip("the tiny model's GDN shape does not take that many warps")
    assert not model._lanes_supported()
    run_steps(model, 3, top=200, seed=4)


def test_outputs_surface_and_freshness():
    model = tiny("q4s", "bf16")
    batch, _ = twins(model, [10, 40, 70], seed=1)
    outs = model.decode_batch(batch, [5, 6, 7])
    v = model.cfg.vocab_size
    words = np.zeros((1, -(-v // 32)), dtype=np.uint32)
    allowed = [3, 99, 1000]
    for a in allowed:
        words[0, a // 32] |= np.uint32(1 << (a % 32))
    for o in outs:
        assert o.trace is None
        dev = int(o.masked_greedy_ids([0], words)[0])
        host = int(np.argmax(np.where(np.isin(np.arange(v), allowed), o.logits[0], -np.inf)))
        assert dev == host and dev in allowed
        assert int(o.greedy_ids()[0]) == int(np.argmax(o.logits[0]))
        np.testing.assert_array_equal(o.hidden_device.get()[:, : model.cfg.hidden_size], o.hidden)
        with pytest.raises(IndexError):
            o.masked_greedy_ids([1], words)
    assert [s.position for s in batch] == [11, 41, 71]
    stale = model.decode_batch(batch, [1, 2, 3])
    model.forward(batch[0], [4])
    with pytest.raises(RuntimeError):
        stale[1].logits
    with pytest.raises(RuntimeError):
        stale[2].greedy_ids()


def test_arguments_are_checked():
    model = tiny("q4s", "bf16")
    states = [model.new_state() for _ in range(model.max_batch + 1)]
    assert model.max_batch == 16
    with pytest.raises(ValueError):
        model.decode_batch(states, list(range(len(states))))  # more than max_batch
    with pytest.raises(ValueError):
        model.decode_batch([states[0], states[0]], [1, 2])  # the same state twice
    with pytest.raises(ValueError):
        model.decode_batch(states[:2], [1])  # one id short
    with pytest.raises(ValueError):
        model.decode_batch(states[:2], [1, model.cfg.vocab_size])  # id out of range
    with pytest.raises(ValueError):
        model.decode_batch([], [])
    other = tiny("q4s", "bf16")
    with pytest.raises(ValueError):
        model.decode_batch([states[0], other.new_state()], [1, 2])  # another model's state
    states[1].position = model.max_pos  # full window
    with pytest.raises(ValueError):
        model.decode_batch(states[:2], [1, 2])
    assert states[0].position == 0  # refused calls change nothing
    one = model.decode_batch(states[:1], [7])  # B = 1 is a plain forward
    assert len(one) == 1 and states[0].position == 1 and one[0].logits.shape == (1, model.cfg.vocab_size)


def test_switched_off_allows_one_sequence():
    """EngineConfig.batch_sweep off: max_batch 1 (callers run one forward per sequence), more refused."""
    model = tiny("q4s", "bf16", batch_sweep=False)
    assert model.max_batch == 1
    a, b = model.new_state(), model.new_state()
    with pytest.raises(ValueError):
        model.decode_batch([a, b], [1, 2])
    assert len(model.decode_batch([a], [1])) == 1 and a.position == 1


def test_batch_then_verify_and_commit():
    """A verify round after a batched step (the scheduler mixes both) sees the batched state's bits."""
    model = tiny("q4s", "bf16", graphs=True)
    batch, solo = twins(model, [30, 77], seed=9)
    for s in range(3):
        step(model, batch, solo, [11 + s, 12 + s], f"step {s}")
        va = model.forward(batch[0], [5, 6, 7], verify=True)
        la = va.logits.copy()
        model.commit(batch[0], va.trace, 2)
        vb = model.forward(solo[0], [5, 6, 7], verify=True)
        np.testing.assert_array_equal(la, vb.logits)
        model.commit(solo[0], vb.trace, 2)
        states_equal(batch[0], solo[0], f"after verify {s}")
