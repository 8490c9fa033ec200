"""EngineConfig.prefill_gdn_state_tf32 (env Q27_PREFILL_GDN_STATE_TF32, off): the chunked2 GDN prefill's W / U
pre-pass and state recurrence (cuda/gdn_chunk2.cu prep_body, state8_body) with one TF32 product per mma instead of
three (3xTF32): gdn2_prep1_* / gdn2_state1_*_w8 (mma_p<1>), the "tf32 state" tolerance class (docs/QUANT.md).

Unlike "tf32 out" (test_gdn_out_tf32.py) this class moves the state: every chunk's start state, the final state, and
so the snapshots and the decode steps after such a prefill. What is held, and to what:
- O and the final state against float64: relative L2 under CLASS (the spec's study, gdn_chunked_wy(tf32=("prep",
  "state")), gives 2-5e-4 on both at every decay and length up to 4K tokens, with no growth in the chunk count),
  where the fp32-grade pipeline sits at ~2e-7, and measurably off it;
- the chunk alignment contract under the switch: a prefill split into pieces at multiples of 64 gives the bits of
  one run (what prefix snapshots and restores rely on);
- the output pass is untouched by this switch (GDN2_OUT_TF32 stays its own: with both on, the launches are
  gdn2_prep1 / gdn2_state1 / gdn2_out1);
- end to end on the bundled tiny model (q4s, 300-token prefills): logits within 5e-3 relative L2 of the switch off,
  greedy decode after it equal but at near ties; 2,048 held-out tokens inside the a8 tier's accepted gate;
- switch off: no gdn2_prep1 / gdn2_state1 launch, the same bits before and after a run with it on.

Without a GPU the CPU checks run: config / env / module default, the entries chosen and refused, the spec's class.
`python3 tests/gpu/test_gdn_state_tf32.py` prints the quality numbers (KL, top-1, NLL) on the device.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from q27py.model import ops
from q27py.model.gdn_chunked import gdn_chunked_wy

sys.path.insert(0, str(Path(__file__).parent))
from test_gate_up_bf16_gpu import (  # noqa: E402,F401  (tiny: a fixture)
    assert_in_a8_gate, check_switch_config, device_quality, module_switch, quality, switch_end_to_end,
    switch_launches_and_bits, tiny)
from test_gdn_chunk import SHAPES2, klast, make, rel, run_chunked2  # noqa: E402
from test_gdn_out_tf32 import cp, stub_launcher  # noqa: E402,F401  (cp: a fixture, CuPy with gdn_chunk2 built)

gpu = pytest.mark.gpu
CLASS = 2e-3  # "tf32 state": O's and the final state's relative L2 against float64 (module docstring)


def _switch(K, on: bool):
    return module_switch(K, "GDN2_STATE_TF32", on)


@pytest.fixture
def K(cp, monkeypatch):
    from q27py.gpu import kernels

    if not kernels.gdn2_stages(64, 64):
        pytest.skip("no chunked2 pipeline on this card")
    monkeypatch.setattr(kernels, "GDN2_STATE_TF32", False)
    monkeypatch.setattr(kernels, "GDN2_OUT_TF32", False)
    return kernels


def _f64(d, heads, h, hv):
    sub = {x: d[x][:, [hh // (hv // h) for hh in heads]] if x in ("q", "k") else d[x][:, heads]
           for x in ("q", "k", "v", "g", "beta")}
    return ops.gdn_recurrent(*(sub[x].astype(np.float64) for x in ("q", "k", "v", "g", "beta")),
                             d["s0"][heads].astype(np.float64))


# ---------------------------------------------------------------- GPU: the kernels
@gpu
@pytest.mark.parametrize("shape", sorted(SHAPES2))
@pytest.mark.parametrize("t,pos0,decay", [(65, 0, "normal"), (100, 37, "strong"), (1000, 5, "normal"),
                                          (4096, 4095, "normal"), (4096, 0, "strong")])
def test_switched_state_in_class(cp, K, shape, t, pos0, decay):
    s = SHAPES2[shape]
    h, hv, dk, dv = s["h"], s["hv"], s["dk"], s["dv"]
    d = make(np.random.default_rng(t + pos0 + 29), t, h, hv, dk, dv, decay)
    heads = list(range(hv)) if t <= 1000 or shape == "small" else [0, 1, hv - 1]  # float64 cost at 4096 x 48
    o64, s64 = _f64(d, heads, h, hv)
    cols = np.concatenate([np.arange(hh * dv, (hh + 1) * dv) for hh in heads])
    with _switch(K, False):
        o3, s3 = run_chunked2(cp, K, d, h, hv, dk, dv, t, pos0)
    with _switch(K, True):
        o1, s1 = run_chunked2(cp, K, d, h, hv, dk, dv, t, pos0)
    assert not np.isnan(o1).any() and not np.isnan(s1).any()
    want_s = klast(s64)
    e1, e3 = rel(o1[:, cols], o64.reshape(t, -1)), rel(o3[:, cols], o64.reshape(t, -1))
    f1, f3 = rel(s1[heads], want_s), rel(s3[heads], want_s)
    print(f"{shape} t={t} pos0={pos0} {decay}: O rel L2 {e1:.2e} (off {e3:.2e}), state {f1:.2e} (off {f3:.2e})")
    assert e1 < CLASS and f1 < CLASS and e3 < 2e-5 and f3 < 2e-5
    assert f1 > f3, "the switch changed nothing: gdn2_state1 did not run"


@gpu
@pytest.mark.parametrize("shape", sorted(SHAPES2))
@pytest.mark.parametrize("pos0,cuts", [(0, (64, 960)), (37, (27, 91, 603))])
def test_pieces_at_chunk_multiples_give_one_runs_bits(cp, K, shape, pos0, cuts):
    """A prefill split where pos0 + cut is a multiple of 64 (the prefix snapshots' boundaries) gives the bits of one run
    under the switch: the final state and every row of O."""
    s = SHAPES2[shape]
    h, hv, dk, dv = s["h"], s["hv"], s["dk"], s["dv"]
    t = 1100
    assert all((pos0 + c) % 64 == 0 for c in cuts)
    d = make(np.random.default_rng(pos0 + 7), t, h, hv, dk, dv)
    with _switch(K, True):
        o_all, s_all = run_chunked2(cp, K, d, h, hv, dk, dv, t, pos0)
        state = cp.asarray(klast(d["s0"]))
        out = cp.full((t, hv * dv), np.nan, dtype=cp.float32)
        qkvn, gb = cp.asarray(d["qkvn"]), cp.asarray(d["gb"])
        bounds = (0, *cuts, t)
        for a, b in zip(bounds, bounds[1:]):
            K.gdn_prefill_chunked2(state, qkvn[a:b], gb[a:b], out[a:b], hv * dv, h, hv, dk, dv, b - a, pos0=pos0 + a)
    np.testing.assert_array_equal(state.get().view(np.uint32), s_all.view(np.uint32))
    np.testing.assert_array_equal(out.get().view(np.uint32), o_all.view(np.uint32))


@gpu
@pytest.mark.parametrize("shape", sorted(SHAPES2))
@pytest.mark.parametrize("t,pos0", [(65, 0), (1000, 5)])
def test_k_rounded_once_is_bitwise_per_use(cp, K, shape, t, pos0):
    """gdn2_state1_*_s2k_w8 (K rounded to tf32 once a chunk, stored as row pairs) against gdn2_state1_*_s2_w8 (K
    rounded at each use): the same tf32 values into the same products in the same order, so the same bits: out, the
    final state."""
    s = SHAPES2[shape]
    h, hv, dk, dv = s["h"], s["hv"], s["dk"], s["dv"]
    if not K.gdn2_fits(dk, dv, 2, "k"):
        pytest.skip("two stages with K's split buffer do not fit this card")
    d = make(np.random.default_rng(t + 3), t, h, hv, dk, dv)
    with _switch(K, True):
        o_k, s_k = run_chunked2(cp, K, d, h, hv, dk, dv, t, pos0, stages=(2, "k", 8))
        o_p, s_p = run_chunked2(cp, K, d, h, hv, dk, dv, t, pos0, stages=(2, False, 8))
    np.testing.assert_array_equal(s_k.view(np.uint32), s_p.view(np.uint32))
    np.testing.assert_array_equal(o_k.view(np.uint32), o_p.view(np.uint32))


@gpu
def test_output_switch_stays_its_own(cp, K):
    """GDN2_OUT_TF32 on top of this switch: the state is this switch's alone (bitwise), O moves once more."""
    s = SHAPES2["27b"]
    h, hv, dk, dv = s["h"], s["hv"], s["dk"], s["dv"]
    d = make(np.random.default_rng(5), 300, h, hv, dk, dv)
    with _switch(K, True):
        o1, s1 = run_chunked2(cp, K, d, h, hv, dk, dv, 300, 11)
        with module_switch(K, "GDN2_OUT_TF32", True):
            o2, s2 = run_chunked2(cp, K, d, h, hv, dk, dv, 300, 11)
    np.testing.assert_array_equal(s1.view(np.uint32), s2.view(np.uint32))
    assert not np.array_equal(o1, o2)


# ---------------------------------------------------------------- GPU: the switch in the forward
@gpu
def test_prefill_end_to_end(cp, K, tiny):
    """Three 300-token prefills of held-out text (chunked2 route) with the switch off and on: logits within 5e-3
    relative L2; the 33 greedy tokens after each (decoding from the switched state) equal, or diverging only at a
    near tie (test_gate_up_bf16_gpu's rule)."""
    switch_end_to_end(K, tiny, _switch)


@gpu
def test_quality_inside_the_a8_gate(cp, K, tiny):
    """2,048 held-out tokens on the trained tiny model: inside the a8 tier's accepted gate (mean KL 2.5e-4, p99.9
    1.8e-3, top-1 0.990, NLL within 5e-4: docs/QUANT.md)."""
    r = quality(K, *tiny, switch=_switch)
    print(r)
    assert_in_a8_gate(r)


@gpu
def test_switch_off_launches_todays_passes_and_keeps_their_bits(cp, K, tiny, monkeypatch):
    def ours(ks):
        return [k for k in ks if k.startswith(("gdn2_prep1", "gdn2_state1"))]

    k1, k2, k3 = switch_launches_and_bits(K, tiny, _switch, monkeypatch)
    for ks in (k1, k3):
        assert not ours(ks) and any(k.startswith("gdn2_state_") for k in ks)
    assert {k.split("_d")[0] for k in ours(k2)} == {"gdn2_prep1", "gdn2_state1"}, "the switched passes did not run"


# ---------------------------------------------------------------- CPU checks (no GPU)
def test_config_field_env_and_module_default(monkeypatch):
    from q27py.gpu import kernels as K

    check_switch_config(monkeypatch, "prefill_gdn_state_tf32", "Q27_PREFILL_GDN_STATE_TF32", 
                        K._gdn_state_tf32_default, "tf32")


@pytest.mark.parametrize("fits2", [True, False])
def test_switch_picks_the_one_product_entries(monkeypatch, fits2):
    """The launcher's names and block sizes under the switch: gdn2_prep1_d* and the 8-warp, no-presplit
    gdn2_state1_d*_s<stages>_w8 (two stages where they fit, else one) on; today's names off; the output pass follows
    GDN2_OUT_TF32 alone."""
    from q27py.gpu import kernels as K

    rt, scratch = stub_launcher(monkeypatch, K, fits2)
    names = {}
    for on, out in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(K, "GDN2_STATE_TF32", on)
        monkeypatch.setattr(K, "GDN2_OUT_TF32", out)
        rt.names.clear()
        K.gdn_prefill_chunked2(None, None, None, None, 0, 16, 48, 128, 128, 100, scratch=scratch)
        names[on, out] = list(rt.names)
    st = 2 if fits2 else 1
    assert names[False, False] == [("gdn2_prep_d128", 256), ("gdn2_state_d128_s2k_w8", 256), ("gdn2_out_d128", 256)]
    assert names[True, False] == [("gdn2_prep1_d128", 256), (f"gdn2_state1_d128_s{st}_w8", 256),
                                  ("gdn2_out_d128", 256)]
    assert names[True, True][2] == ("gdn2_out1_d128", 256)
    rt.names.clear()
    monkeypatch.setattr(K, "GDN2_STATE_TF32", True)
    K.gdn_prefill_chunked2(None, None, None, None, 0, 16, 48, 128, 128, 100, scratch=scratch, stages=2, presplit="k")
    assert rt.names[1] == ("gdn2_state1_d128_s2k_w8", 256)  # K rounded once a chunk (kernel_ab --tf32-ab's state-k)


@pytest.mark.parametrize("ask", [dict(presplit=True), dict(warps=4), dict(stages=2, warps=4),
                                 dict(stages=1, presplit="k")])
def test_switch_refuses_variants_it_has_no_entry_for(monkeypatch, ask):
    from q27py.gpu import kernels as K

    rt, scratch = stub_launcher(monkeypatch, K)
    monkeypatch.setattr(K, "GDN2_STATE_TF32", True)
    with pytest.raises(ValueError, match="tf32 state pass"):
        K.gdn_prefill_chunked2(None, None, None, None, 0, 16, 48, 128, 128, 100, scratch=scratch, **ask)
    assert rt.names == []


@pytest.mark.parametrize("t,pos0,decay", [(300, 5, "normal"), (700, 0, "strong")])
def test_spec_class(t, pos0, decay):
    """The spec of the class (gdn_chunked_wy(tf32=("prep", "state")), float32): O and the final state within CLASS of
    float64 and well off the fp32-grade run; the output pass's products untouched (the out class's own switch)."""
    h, hv, dk, dv = 1, 2, 64, 64
    d = make(np.random.default_rng(t + pos0), t, h, hv, dk, dv, decay)
    args = [d[x].astype(np.float32) for x in ("q", "k", "v", "g", "beta", "s0")]
    o64, s64 = gdn_chunked_wy(*(a.astype(np.float64) for a in args), pos0=pos0)
    o3, s3 = gdn_chunked_wy(*args, pos0=pos0)
    o1, s1 = gdn_chunked_wy(*args, pos0=pos0, tf32=("prep", "state"))
    e3, e1 = rel(o3, o64), rel(o1, o64)
    f3, f1 = rel(s3, s64), rel(s1, s64)
    assert e3 < 2e-5 and f3 < 2e-5
    assert 3e-5 < e1 < CLASS and 3e-5 < f1 < CLASS, (e1, f1)


if __name__ == "__main__":  # the device numbers for docs/QUANT.md
    device_quality("gdn state tf32", _switch)
