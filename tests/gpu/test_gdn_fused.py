"""The fused GDN decode / verify step (cuda/gdn_decode.cu) against the kernel chain it replaces
(gdn_conv + gdn_conv_commit + gdn_step + gated_rmsnorm), bitwise: records (qkvn, g/beta), o,
the normed rows, the state and the conv window; and a FastModel with the switch on against one
with it off (prefill in 16-lane chunks, decode, verify + commit, graph replays), bitwise.
The chain itself is held to the numpy spec in test_kernels.py; one shape here also checks the
fused rows against ops (2e-5, the GDN kernels' tolerance).
"""

from __future__ import annotations

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.model import ops

pytestmark = pytest.mark.gpu

# (h, hv, dk, dv): the 27B's GDN heads, the bundled tiny models', small and ragged ones (dk not a
# multiple of 32 or of 4, dv not a multiple of 32, a last block with idle warps)
SHAPES = {"27b": (16, 48, 128, 128), "tiny-model": (2, 6, 64, 64), "k32": (2, 6, 32, 32), "small": (4, 8, 16, 8),
          "ragged": (2, 4, 98, 36), "dk96": (1, 3, 96, 72)}


@pytest.fixture(scope="module")
def cp():
    import cupy

    from q27py.gpu.runtime import Runtime

    Runtime.get().warm_all()
    return cupy


@pytest.fixture(scope="module")
def K(cp):
    from q27py.gpu import kernels

    return kernels


def inputs(rng, t, h, hv, dk, dv, kw=4):
    c = 2 * h * dk + hv * dv
    ldr = c + hv * dv + 12  # qkv channels, then z, then padding
    d = dict(c=c, ldr=ldr, kw=kw)
    d["raw"] = rng.standard_normal((t, ldr)).astype(np.float32)
    d["window"] = rng.standard_normal((kw - 1, c)).astype(np.float32)
    d["convw"] = (rng.standard_normal((c, kw)) * 0.5).astype(np.float32)
    d["ab"] = rng.standard_normal((t, 2 * hv + 3)).astype(np.float32)
    d["neg_a"] = (-np.exp(rng.standard_normal(hv) * 0.5)).astype(np.float32)
    d["dt"] = rng.standard_normal(hv).astype(np.float32)
    d["state"] = (rng.standard_normal((hv, dv, dk)) * 0.3).astype(np.float32)  # K-last [HV][dv][dk]
    d["norm_w"] = (1 + 0.1 * rng.standard_normal(dv)).astype(np.float32)
    return d


def run_chain(cp, K, d, h, hv, dk, dv, t, commit):
    c, ldr, kw = d["c"], d["ldr"], d["kw"]
    raw, ab = cp.asarray(d["raw"]), cp.asarray(d["ab"])
    window, state = cp.asarray(d["window"]), cp.asarray(d["state"])
    qkvn, gb = cp.full((t, c), np.nan, cp.float32), cp.full((t, 2 * hv), np.nan, cp.float32)
    o, y = cp.full((t, hv * dv), np.nan, cp.float32), cp.full((t, hv * dv + 8), np.nan, cp.float32)
    K.gdn_conv(raw, ldr, window, cp.asarray(d["convw"]), ab, ab.shape[1], cp.asarray(d["neg_a"]), cp.asarray(d["dt"]),
               h, hv, dk, dv, kw, qkvn, gb, t)
    if commit:
        K.gdn_conv_commit(window, 0, raw, ldr, 0, c, kw, 1, n=t)
    K.gdn_step(state, 0, qkvn, 0, gb, 0, o, hv * dv, h, hv, dk, dv, t, emit=True, write_state=commit)
    K.gated_rmsnorm(o, hv * dv, raw[:, c:], ldr, cp.asarray(d["norm_w"]), 1e-6, t, hv, dv, y, y.shape[1])
    return {"qkvn": qkvn, "gb": gb, "o": o, "y": y, "state": state, "window": window}


def run_fused(cp, K, d, h, hv, dk, dv, t, commit, warps, tickets=None, a8=None):
    c, ldr, kw = d["c"], d["ldr"], d["kw"]
    raw, ab = cp.asarray(d["raw"]), cp.asarray(d["ab"])
    window, state = cp.asarray(d["window"]), cp.asarray(d["state"])
    qkvn, gb = cp.full((t, c), np.nan, cp.float32), cp.full((t, 2 * hv), np.nan, cp.float32)
    o, y = cp.full((t, hv * dv), np.nan, cp.float32), cp.full((t, hv * dv + 8), np.nan, cp.float32)
    tickets = cp.zeros(h + hv, cp.int32) if tickets is None else tickets
    K.gdn_decode_fused(raw, ldr, window, cp.asarray(d["convw"]), ab, ab.shape[1], cp.asarray(d["neg_a"]),
                       cp.asarray(d["dt"]), h, hv, dk, dv, kw, qkvn, gb, state, o, hv * dv, cp.asarray(d["norm_w"]),
                       1e-6, y, y.shape[1], tickets, t, commit, warps=warps, a8=a8)
    return {"qkvn": qkvn, "gb": gb, "o": o, "y": y, "state": state, "window": window, "tickets": tickets}


