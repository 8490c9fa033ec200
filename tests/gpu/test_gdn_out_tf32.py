"""EngineConfig.prefill_gdn_out_tf32 (env Q27_PREFILL_GDN_OUT_TF32, off): the chunked2 GDN prefill's output pass
(O = e^G Q S_c + (M o Q K^T) V_new, cuda/gdn_chunk2.cu out_body) with one TF32 product per mma instead of three
(3xTF32): gdn2_out1_* / gdn2_out1_gated_* (mma_p<1>), the "tf32 out" tolerance class (docs/QUANT.md).

What is held, and to what:
- the state pass is untouched: the final state is BITWISE the fp32-grade pipeline's (only O changes);
- O against float64: relative L2 under 1e-3 (the lane-level emulation gives ~4e-4 on every case below: each product
  of two tf32-rounded operands is off by ~2^-11 of it; a bf16 rounding of O, which the output projection's bf16
  input applies anyway, is ~1.1e-3), where the fp32-grade pass sits at ~2e-7;
- the gated form (the output norm inside the pass, GDN2_OUT_GATED) bitwise the switched pass followed by
  gated_rmsnorm_rows, as for the fp32-grade pass;
- end to end on the bundled tiny model (q4s, 300-token prefills): logits within 5e-3 relative L2 of the switch off
  (2.0-2.2e-3 measured), greedy decode after it equal but at near ties; 2,048 held-out tokens inside the a8 tier's
  accepted gate (KL mean 2.07e-5, top-1 0.9990 measured);
- switch off: no gdn2_out1_* launch, the same bits before and after a run with it on.

Without a GPU the CPU checks run: config / env / module default, the kernel names chosen, and the emulation's class.
`python3 tests/gpu/test_gdn_out_tf32.py` prints the quality numbers (KL, top-1, NLL) on the device.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from q27py.model import ops

sys.path.insert(0, str(Path(__file__).parent))
import gdn_chunk2_emu as emu2  # noqa: E402
from test_gate_up_bf16_gpu import (  # noqa: E402,F401  (tiny: a fixture)
    assert_in_a8_gate, check_switch_config, device_quality, module_switch, quality, switch_end_to_end,
    switch_launches_and_bits, tiny)
from test_gdn_chunk import SHAPES2, klast, make, rel, run_chunked2  # noqa: E402

gpu = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
CLASS = 1e-3  # "tf32 out": O's relative L2 against float64 (module docstring)


def _switch(K, on: bool):
    return module_switch(K, "GDN2_OUT_TF32", on)


@pytest.fixture(scope="module")
def cp():
    import cupy

    from q27py.gpu.runtime import Runtime

    Runtime.get().module("gdn_chunk2")
    return cupy


@pytest.fixture
def K(cp, monkeypatch):
    from q27py.gpu import kernels

    if not kernels.gdn2_stages(64, 64):
        pytest.skip("no chunked2 pipeline on this card")
    monkeypatch.setattr(kernels, "GDN2_OUT_TF32", False)
    monkeypatch.setattr(kernels, "GDN2_STATE_TF32", False)  # this file holds O's class over the fp32-grade state
    return kernels


# ---------------------------------------------------------------- GPU: the kernels
@gpu
@pytest.mark.parametrize("shape", sorted(SHAPES2))
@pytest.mark.parametrize("t,pos0", [(65, 0), (100, 37), (1000, 5), (4096, 4095)])
def test_switched_output_pass_in_class_and_state_bitwise(cp, K, shape, t, pos0):
    s = SHAPES2[shape]
    h, hv, dk, dv = s["h"], s["hv"], s["dk"], s["dv"]
    d = make(np.random.default_rng(t + pos0 + 11), t, h, hv, dk, dv)
    heads = list(range(hv)) if t <= 1000 or shape == "small" else [0, 1, hv - 1]  # float64 cost at 4096 x 48
    sub = {x: d[x][:, [hh // (hv // h) for hh in heads]] if x in ("q", "k") else d[x][:, heads]
           for x in ("q", "k", "v", "g", "beta")}
    o64, _ = ops.gdn_recurrent(*(sub[x].astype(np.float64) for x in ("q", "k", "v", "g", "beta")),
                               d["s0"][heads].astype(np.float64))
    cols = np.concatenate([np.arange(hh * dv, (hh + 1) * dv) for hh in heads])
    with _switch(K, False):
        o3, s3 = run_chunked2(cp, K, d, h, hv, dk, dv, t, pos0)
    with _switch(K, True):
        o1, s1 = run_chunked2(cp, K, d, h, hv, dk, dv, t, pos0)
    assert not np.isnan(o1).any()
    np.testing.assert_array_equal(s1.view(np.uint32), s3.view(np.uint32))  # the state pass is untouched
    e1, e3 = rel(o1[:, cols], o64.reshape(t, -1)), rel(o3[:, cols], o64.reshape(t, -1))
    print(f"{shape} t={t}: O rel L2 {e1:.2e} (switch off {e3:.2e})")
    assert e1 < CLASS and e3 < 2e-5
    assert e1 > e3, "the switch changed nothing: gdn2_out1 did not run"


@gpu
@pytest.mark.parametrize("t,pos0", [(65, 0), (1000, 5)])
@pytest.mark.parametrize("rows", ["f32", "bf16"])
def test_switched_gated_pass_is_bitwise_the_norm_kernel(cp, K, t, pos0, rows):
    """gdn2_out1_gated against gdn2_out1 then gated_rmsnorm_rows (the 27B shape): the same rows bit for bit."""
    dims = SHAPES2["27b"]
    h, hv, dk, dv = dims["h"], dims["hv"], dims["dk"], dims["dv"]
    rng = np.random.default_rng(t + pos0 + 3)
    d = make(rng, t, h, hv, dk, dv)
    ldz = hv * dv + 24
    z = cp.asarray((rng.standard_normal((t, ldz)) * 2).astype(np.float32))
    w = cp.asarray((rng.standard_normal(dv) * 0.5 + 1).astype(np.float32))
    eps = 1e-6
    with _switch(K, True):
        o, _ = run_chunked2(cp, K, d, h, hv, dk, dv, t, pos0)
        od = cp.asarray(o)
        y = cp.full((t, hv * dv), np.nan, dtype=cp.float32)
        yb = cp.zeros((t, hv * dv), dtype=cp.uint16)
        K.gated_rmsnorm_rows(od, hv * dv, z, ldz, w, eps, t, hv, dv, y if rows == "f32" else None, hv * dv,
                             yb if rows == "bf16" else None, hv * dv)
        state = cp.asarray(klast(d["s0"]))
        y2 = cp.full((t, hv * dv), np.nan, dtype=cp.float32)
        yb2 = cp.zeros((t, hv * dv), dtype=cp.uint16)
        g = K.GatedNormArgs(z, ldz, w, eps, y2 if rows == "f32" else None, hv * dv, yb2 if rows == "bf16" else None,
                            hv * dv)
        K.gdn_prefill_chunked2(state, cp.asarray(d["qkvn"]), cp.asarray(d["gb"]), None, 0, h, hv, dk, dv, t,
                               pos0=pos0, gated=g)
    if rows == "f32":
        np.testing.assert_array_equal(y2.get().view(np.uint32), y.get().view(np.uint32))
    else:
        np.testing.assert_array_equal(yb2.get(), yb.get())


# ---------------------------------------------------------------- GPU: the switch in the forward
@gpu
def test_prefill_end_to_end(cp, K, tiny):
    """Three 300-token prefills of held-out text (chunked2 route) with the switch off and on: logits within 5e-3
    relative L2 (measured 2.0-2.2e-3 on an H100, 2026-12-07: O moves by ~4e-4 relative in every GDN layer of the
    stack, then through the norms, bf16 roundings and the layers after it); the 33 greedy tokens after each equal, or
    diverging only at a near tie (test_gate_up_bf16_gpu's rule)."""
    switch_end_to_end(K, tiny, _switch)


@gpu
def test_quality_inside_the_a8_gate(cp, K, tiny):
    """2,048 held-out tokens on the trained tiny model: inside the a8 tier's accepted gate (mean KL 2.5e-4, p99.9
    1.8e-3, top-1 0.990, NLL within 5e-4: docs/QUANT.md)."""
    r = quality(K, *tiny, switch=_switch)
    print(r)
    assert_in_a8_gate(r)


@gpu
def test_switch_off_launches_todays_pass_and_keeps_its_bits(cp, K, tiny, monkeypatch):
    k1, k2, k3 = switch_launches_and_bits(K, tiny, _switch, monkeypatch)
    for ks in (k1, k3):
        assert not any(k.startswith("gdn2_out1") for k in ks) and any(k.startswith("gdn2_out") for k in ks)
    assert any(k.startswith("gdn2_out1") for k in k2), "the switched pass did not run"


# ---------------------------------------------------------------- CPU checks (no GPU)
def test_config_field_env_and_module_default(monkeypatch):
    from q27py.gpu import kernels as K

    check_switch_config(monkeypatch, "prefill_gdn_out_tf32", "Q27_PREFILL_GDN_OUT_TF32", 
                        K._gdn_out_tf32_default, "tf32")


def stub_launcher(monkeypatch, K, fits2: bool = True):
    """A stub runtime that records the launched (name, threads) (no GPU), a card whose state pass has two stages and K's
    presplit (test_gdn_state_tf32.py shares it); returns it and a scratch stand-in."""

    class _Arr:
        def __init__(self, n):
            self.size, self.dtype = n, "float32"

        def reshape(self, *_):
            return self

        def __getitem__(self, _):
            return self

    class _Rt:
        def __init__(self):
            self.names = []

        def launch(self, module, kernel, *a, **kw):
            self.names.append((kernel, a[1]))

    rt = _Rt()
    cp = type(sys)("cupy")
    cp.float32 = "float32"
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(K.Runtime, "get", classmethod(lambda cls: rt))
    monkeypatch.setattr(K, "gdn2_state_variant", lambda dk, dv, w=None: (2, "k", 8))
    monkeypatch.setattr(K, "gdn2_fits", lambda dk, dv, st, p: st == 1 or fits2)
    monkeypatch.setattr(K, "gdn2_smem_floats", lambda *a: {"prep": 1, "state": 1, "out": 1})
    monkeypatch.setattr(K, "gdn_chunk_aligned", lambda *a: True)
    return rt, _Arr(1 << 30)


@pytest.mark.parametrize("gated", [False, True])
def test_switch_picks_the_one_pass_entries(monkeypatch, gated):
    """The launcher's names under the switch (a stub runtime records them; no GPU): gdn2_out1_d* / gdn2_out1_gated_d*
    on, today's names off, the prep and state launches unchanged."""
    from q27py.gpu import kernels as K

    rt, scratch = stub_launcher(monkeypatch, K)
    monkeypatch.setattr(K, "gdn2_state_variant", lambda dk, dv, w: (2, False, None))
    monkeypatch.setattr(K, "gdn2_state_kernel", lambda dk, st, p, w, tf32=False: ("gdn2_state_d128_s2", 128))
    monkeypatch.setattr(K, "GDN2_STATE_TF32", False)  # the prep and state names as the fp32-grade passes have them
    g = K.GatedNormArgs(None, 0, None, 1e-6, object(), 0) if gated else None
    names = {}
    for on in (False, True):
        monkeypatch.setattr(K, "GDN2_OUT_TF32", on)
        rt.names.clear()
        K.gdn_prefill_chunked2(None, None, None, None, 0, 16, 48, 128, 128, 100, scratch=scratch, gated=g)
        names[on] = [n for n, _ in rt.names]
    tail = "_gated_d128" if gated else "_d128"
    assert names[False] == ["gdn2_prep_d128", "gdn2_state_d128_s2", "gdn2_out" + tail]
    assert names[True] == ["gdn2_prep_d128", "gdn2_state_d128_s2", "gdn2_out1" + tail]


@pytest.mark.parametrize("dk,t,pos0,decay", [(64, 100, 37, "normal"), (128, 66, 0, "strong")])
def test_emulated_one_pass_output_in_class(dk, t, pos0, decay):
    """The lane-level emulation (mma1 for the output pass's products): the state bitwise the 3xTF32 run's, O within
    the class against float64 and measurably off the fp32-grade pass (~4e-4 against ~2e-7)."""
    h, hv = 1, 2 if dk == 64 else 1
    dv = dk
    d = make(np.random.default_rng(dk + t + pos0), t, h, hv, dk, dv, decay)
    want_o, want_s = ops.gdn_recurrent(*(d[x].astype(np.float64) for x in ("q", "k", "v", "g", "beta", "s0")))
    res = {}
    for passes in (3, 1):
        state = klast(d["s0"])
        out = np.full((t, hv * dv), np.nan, np.float32)
        with np.errstate(invalid="ignore", over="ignore"):  # masked exps above the diagonal, as on the GPU
            emu2.run(state, d["qkvn"], d["gb"], out, hv * dv, h, hv, dk, dv, t, pos0, out_passes=passes)
        assert not np.isnan(out).any()
        res[passes] = (out, state, rel(out, want_o.reshape(t, -1)))
    np.testing.assert_array_equal(res[1][1].view(np.uint32), res[3][1].view(np.uint32))
    assert res[3][2] < 2e-5 and 1e-5 < res[1][2] < CLASS, (res[3][2], res[1][2])


if __name__ == "__main__":  # the device numbers for docs/QUANT.md
    device_quality("gdn out tf32", _switch)
