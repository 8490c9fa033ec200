"""fp8 e4m3 KV on the GPU against the numpy specification (q27py/model/kvformat.py).

- the conversion itself, bit for bit (ties, subnormals, saturation) on this device's path
  (hardware cvt on sm_89+, the portable bit manipulation below);
- the store kernel: codes and row exponents equal kvformat.fp8_quantize of the fp32 rows the
  f32 store kernel writes for the same inputs;
- decode / verify attention over fp8 rows against float64 attention over their dequantization;
- FastModel with kv fp8 against the reference model with kv="fp8"; prefix export/import bitwise.
"""

from __future__ import annotations

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.model import kvformat as F
from q27py.model import ops

pytestmark = pytest.mark.gpu

TOL = 1e-4


@pytest.fixture(scope="module")
def cp():
    import cupy

    from q27py.gpu.runtime import Runtime

    Runtime.get().module("rope")
    Runtime.get().module("attention")
    return cupy


@pytest.fixture(scope="module")
def K(cp):
    from q27py.gpu import kernels

    return kernels


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_conversion_matches_spec_bitwise(cp):
    from q27py.gpu.runtime import Runtime, i32

    rng = np.random.default_rng(0)
    vals = F.E4M3_VALUES[[c for c in range(127)]].astype(np.float64)
    mids = (vals[1:] + vals[:-1]) / 2
    x = np.concatenate([vals, -vals, mids, -mids, np.nextafter(mids, 0), np.nextafter(mids, 1e9),
                        rng.standard_normal(20000) * np.exp2(rng.integers(-14, 9, 20000)),
                        [448, 449, 463.9, 464, 465, 1e9, -1e9, 2.0 ** -10, 2.0 ** -9.5]]).astype(np.float32)
    n = x.size
    xd, out, back = cp.asarray(x), cp.zeros(n, cp.uint8), cp.zeros(n, cp.float32)
    Runtime.get().launch("rope", "fp8_convert_probe", (-(-n // 512),), 256, (xd, out, back, i32(n)))
    np.testing.assert_array_equal(out.get(), F.e4m3_encode(x))
    np.testing.assert_array_equal(back.get() * 256, F.e4m3_decode(F.e4m3_encode(x)))


def test_store_kernel_quantizes_like_the_spec(cp, K):
    rng = np.random.default_rng(1)
    t, nq, nkv, hd, rd, max_pos, pos0 = 5, 6, 2, 128, 32, 40, 11
    qg = cp.asarray(rng.standard_normal((t, 2 * nq * hd)).astype(np.float32))
    kv = cp.asarray((rng.standard_normal((t, 2 * nkv * hd)) * 3).astype(np.float32))
    qn = cp.asarray((rng.standard_normal(hd) * 0.1).astype(np.float32))
    kn = cp.asarray((rng.standard_normal(hd) * 0.1).astype(np.float32))
    inv = cp.asarray(1.0 / (1e7 ** (np.arange(0, rd, 2, dtype=np.float64) / rd)))
    pos = cp.asarray(np.array([pos0], np.int32))
    q32, q8 = cp.zeros((t, nq * hd), cp.float32), cp.zeros((t, nq * hd), cp.float32)
    k32, v32 = cp.zeros((nkv, max_pos, hd), cp.float32), cp.zeros((nkv, max_pos, hd), cp.float32)
    k8, v8 = cp.zeros((nkv, max_pos, hd), cp.uint8), cp.zeros((nkv, max_pos, hd), cp.uint8)
    ke, ve = cp.zeros((nkv, max_pos), cp.int8), cp.zeros((nkv, max_pos), cp.int8)
    K.qk_norm_rope_store(qg, 2 * nq * hd, kv, 2 * nkv * hd, qn, kn, 1e-6, nq, nkv, hd, rd, inv, pos, q32, nq * hd,
                         k32, v32, False, max_pos, t)
    K.qk_norm_rope_store_fp8(qg, 2 * nq * hd, kv, 2 * nkv * hd, qn, kn, 1e-6, nq, nkv, hd, rd, inv, pos, q8, nq * hd,
                             k8, v8, ke, ve, max_pos, t)
    np.testing.assert_array_equal(q8.get(), q32.get())
    rows = slice(pos0, pos0 + t)
    for c32, c8, e8 in ((k32, k8, ke), (v32, v8, ve)):
        codes, exps = F.fp8_quantize(c32.get()[:, rows])
        np.testing.assert_array_equal(c8.get()[:, rows], codes)
        np.testing.assert_array_equal(e8.get()[:, rows], exps)
    assert not k8.get()[:, :pos0].any() and not ke.get()[:, pos0 + t :].any()  # nothing else written


@pytest.mark.parametrize("t,pos0,hd,nq,nkv", [(1, 0, 64, 4, 2), (1, 2047, 256, 24, 4), (16, 300, 128, 8, 2),
                                              (5, 4100, 256, 24, 4), (40, 70, 64, 4, 2), (1, 9, 32, 4, 1)])
def test_split_attention_over_fp8_matches_reference(cp, K, t, pos0, hd, nq, nkv):
    rng = np.random.default_rng(t + pos0 + hd)
    max_pos = pos0 + t + 7
    k = (rng.standard_normal((nkv, max_pos, hd)) * 2).astype(np.float32)
    v = rng.standard_normal((nkv, max_pos, hd)).astype(np.float32)
    kc, ke = F.fp8_quantize(k)
    vc, ve = F.fp8_quantize(v)
    kd, vd = F.fp8_dequantize(kc, ke), F.fp8_dequantize(vc, ve)
    ldq, ldqg, ldo = nq * hd + 32, 2 * nq * hd + 8, nq * hd + 64
    q = rng.standard_normal((t, ldq)).astype(np.float32)
    qg = rng.standard_normal((t, ldqg)).astype(np.float32)
    out = cp.full((t, ldo), np.nan, cp.float32)
    part = cp.zeros(K.attention_partials_floats(t, nq, hd), dtype=cp.float32)
    K.attention_fp8(cp.asarray(q), ldq, cp.asarray(kc), cp.asarray(vc), cp.asarray(ke), cp.asarray(ve), max_pos, nq,
                    nkv, hd, cp.asarray(np.array([pos0], np.int32)), max(16, t), part, cp.asarray(qg), ldqg, out, ldo, t)
    got = out.get()
    assert np.isnan(got[:, nq * hd :]).all()
    got = got[:, : nq * hd].reshape(t, nq, hd)
    rep, s = nq // nkv, pos0 + t
    qh = q[:, : nq * hd].reshape(t, nq, hd).astype(np.float64)
    gate = qg[:, : 2 * nq * hd].reshape(t, nq, 2 * hd)[..., hd:].astype(np.float64)
    want = np.empty((t, nq, hd))
    for g in range(nkv):
        heads = slice(g * rep, (g + 1) * rep)
        want[:, heads] = ops.attention(qh[:, heads], kd[g : g + 1, :s].transpose(1, 0, 2).astype(np.float64),
                                       vd[g : g + 1, :s].transpose(1, 0, 2).astype(np.float64),
                                       np.arange(pos0, s), hd ** -0.5)
    want *= ops.sigmoid(gate)
    err = rel(got, want)
    assert err < TOL, f"relative L2 error {err:.3g}"


@pytest.fixture(scope="module")
def fast_fp8(cp):
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint

    return FastModel(from_checkpoint(Checkpoint.open(DEFAULT_MODEL_DIR), "bf16", progress=False), max_context=512,
                     kv_dtype="fp8", chunk=64)


def test_fast_model_fp8_tracks_reference_fp8(fast_fp8):
    from q27py.model.reference import ReferenceModel

    ref = ReferenceModel.load(DEFAULT_MODEL_DIR, kv="fp8")
    ids = [int(i) for i in np.random.default_rng(3).integers(100, 4000, 90)]
    want = ref.forward(ref.new_state(), ids).logits
    st = fast_fp8.new_state()
    got = fast_fp8.forward(st, ids[:60]).logits  # prefill lanes (one chunk: the tiled kernel over fp8) ...
    for i in range(60, 90):  # ... then decode steps
        got = np.concatenate([got, fast_fp8.forward(st, ids[i : i + 1]).logits])
    # fp8 rounding can flip near-ties differently on the two paths; the bulk must agree closely
    err = np.abs(got - want).max(axis=-1) / np.abs(want).max(axis=-1)
    assert np.median(err) < 2e-3 and err.max() < 5e-2, (np.median(err), err.max())
    assert np.mean(got.argmax(-1) == want.argmax(-1)) > 0.95
    assert fast_fp8.state_format == "cuda-fp8kv"


def test_fast_model_fp8_prefix_round_trip_bitwise(fast_fp8):
    ids = [int(i) for i in np.random.default_rng(4).integers(100, 4000, 40)]
    a = fast_fp8.new_state()
    fast_fp8.forward(a, ids[:30])
    arrays = fast_fp8.export_prefix(a)
    assert arrays["k"].dtype == np.uint8 and arrays["k.exp"].dtype == np.int8
    b = fast_fp8.new_state()
    fast_fp8.import_prefix(b, arrays, 30)
    la = fast_fp8.forward(a, ids[30:34]).logits
    lb = fast_fp8.forward(b, ids[30:34]).logits
    np.testing.assert_array_equal(la, lb)


def test_max_context_auto_sizes_and_reports_the_window(cp, monkeypatch, capsys):
    from q27py.config import Q27Config
    from q27py.engine.engine import LocalEngine, load_model
    from q27py.tokenizer import Tokenizer

    cfg = Q27Config()
    cfg.engine.device, cfg.engine.tier, cfg.engine.kv = "cuda", "q8", "fp8"
    model = load_model(cfg)  # max_context "auto": sized from free memory
    b = model.context_budget
    assert b is not None and model.max_pos == b.window and b.kv_format == "fp8"
    assert "context window" in capsys.readouterr().err
    eng = LocalEngine(cfg, model, Tokenizer.from_model_dir(DEFAULT_MODEL_DIR))
    assert eng.max_context == min(b.window, model.cfg.max_position_embeddings)
    # a card that is nearly full: the window shrinks to what fits, and every sequence's state fits it
    # (beside each state's reserved graph bytes; --max-slots auto then gives one slot per state)
    from q27py.gpu.forward import batch_graph_bytes, graph_bytes_per_state

    # the per-state graphs and the model-level batch graphs (decode / verify / commit / mtp-batch) are
    # reserved before any window is sized: the fake card holds them plus 64 MiB
    graphs = graph_bytes_per_state(model, cfg.engine) * cfg.engine.max_sequences + batch_graph_bytes(model)
    real = cp.cuda.runtime.memGetInfo
    monkeypatch.setattr(cp.cuda.runtime, "memGetInfo",
                        lambda: (cfg.engine.kv_safety_margin_bytes + graphs + (64 << 20), real()[1]))
    small = load_model(cfg)
    assert small.context_budget.limited_by == "memory" and small.max_pos < model.max_pos
    per_seq = small.memory_per_sequence(small.max_pos)
    assert per_seq * cfg.engine.max_sequences <= 64 << 20
    assert small.sized_slots == cfg.engine.max_sequences == small.context_budget.sequences


@pytest.mark.parametrize("t,pos0,hd,nq,nkv", [(17, 0, 64, 4, 2), (100, 37, 128, 8, 2), (333, 4097, 256, 6, 1),
                                              (1024, 0, 256, 24, 4), (40, 7, 32, 4, 1)])
def test_prefill_attention_over_fp8_matches_split_and_reference(cp, K, t, pos0, hd, nq, nkv):
    """The tiled prefill kernel stages fp8 rows into bf16 tiles exactly: it must agree with float64
    attention over the dequantized rows (and so with the split-K kernel) within the bf16 path's tolerance."""
    if not K.attention_prefill_fits(hd, True):
        pytest.skip("prefill tile does not fit this device's shared memory")
    rng = np.random.default_rng(t + pos0)
    max_pos = pos0 + t + 9
    k = (rng.standard_normal((nkv, max_pos, hd)) * 1.5).astype(np.float32)
    v = rng.standard_normal((nkv, max_pos, hd)).astype(np.float32)
    kc, ke = F.fp8_quantize(k)
    vc, ve = F.fp8_quantize(v)
    kc[:, pos0 + t :] = 0x7F  # NaN codes where no lane may look
    vc[:, pos0 + t :] = 0x7F
    kd, vd = F.fp8_dequantize(kc, ke), F.fp8_dequantize(vc, ve)
    ldq, ldqg, ldo = nq * hd + 32, 2 * nq * hd + 8, nq * hd + 64
    q = rng.standard_normal((t, ldq)).astype(np.float32)
    qg = rng.standard_normal((t, ldqg)).astype(np.float32)
    out = cp.full((t, ldo), np.nan, cp.float32)
    pos = cp.asarray(np.array([pos0], np.int32))
    K.attention_prefill_fp8(cp.asarray(q), ldq, cp.asarray(kc), cp.asarray(vc), cp.asarray(ke), cp.asarray(ve),
                            max_pos, nq, nkv, hd, pos, cp.asarray(qg), ldqg, out, ldo, t)
    got = out.get()
    assert np.isnan(got[:, nq * hd :]).all() and np.isfinite(got[:, : nq * hd]).all()
    got = got[:, : nq * hd].reshape(t, nq, hd)
    rep, s = nq // nkv, pos0 + t
    qh = q[:, : nq * hd].reshape(t, nq, hd).astype(np.float64)
    gate = qg[:, : 2 * nq * hd].reshape(t, nq, 2 * hd)[..., hd:].astype(np.float64)
    want = np.empty((t, nq, hd))
    for g in range(nkv):
        heads = slice(g * rep, (g + 1) * rep)
        want[:, heads] = ops.attention(qh[:, heads], kd[g : g + 1, :s].transpose(1, 0, 2).astype(np.float64),
                                       vd[g : g + 1, :s].transpose(1, 0, 2).astype(np.float64),
                                       np.arange(pos0, s), hd ** -0.5)
    want *= ops.sigmoid(gate)
    err = rel(got, want)
    assert err < TOL, f"relative L2 error {err:.3g}"