def assert_same(a, b, t, hv, dv):
    for name in ("qkvn", "gb", "o", "state", "window"):
        np.testing.assert_array_equal(a[name].get(), b[name].get(), err_msg=name)
    ya, yb = a["y"].get(), b["y"].get()
    np.testing.assert_array_equal(ya[:, : hv * dv], yb[:, : hv * dv], err_msg="y")
    assert not np.isnan(ya[:, : hv * dv]).any()
    assert np.isnan(ya[:, hv * dv :]).all(), "wrote past the rows' hv x dv columns"


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("commit", [False, True])
def test_fused_equals_chain_bitwise(cp, K, shape, commit):
    h, hv, dk, dv = SHAPES[shape]
    lanes = range(1, 17) if shape in ("27b", "tiny-model") else (1, 2, 5, 16)
    for t in lanes:
        d = inputs(np.random.default_rng(100 * t + dk), t, h, hv, dk, dv)
        want = run_chain(cp, K, d, h, hv, dk, dv, t, commit)
        for warps in (1, 4, 8, 32):  # 4 / 1 / 1 blocks per 128-column head, and many per head at 1 warp
            got = run_fused(cp, K, d, h, hv, dk, dv, t, commit, warps)
            assert_same(got, want, t, hv, dv)
            assert not got["tickets"].get().any(), "tickets must be left zero for the next launch"
        if not commit:
            np.testing.assert_array_equal(got["state"].get(), d["state"])
            np.testing.assert_array_equal(got["window"].get(), d["window"])


def test_fused_matches_the_spec(cp, K):
    h, hv, dk, dv = SHAPES["tiny-model"]
    t, kw = 5, 4
    d = inputs(np.random.default_rng(7), t, h, hv, dk, dv, kw)
    got = run_fused(cp, K, d, h, hv, dk, dv, t, True, 8)
    c, kd = d["c"], h * dk
    y, new_window = ops.causal_conv1d(d["raw"][:, :c].astype(np.float64), d["convw"].astype(np.float64),
                                      d["window"].astype(np.float64))
    y = ops.silu(y)
    q = ops.l2norm(y[:, :kd].reshape(t, h, dk)) * dk ** -0.5
    k = ops.l2norm(y[:, kd : 2 * kd].reshape(t, h, dk))
    v = y[:, 2 * kd :].reshape(t, hv, dv)
    ab = d["ab"].astype(np.float64)
    g = d["neg_a"] * ops.softplus(ab[:, hv : 2 * hv] + d["dt"])
    beta = ops.sigmoid(ab[:, :hv])
    o, s = ops.gdn_recurrent(q, k, v, g, beta, d["state"].transpose(0, 2, 1).astype(np.float64))
    z = d["raw"][:, c : c + hv * dv].reshape(t, hv, dv)
    ref = ops.rms_norm_gated(o, z, d["norm_w"], 1e-6).reshape(t, -1)
    rel = lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b))  # noqa: E731
    assert rel(got["y"].get()[:, : hv * dv], ref) < 2e-5
    assert rel(got["state"].get(), s.transpose(0, 2, 1)) < 2e-5
    np.testing.assert_array_equal(got["window"].get(), new_window.astype(np.float32))


def test_fused_steps_chain_and_share_tickets(cp, K):
    """Several decode steps in a row (state and window carried, one ticket buffer reused by every
    launch, as the model's layers do) == the chain's steps."""
    h, hv, dk, dv = SHAPES["27b"]
    rng = np.random.default_rng(3)
    d = inputs(rng, 1, h, hv, dk, dv)
    a, b = dict(d), dict(d)
    tickets = cp.zeros(h + hv, cp.int32)
    for step in range(4):
        t = (1, 3, 16, 2)[step]
        fresh = inputs(np.random.default_rng(50 + step), t, h, hv, dk, dv)
        for x in (a, b):
            for key in ("raw", "ab"):
                x[key] = fresh[key]
        want = run_chain(cp, K, a, h, hv, dk, dv, t, True)
        got = run_fused(cp, K, b, h, hv, dk, dv, t, True, 8, tickets=tickets)
        assert_same(got, want, t, hv, dv)
        a["state"], a["window"] = want["state"].get(), want["window"].get()
        b["state"], b["window"] = got["state"].get(), got["window"].get()
    assert not tickets.get().any()


