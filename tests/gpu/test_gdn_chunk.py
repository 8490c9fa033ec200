"""The chunked GDN prefill kernel (cuda/gdn_chunk.cu) against the numpy spec
(q27py/model/gdn_chunked.py), the float64 recurrence and the sequential kernel (gdn_prefill).

Tolerance class (3xTF32 products, fp32 state): relative L2 error of outputs and of the final
state within 2e-5 of the float64 recurrence -- the class of the sequential fp32 kernel itself --
at the 27B head shape and small shapes, ragged first/last chunks, strong decays. Pieces split at
absolute multiples of the chunk size are bitwise one run. The CPU tests run a lane-level numpy
transliteration of the kernel (gdn_chunk_emu.py) and compile it for sm_80/86/90 without spills.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from q27py.model import ops
from q27py.model.gdn_chunked import gdn_chunked

sys.path.insert(0, str(Path(__file__).parent))  # the emulator beside this file (tests/ is no package)
import gdn_chunk_emu as emu  # noqa: E402

NVCC = shutil.which("nvcc")
SHAPES = {"small": dict(h=2, hv=6, dk=64, dv=64), "27b": dict(h=16, hv=48, dk=128, dv=128),
          "d128": dict(h=1, hv=2, dk=128, dv=64)}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make(rng, t, h, hv, dk, dv, decay="normal"):
    q = ops.l2norm(rng.standard_normal((t, h, dk))) * dk ** -0.5
    k = ops.l2norm(rng.standard_normal((t, h, dk)))
    v = rng.standard_normal((t, hv, dv))
    if decay == "strong":
        g = -np.exp(rng.standard_normal((t, hv)) * 2.0 + 1.0)
        g[:, 0] = -1e-4  # one head that barely forgets: the state grows over the whole run
    else:
        g = -np.exp(rng.standard_normal((t, hv)) * 0.5) * 0.3
    beta = 1 / (1 + np.exp(-rng.standard_normal((t, hv))))
    s0 = rng.standard_normal((hv, dk, dv)) * 0.3
    qkvn = np.concatenate([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], axis=1).astype(np.float32)
    gb = np.concatenate([g, beta], axis=1).astype(np.float32)
    f = lambda x: x.astype(np.float32)  # noqa: E731
    return dict(q=f(q), k=f(k), v=f(v), g=f(g), beta=f(beta), s0=f(s0), qkvn=qkvn, gb=gb)


def klast(s):  # [HV, dk, dv] (ops) -> [HV, dv, dk] (device layout)
    return np.ascontiguousarray(s.transpose(0, 2, 1))


# ---------------------------------------------------------------- CPU: emulation and compile checks
@pytest.mark.parametrize("dk,chunk,t,pos0,decay", [(64, 64, 100, 37, "normal"), (64, 32, 70, 5, "strong"),
                                                   (128, 64, 66, 0, "strong"), (64, 64, 3, 63, "normal")])
def test_emulated_kernel_matches_spec(dk, chunk, t, pos0, decay):
    h, hv, dv = 1, 2, 64
    d = make(np.random.default_rng(dk + chunk + t), t, h, hv, dk, dv, decay)
    want_o, want_s = gdn_chunked(*(d[x].astype(np.float64) for x in ("q", "k", "v", "g", "beta", "s0")), chunk=chunk,
                                 pos0=pos0)
    state = klast(d["s0"])
    out = np.full((t, hv * dv), np.nan, np.float32)
    emu.run(state, d["qkvn"], d["gb"], out, hv * dv, h, hv, dk, dv, t, pos0, C=chunk)
    assert not np.isnan(out).any() and not np.isnan(state).any()
    assert rel(out, want_o.reshape(t, -1)) < 2e-5
    assert rel(state, klast(want_s)) < 2e-5


def test_tf32_rounding_emulation():
    x = np.array([1.0, 1 + 2.0 ** -11, 1 + 2.0 ** -10, -(1 + 3 * 2.0 ** -11), 3.0e-3], np.float32)
    got = emu.tf32(x)
    np.testing.assert_array_equal(got[:4], np.array([1.0, 1 + 2.0 ** -10, 1 + 2.0 ** -10, -(1 + 2 * 2.0 ** -10)],
                                                   np.float32))  # ties away from zero
    hi, lo = emu.split(x)
    assert np.all(np.abs(hi + lo - x) <= np.abs(x) * 2.0 ** -21)


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
def test_compiles_without_spills(tmp_path, arch):
    from q27py.gpu.runtime import source_text

    src = tmp_path / "gdn_chunk.cu"
    src.write_text(source_text("gdn_chunk"), encoding="utf-8")
    r = subprocess.run([NVCC, "-std=c++17", f"-arch={arch}", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "k.cubin"),
                        str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    entries = re.findall(r"Compiling entry function '(\w+)'", r.stderr)
    assert sorted(entries) == sorted(f"gdn_chunk_d{dk}_c{c}" for dk in (64, 128) for c in (32, 64))
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    assert len(spills) == 4 and all(a == "0" and b == "0" for a, b in spills), r.stderr


def test_shared_memory_budget():
    from q27py.gpu.kernels import gdn_chunk_floats

    assert 4 * gdn_chunk_floats(128, 64) <= 163 * 1024  # sm_80 opt-in (sm_90: 227 KB)
    assert 4 * gdn_chunk_floats(128, 32) <= 99 * 1024  # sm_86 / sm_89 / sm_120 opt-in


def test_route_switch_maps_from_config_and_env():
    from q27py.config import Q27Config, apply_env
    from q27py.gpu import kernels as K

    assert Q27Config().engine.gdn_prefill == "sequential"  # until the device run holds the chunked route
    assert apply_env(Q27Config(), {"Q27_GDN_PREFILL": "chunked"}).engine.gdn_prefill == "chunked"
    assert K.gdn_prefill_mode("chunked") == "chunked" and K.gdn_prefill_mode("sequential") == "sequential"
    with pytest.raises(ValueError, match="gdn_prefill"):
        K.gdn_prefill_mode("chunky")
    assert K.gdn_chunk_aligned(1 << 20, 16, 48, 128, 128) and not K.gdn_chunk_aligned((1 << 20) + 8, 16, 48, 128, 128)


# ---------------------------------------------------------------- GPU
@pytest.fixture(scope="module")
def cp():
    import cupy

    from q27py.gpu.runtime import Runtime

    Runtime.get().module("gdn_chunk")
    Runtime.get().module("gdn")
    return cupy


@pytest.fixture(scope="module")
def K(cp):
    from q27py.gpu import kernels

    return kernels


def chunks_here(K, dk, dv):
    from q27py.gpu.runtime import Runtime

    return [c for c in (64, 32) if 4 * K.gdn_chunk_floats(dk, c) <= Runtime.get().smem_optin]


def run_chunked(cp, K, d, h, hv, dk, dv, t, pos0, chunk):
    state = cp.asarray(klast(d["s0"]))
    out = cp.full((t, hv * dv), np.nan, dtype=cp.float32)  # poison: every row must be written
    K.gdn_prefill_chunked(state, cp.asarray(d["qkvn"]), cp.asarray(d["gb"]), out, hv * dv, h, hv, dk, dv, t, pos0=pos0,
                          chunk=chunk)
    return out.get(), state.get()


def run_sequential(cp, K, d, h, hv, dk, dv, t):
    state = cp.asarray(klast(d["s0"]))
    out = cp.full((t, hv * dv), np.nan, dtype=cp.float32)
    K.gdn_prefill(state, cp.asarray(d["qkvn"]), cp.asarray(d["gb"]), out, hv * dv, h, hv, dk, dv, t)
    return out.get(), state.get()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("t,pos0", [(17, 0), (64, 0), (100, 37), (1000, 5), (1000, 64)])
@pytest.mark.parametrize("decay", ["normal", "strong"])
def test_chunked_matches_spec_and_sequential(cp, K, shape, t, pos0, decay):
    s = SHAPES[shape]
    h, hv, dk, dv = s["h"], s["hv"], s["dk"], s["dv"]
    d = make(np.random.default_rng(t + pos0), t, h, hv, dk, dv, decay)
    o64, s64 = ops.gdn_recurrent(*(d[x].astype(np.float64) for x in ("q", "k", "v", "g", "beta", "s0")))
    so, ss = run_sequential(cp, K, d, h, hv, dk, dv, t)
    for chunk in chunks_here(K, dk, dv):
        o, st = run_chunked(cp, K, d, h, hv, dk, dv, t, pos0, chunk)
        assert not np.isnan(o).any()
        assert rel(o, o64.reshape(t, -1)) < 2e-5, chunk
        assert rel(st, klast(s64)) < 2e-5, chunk
        assert rel(o, so) < 2e-5 and rel(st, ss) < 2e-5, chunk


@pytest.mark.gpu
def test_pieces_split_at_chunk_multiples_are_bitwise_one_run(cp, K):
    h, hv, dk, dv = 2, 6, 128, 128
    t = 300
    d = make(np.random.default_rng(9), t, h, hv, dk, dv)
    for chunk in chunks_here(K, dk, dv):
        o_all, s_all = run_chunked(cp, K, d, h, hv, dk, dv, t, 0, chunk)
        cut = 2 * chunk
        state = cp.asarray(klast(d["s0"]))
        out = cp.full((t, hv * dv), np.nan, dtype=cp.float32)
        qkvn, gb = cp.asarray(d["qkvn"]), cp.asarray(d["gb"])
        K.gdn_prefill_chunked(state, qkvn[:cut], gb[:cut], out, hv * dv, h, hv, dk, dv, cut, pos0=0, chunk=chunk)
        K.gdn_prefill_chunked(state, qkvn[cut:], gb[cut:], out[cut:], hv * dv, h, hv, dk, dv, t - cut, pos0=cut,
                              chunk=chunk)
        np.testing.assert_array_equal(out.get(), o_all)
        np.testing.assert_array_equal(state.get(), s_all)


@pytest.mark.gpu
def test_long_run_at_27b_shape_stays_in_class(cp, K):
    """8K lanes, one 27B layer: the chunked state drifts from the sequential kernel's no more than
    the sequential kernel's own fp32 rounding does (both against float64 on a few heads)."""
    h, hv, dk, dv, t = 16, 48, 128, 128, 8192
    d = make(np.random.default_rng(11), t, h, hv, dk, dv, "strong")
    so, ss = run_sequential(cp, K, d, h, hv, dk, dv, t)
    o, st = run_chunked(cp, K, d, h, hv, dk, dv, t, 0, None)
    assert rel(o, so) < 5e-5 and rel(st, ss) < 5e-5
    heads = [0, 1, 47]  # head 0 barely decays: the hardest case for drift
    sub = {x: d[x][:, [hh // 3 for hh in heads]] if x in ("q", "k") else d[x][:, heads] for x in ("q", "k", "v", "g", "beta")}
    o64, s64 = ops.gdn_recurrent(sub["q"].astype(np.float64), sub["k"].astype(np.float64), sub["v"].astype(np.float64),
                                 sub["g"].astype(np.float64), sub["beta"].astype(np.float64),
                                 d["s0"][heads].astype(np.float64))
    s64 = klast(s64)
    err_chunk, err_seq = rel(st[heads], s64), rel(ss[heads], s64)
    assert err_chunk < 4 * err_seq + 1e-5, (err_chunk, err_seq)


@pytest.mark.gpu
def test_fast_model_prefill_through_the_chunked_route(cp, K):
    """The bundled model, one prompt of 300 tokens: logits of the chunked route track the sequential
    route to 1e-4 of the logit scale and give the same greedy token; a prompt split at a
    non-multiple of the chunk (a restore mid-chunk) stays in the same class."""
    from q27py import DEFAULT_MODEL_DIR
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint

    model = FastModel(from_checkpoint(Checkpoint.open(DEFAULT_MODEL_DIR), "bf16", progress=False), max_context=1024,
                      kv_dtype="f32", chunk=512)
    ids = np.random.default_rng(12).integers(0, 16000, 300).tolist()
    saved = K.GDN_PREFILL
    try:
        res = {}
        for mode in ("sequential", "chunked"):
            K.GDN_PREFILL = mode
            st = model.new_state()
            res[mode] = np.asarray(model.forward(st, ids, logits_rows="last").logits, np.float64)
        st = model.new_state()
        model.forward(st, ids[:141])
        split = np.asarray(model.forward(st, ids[141:], logits_rows="last").logits, np.float64)
    finally:
        K.GDN_PREFILL = saved
    scale = np.abs(res["sequential"]).max()
    assert np.abs(res["chunked"] - res["sequential"]).max() <= 1e-4 * scale
    assert np.abs(split - res["chunked"]).max() <= 1e-4 * scale
    assert np.argmax(res["chunked"][-1]) == np.argmax(res["sequential"][-1])
