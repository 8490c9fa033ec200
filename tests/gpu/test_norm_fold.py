"""constants NORM_FOLD (cuda/gemv_wg.cu wg_norm_fold, the *_nf entries; kernels.GemvPlan.folds_norm, FastModel._norm /
_take_norm): a decode / verify GEMV of at most NORM_FOLD_LANES lanes replays the RMSNorm of its input in its own CTAs
and the norm launch before it goes; GATED_FOLD (wg_gated_fold, the *_gf entries; GemvPlan.folds_gated,
FastModel._gdn_out) the same for the GDN output norm before gdn_out. Bitwise the norm launch + prequantized GEMV: logits, states and the normed rows
(self.x, which the GDN conv reads for its gates) equal with the switch off and on, over decode steps, verify rounds
and commits, eager and under graphs, at the 27B hidden (rmsnorm's 1,024-thread order) and below 2,048 (256 threads),
with the fold's lanes at 2 and at 8; and the fold is not vacuous: its launches replace the norm launches. QUANT_FOLD
(the *_nf entries with no norm weights; GemvPlan.folds_quant, FastModel._mlp): down quantizes the SwiGLU rows in its
own CTAs instead of a quant_act8 launch, bitwise the same.

Device command: python3 -m pytest -q tests/gpu/test_norm_fold.py
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.gpu.plan_rounds import decode_counts, normed_rows

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("nlanes", [1, 2, 5, 8])
@pytest.mark.parametrize("hidden", [None, 1024])
def test_plan_fold_equals_norm_then_gemv(hidden, nlanes, wg, monkeypatch):
    """One plan, no model around it (the first thing to read if the model test fails): the MLP's gate_up of the 27B's
    heads, its input rows random; rmsnorm(a8=plan) + run(prequantized) against run(norm=...): the normed rows row group 0
    writes (the sum of squares' order), then the SwiGLU outputs (the codes and scales the ring copied)."""
    import cupy as cp

    from q27py.gpu import constants as C
    from q27py.gpu import kernels as K
    from tests.gpu.plan_rounds import heads27b

    monkeypatch.setattr(C, "NORM_FOLD", 1)
    monkeypatch.setattr(C, "NORM_FOLD_LANES", 8)
    m = heads27b(False, hidden=hidden, seed=13)
    up, H, w = m.layer_plans[0]["up"], m.cfg.hidden_size, m.w.layers[0].post_ln
    rng = np.random.default_rng(100 + nlanes)
    m.h[:nlanes, :H] = cp.asarray(rng.standard_normal((nlanes, H)).astype(np.float32) * 3)
    nin = K.NormIn(m.h, m.hp, w, m.cfg.rms_norm_eps, H, m.x, m.hp)
    if nlanes > 2 and not up.folds_norm(nlanes, False, nin):
        pytest.skip("this launch's fold buffer at this width would cost the entry a resident CTA an SM")
    assert up.folds_norm(nlanes, False, nin)
    K.rmsnorm(m.h, m.hp, w, m.cfg.rms_norm_eps, H, m.x, m.hp, nlanes, a8=up)
    up.run(m.x, m.hp, nlanes, prequantized=True)
    nout = m.cfg.intermediate_size  # the SwiGLU outputs a lane
    want_x, want_act = m.x[:nlanes, :H].get(), m.act[:nlanes, :nout].get()
    m.x.fill(np.nan)
    m.act.fill(np.nan)
    up.run(m.x, m.hp, nlanes, norm=nin)
    np.testing.assert_array_equal(m.x[:nlanes, :H].get(), want_x, err_msg="the normed rows (row group 0)")
    np.testing.assert_array_equal(m.act[:nlanes, :nout].get(), want_act, err_msg="the GEMV's outputs")


@pytest.mark.parametrize("nlanes", [1, 2, 8])
def test_plan_gated_fold_equals_norm_then_gemv(nlanes, wg, monkeypatch):
    """gdn_out of the 27B's heads alone: gated_rmsnorm(a8=plan) + run(prequantized) against run(gated=...), the
    GDN step's rows and the gate rows random."""
    import cupy as cp

    from q27py.gpu import constants as C
    from q27py.gpu import kernels as K
    from tests.gpu.plan_rounds import heads27b

    monkeypatch.setattr(C, "GATED_FOLD", 1)
    monkeypatch.setattr(C, "NORM_FOLD_LANES", 8)
    m = heads27b(False, hidden=None, seed=13)
    cfg, g = m.cfg, m.w.layers[0].gdn
    hv, dv, c = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.gdn_conv_dim
    out, raw = m.layer_plans[0]["out"], m.proj[0]
    rng = np.random.default_rng(200 + nlanes)
    m.o_gdn[:nlanes, : hv * dv] = cp.asarray(rng.standard_normal((nlanes, hv * dv)).astype(np.float32))
    raw[:nlanes, c : c + hv * dv] = cp.asarray(rng.standard_normal((nlanes, hv * dv)).astype(np.float32) * 2)
    gin = K.GatedIn(m.o_gdn, hv * dv, raw[:, c:], m.ld_proj, g.norm_w, cfg.rms_norm_eps, dv)
    if nlanes > 2 and not out.folds_gated(nlanes, gin):
        pytest.skip("this launch's fold buffer at this width would cost the entry a resident CTA an SM")
    assert out.folds_gated(nlanes, gin)
    K.gated_rmsnorm(m.o_gdn, hv * dv, raw[:, c:], m.ld_proj, g.norm_w, cfg.rms_norm_eps, nlanes, hv, dv, m.xo, m.ld_xo,
                    a8=out)
    y = out.outputs[0][0]  # the residual rows h, which gdn_out adds into: each run from the same h
    h0 = y[:nlanes].copy()
    out.run(m.xo, m.ld_xo, nlanes, prequantized=True)
    want = y[:nlanes, : cfg.hidden_size].get()
    y[:nlanes] = h0
    out.run(m.xo, m.ld_xo, nlanes, gated=gin)
    np.testing.assert_array_equal(y[:nlanes, : cfg.hidden_size].get(), want)


@pytest.mark.parametrize("lanes", [2, 8])
@pytest.mark.parametrize("hidden", [None, 1024])
@pytest.mark.parametrize("graphs", [False, True])
def test_fold_keeps_the_bits(graphs, hidden, lanes, wg, monkeypatch):
    from q27py.gpu import constants as C
    from tests.gpu.plan_rounds import heads27b, rounds

    monkeypatch.setattr(C, "NORM_FOLD_LANES", lanes)
    ids = [int(v) for v in np.random.default_rng(6).integers(0, 4096, 45)]
    got, counts, rows = {}, {}, {}
    for on in (0, 1):
        monkeypatch.setattr(C, "NORM_FOLD", on)
        monkeypatch.setattr(C, "GATED_FOLD", on)
        m = heads27b(graphs, hidden=hidden, seed=13)
        got[on] = rounds(m, ids, widths=(1, 2, 3, 8, 12))
        counts[on] = decode_counts(m)
        rows[on] = normed_rows(m, ids[:30])
    for i, (a, b) in enumerate(zip(got[0], got[1])):
        np.testing.assert_array_equal(a, b, err_msg=f"output {i}")
    np.testing.assert_array_equal(rows[0], rows[1])
    assert_folds(counts, 8, gated=3)


def assert_folds(counts, n, gated=0):
    """Every layer's input and post-attention norms fold (4 layers: 8; the attention layer's in plan runs q's *_nf
    launch first, which also writes the int8 activations its q8 kv launch reads), and with GATED_FOLD the 3 GDN
    layers' output norms: that many norm launches fewer a decode step and a 2-lane verify, that many *_nf / *_gf
    launches."""
    for k in (0, 1):
        off, on = counts[0][k], counts[1][k]
        for suffix, kernel, want in (("_nf", "rmsnorm_rows_a8", n), ("_gf", "gated_rmsnorm_a8", gated)):
            folded = sum(v for (mod, name), v in on.items() if mod == "gemv_wg" and name.endswith(suffix))
            assert folded == want, on
            assert off.get(("norm", kernel), 0) - on.get(("norm", kernel), 0) == want
        assert sum(off.values()) - sum(on.values()) == n + gated


def test_fold_rules_and_the_gemv_gates(wg, monkeypatch):
    """Which plans fold: past NORM_FOLD_LANES or with the switch off none; with the GDN gates back on the in plan
    (GDN_GATES_IN_CONV 0) the qkvz launch still folds and runs first, the gates' bf16 GEMV after it on the normed
    rows its row group 0 wrote -- bitwise, as the model rounds show."""
    from q27py.gpu import constants as C
    from q27py.gpu import kernels as K
    from tests.gpu.plan_rounds import heads27b, rounds

    monkeypatch.setattr(C, "NORM_FOLD", 1)
    monkeypatch.setattr(C, "NORM_FOLD_LANES", 2)
    m = heads27b(False, hidden=None, seed=13)
    up, gin, ain = m.layer_plans[0]["up"], m.layer_plans[0]["in"], m.layer_plans[3]["in"]
    nin = K.NormIn(m.h, m.hp, m.w.layers[0].post_ln, 1e-6, m.cfg.hidden_size, m.x, m.hp)
    assert up.folds_norm(1, False, nin) and up.folds_norm(2, False, nin) and not up.folds_norm(3, False, nin)
    assert gin.folds_norm(1, True, nin) and gin.folds_norm(1, False, nin)
    assert ain.folds_norm(1, False, nin) and len(ain.launches) == 2  # q on gemv_wg, kv on gemv8 (q8)
    monkeypatch.setattr(C, "NORM_FOLD", 0)
    assert not up.folds_norm(1, False, nin)
    monkeypatch.setattr(C, "GDN_GATES_IN_CONV", 0)
    ids = [int(v) for v in np.random.default_rng(8).integers(0, 4096, 33)]
    got, counts = {}, {}
    for on in (0, 1):
        monkeypatch.setattr(C, "NORM_FOLD", on)
        m2 = heads27b(True, hidden=None, seed=13)
        assert not m2.gates_in_conv
        got[on] = rounds(m2, ids, widths=(1, 2, 4))
        counts[on] = decode_counts(m2)
    for i, (a, b) in enumerate(zip(got[0], got[1])):
        np.testing.assert_array_equal(a, b, err_msg=f"output {i}")
    assert_folds(counts, 8)


def test_tiny_model_greedy_with_the_fold(monkeypatch):
    """The bundled model (q4s; hidden below 2,048: rmsnorm's 256-thread order) through the engine: the same greedy ids
    with the fold as without."""
    from q27py import DEFAULT_MODEL_DIR
    from q27py.gpu import constants as C
    from q27py.gpu import kernels as K
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint

    if not K.gemv_wgmma_supported():
        pytest.skip("no sm_90a gemv_wg build on this card")
    w = from_checkpoint(Checkpoint.open(DEFAULT_MODEL_DIR), "q4s", progress=False)
    ids = {}
    for on in (0, 1):
        monkeypatch.setattr(C, "NORM_FOLD", on)
        m = FastModel(w, max_context=256, kv_dtype="bf16")
        m.enable_graphs()
        st = m.new_state()
        out = m.forward(st, [9707, 11, 1879, 0, 872, 198], logits_rows="last")
        seq, lg = [], [out.logits.copy()]
        for _ in range(24):
            t = int(np.argmax(lg[-1].reshape(-1)))
            seq.append(t)
            lg.append(m.forward(st, [t]).logits.copy())
        ids[on] = (seq, lg)
    assert ids[0][0] == ids[1][0]
    for a, b in zip(ids[0][1], ids[1][1]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("nlanes", [1, 2, 5, 8])
@pytest.mark.parametrize("inter", [1024, 17408])
def test_plan_quant_fold_equals_quant_then_gemv(inter, nlanes, wg, monkeypatch):
    """down alone (the 27B's hidden; its intermediate small, or the 27B's own 17,408: 272 chunks over the K splits):
    run() with its quant_act8 launch against run(norm=rows without weights), the SwiGLU rows random."""
    import cupy as cp

    from q27py.gpu import constants as C
    from q27py.gpu import kernels as K
    from tests.gpu.plan_rounds import heads27b

    monkeypatch.setattr(C, "QUANT_FOLD", 1)
    m = heads27b(False, hidden=None, seed=13, intermediate=inter)
    down = m.layer_plans[0]["down"]
    rng = np.random.default_rng(300 + nlanes)
    m.act[:nlanes, :inter] = cp.asarray(rng.standard_normal((nlanes, inter)).astype(np.float32) * 2)
    rows = K.NormIn(m.act, m.ld_act, None, 0.0, down.kpad)
    if not down.folds_quant(nlanes, rows):
        assert nlanes > 2, "down folds at 1-2 lanes"
        pytest.skip("this launch's fold buffer at this width would cost the entry a resident CTA an SM")
    y = down.outputs[0][0]  # the residual rows down adds into: each run from the same h
    h0 = y[:nlanes].copy()
    down.run(m.act, m.ld_act, nlanes)
    want = y[:nlanes, : m.cfg.hidden_size].get()
    y[:nlanes] = h0
    down.xq.fill(0x55)  # stale codes: the fold must not read the plan's global activations
    down.run(m.act, m.ld_act, nlanes, norm=rows)
    np.testing.assert_array_equal(y[:nlanes, : m.cfg.hidden_size].get(), want)


@pytest.mark.parametrize("graphs", [False, True])
def test_quant_fold_keeps_the_bits(graphs, wg, monkeypatch):
    """Model rounds with QUANT_FOLD off and on (decode, verify widths up to 12, commits): the same logits and states;
    each layer's down folds (4 quant_act8 launches fewer a decode step and a 2-lane verify, 4 *_nf launches more)."""
    from q27py.gpu import constants as C
    from tests.gpu.plan_rounds import heads27b, rounds

    ids = [int(v) for v in np.random.default_rng(9).integers(0, 4096, 41)]
    got, counts = {}, {}
    for on in (0, 1):
        monkeypatch.setattr(C, "QUANT_FOLD", on)
        m = heads27b(graphs, hidden=None, seed=13)
        got[on] = rounds(m, ids, widths=(1, 2, 3, 8, 12))
        counts[on] = decode_counts(m)
    for i, (a, b) in enumerate(zip(got[0], got[1])):
        np.testing.assert_array_equal(a, b, err_msg=f"output {i}")
    for k in (0, 1):
        off, on = counts[0][k], counts[1][k]
        folded = sum(v for (mod, name), v in on.items() if mod == "gemv_wg" and name.endswith("_nf"))
        assert folded == 4, on
        assert off.get(("gemv", "quant_act8"), 0) - on.get(("gemv", "quant_act8"), 0) == 4
        assert sum(off.values()) - sum(on.values()) == 4