@pytest.mark.parametrize("shape", ["27b", "tiny-model"])
@pytest.mark.parametrize("commit", [False, True])
def test_fused_writes_the_out_plans_a8_activations(cp, K, shape, commit):
    """With a8 (an a8 out plan whose K is the heads: gated_rmsnorm_fuses), the fused step writes the bytes
    gated_rmsnorm(a8=) writes from the chain's o -- codes and chunk scales -- beside the same fp32 rows, so
    the out projection runs prequantized with the unfused GEMV bits (one quant_act8 launch fewer)."""
    from q27py.gpu import layout as L

    h, hv, dk, dv = SHAPES[shape]
    k = hv * dv
    rng = np.random.default_rng(5)
    m = K.upload_packed(L.pack_matrix(rng.standard_normal((96, k)).astype(np.float32) * 0.05, L.FMT_Q4))
    ws = K.Workspace()
    for t in (1, 2, 7, 16):
        d = inputs(np.random.default_rng(300 + t), t, h, hv, dk, dv)
        want = run_chain(cp, K, d, h, hv, dk, dv, t, commit)
        ya = cp.full((t, 96), np.nan, cp.float32)
        pa = K.GemvPlan([m], [(ya, 96)], ws, impl="a8")
        assert K.gated_rmsnorm_fuses(pa, t, hv, dv)
        xa = cp.zeros((t, k), cp.float32)
        K.gated_rmsnorm(want["o"], k, cp.asarray(d["raw"])[:, d["c"]:], d["ldr"], cp.asarray(d["norm_w"]), 1e-6, t,
                        hv, dv, xa, k, a8=pa)
        pa.run(xa, k, t, prequantized=True)
        for warps in (1, 4, 8):
            yb = cp.full((t, 96), np.nan, cp.float32)
            pb = K.GemvPlan([m], [(yb, 96)], ws, impl="a8")
            pb.xq.fill(0xAB)
            pb.xs.fill(np.nan)
            got = run_fused(cp, K, d, h, hv, dk, dv, t, commit, warps, a8=pb)
            assert_same(got, want, t, hv, dv)
            np.testing.assert_array_equal(pb.xq.get()[:t, :k], pa.xq.get()[:t, :k], err_msg=f"codes t={t} w={warps}")
            sa, sb = (p.xs.get().reshape(-1, k // 64, 16)[0, :, :t] for p in (pa, pb))  # lanes 0-15's half
            np.testing.assert_array_equal(sb, sa, err_msg=f"scales t={t} w={warps}")
            assert not np.isnan(sb).any()
            pb.run(got["y"], got["y"].shape[1], t, prequantized=True)
            np.testing.assert_array_equal(yb.get(), ya.get())


# ---------------------------------------------------------------- the model with the switch on / off
@pytest.fixture(autouse=True)
def gemv_gates_chain(monkeypatch):
    """The chain the fused step is bitwise: the in plan's bf16 GEMV writes the decay / beta gates and a decode step
    commits the conv window in its own launch. Since 2026-12-07 the defaults (constants GDN_GATES_IN_CONV,
    CONV_COMMIT_FOLD) move both into the chain's conv, whose gates have their own bits; a fused model keeps the
    GEMV's gates whatever the switch (FastModel.gates_in_conv), so its launch counts are compared against this chain."""
    from q27py.gpu import constants as C

    monkeypatch.setattr(C, "GDN_GATES_IN_CONV", 0)
    monkeypatch.setattr(C, "CONV_COMMIT_FOLD", 0)


def build(gdn_fused: bool, graphs: bool = False, tier: str = "bf16"):
    """The bundled model; tier "q4s": a8 GEMV plans, so a GDN layer's out plan reads int8 activations."""
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint

    m = FastModel(from_checkpoint(Checkpoint.open(DEFAULT_MODEL_DIR), tier, progress=False), max_context=512,
                  kv_dtype="f32", chunk=16, gdn_fused=gdn_fused)
    if graphs:
        m.enable_graphs()
    return m


@pytest.mark.parametrize("tier", ["bf16", "q4s"])
@pytest.mark.parametrize("graphs", [False, True])
def test_model_decode_and_verify_fused_equals_chain(graphs, tier):
    chain, fused = build(False, graphs, tier), build(True, graphs, tier)
    assert fused.gdn_fused and not chain.gdn_fused
    ids = [int(x) for x in np.random.default_rng(0).integers(0, 16000, 37)]  # 16-lane prefill chunks commit fused
    a, b = chain.new_state(), fused.new_state()
    np.testing.assert_array_equal(chain.forward(a, ids, logits_rows="last").logits,
                                  fused.forward(b, ids, logits_rows="last").logits)
    for step in range(5):  # graphs: step 0 eager, 1 captures, then replays
        np.testing.assert_array_equal(chain.forward(a, [40 + step]).logits, fused.forward(b, [40 + step]).logits)
        drafts = [50 + step, 51, 52, 53, 54, 55, 56, 57, 58][: 2 + 2 * step]
        va, vb = chain.forward(a, drafts, verify=True), fused.forward(b, drafts, verify=True)
        np.testing.assert_array_equal(va.logits, vb.logits)
        n = 1 + step % len(drafts)
        chain.commit(a, va.trace, n)
        fused.commit(b, vb.trace, n)
        np.testing.assert_array_equal(a.gdn.get(), b.gdn.get())
        np.testing.assert_array_equal(a.window.get(), b.window.get())
    assert not fused.gdn_tickets.get().any()
    if graphs:
        assert fused.graphs.replays > 0


def test_fused_removes_launches_per_gdn_layer(monkeypatch):
    """Kernel count of one decode step and one verify forward: the fused step replaces conv +
    commit + step + norm (4 launches) when committing and conv + step + norm (3) in a verify. The chain's folds
    (constants NORM_FOLD, GATED_FOLD, QUANT_FOLD) pinned off: GATED_FOLD takes the chain's output norm into gdn_out."""
    from q27py.gpu.runtime import Runtime

    unfold(monkeypatch)
    rt = Runtime.get()
    counts = {}
    for fused in (False, True):
        m = build(fused)
        st = m.new_state()
        m.forward(st, [1, 2, 3], logits_rows="last")
        with rt.count_launches() as dec:
            m.forward(st, [4])
        with rt.count_launches() as ver:
            m.forward(st, [5, 6, 7], verify=True)
        counts[fused] = (sum(dec.values()), sum(ver.values()), dec)
    ng = len(m.cfg.linear_layers)
    assert counts[False][0] - counts[True][0] == 3 * ng
    assert counts[False][1] - counts[True][1] == 2 * ng
    assert counts[True][2][("gdn_decode", "gdn_decode_k2")] == ng  # tiny models: dk 64


@pytest.mark.parametrize("fold", [0, 7])
def test_fused_quantizes_for_the_a8_out_plan(fold, monkeypatch):
    """With a8 plans (q4s) the fused step also writes the out plan's int8 activations, as the chain's
    gated_rmsnorm_a8 does: the same quant_act8 launches as the chain, so the fused step still saves its
    3 launches a GDN layer in a decode step (before 2026-12-07 it added a quant_act8 for each: 2). fold: the
    constants' A8_FOLD (0: every hand-over off, the quant_act8 launches back)."""
    from q27py.gpu import constants as C
    from q27py.gpu.runtime import Runtime

    monkeypatch.setattr(C, "A8_FOLD", fold)
    unfold(monkeypatch)  # the counts below are the launches' (QUANT_FOLD takes down's quant_act8 into it)
    rt = Runtime.get()
    counts = {}
    for fused in (False, True):
        m = build(fused, tier="q4s")
        assert K_fuses(m)
        st = m.new_state()
        m.forward(st, [1, 2, 3], logits_rows="last")
        with rt.count_launches() as dec:
            m.forward(st, [4])
        counts[fused] = dec
    ng, nl = len(m.cfg.linear_layers), m.cfg.num_hidden_layers
    if not fold:  # the fused step's quant_act8 before gdn_out (the chain's norm writes those bytes itself)
        assert sum(counts[False].values()) - sum(counts[True].values()) == 2 * ng
        assert counts[True][("gemv", "quant_act8")] == ng + (nl - ng) + nl + 1  # gdn_out, attn_o, down, lm_head
        return
    assert sum(counts[False].values()) - sum(counts[True].values()) == 3 * ng
    assert counts[False][("gemv", "quant_act8")] == counts[True][("gemv", "quant_act8")]
    # what is left to quantize in a decode step: the final norm's row before lm_head (the norms, the GDN steps,
    # the attention combines and gate_up's epilogue write the others)
    assert counts[True][("gemv", "quant_act8")] == 1


def unfold(monkeypatch) -> None:
    """The GEMVs' folds off (constants NORM_FOLD, GATED_FOLD, QUANT_FOLD): launch counts of the norms and quant_act8."""
    from q27py.gpu import constants as C

    for k in ("NORM_FOLD", "GATED_FOLD", "QUANT_FOLD"):
        monkeypatch.setattr(C, k, 0)


def K_fuses(m) -> bool:
    """Whether the model's first GDN layer's out plan takes its activations from the GDN step."""
    from q27py.gpu import kernels as K

    cfg = m.cfg
    li = cfg.linear_layers[0]
    return K.gated_rmsnorm_fuses(m.layer_plans[li]["out"], 1, cfg.linear_num_value_heads, cfg.linear_value_head_dim)
