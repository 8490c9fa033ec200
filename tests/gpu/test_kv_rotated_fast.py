"""k5v3 / k3v3 (rotated Lloyd-Max KV) on the fast path against the numpy specification.

- the store kernel (rope.cu qk_norm_rope_store_rot): codes / norms are kvformat.lm_quantize of the
  rows the fp32 store kernel writes for the same inputs, and the query comes out rotated (R q);
- the tiled prefill kernel over codes (attention_prefill.cu attn_prefill_k*v3_d* + unrotate_gate)
  against float64 attention over the dequantized rows, and against the split-K kernel;
- FastModel with kv k5v3 / k3v3 against ReferenceModel with the same kv format (prefill chunks on
  the tiled kernel, decode steps, the MTP layer); verify lanes == decode steps bitwise; graph
  replays == eager; prefix export / import bitwise (and another format's rows refused); greedy
  speculation == plain greedy; the disk prefix cache across engines.

Codes: the quantizer's row norm is a block reduction (another summation order than numpy's), so a
coordinate on a codebook edge to the last bit may take the neighbouring code (>= 99.9 % agree, as
in test_kv_rotated.py); the model-level tolerances allow for those flips.
"""

from __future__ import annotations

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.model import kvformat as F
from q27py.model import ops

pytestmark = pytest.mark.gpu

ROTATED = ("k5v3", "k3v3")
TOL = 1e-4


@pytest.fixture(scope="module")
def cp():
    import cupy

    from q27py.gpu.runtime import Runtime

    for m in ("rope", "kv_rotated", "attention_prefill"):
        Runtime.get().module(m)
    return cupy


@pytest.fixture(scope="module")
def K(cp):
    from q27py.gpu import kernels

    return kernels


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def reference_attention(q, qg, kd, vd, t, pos0, nq, nkv, hd):
    rep, s = nq // nkv, pos0 + t
    qh = q[:, : nq * hd].reshape(t, nq, hd).astype(np.float64)
    gate = qg[:, : 2 * nq * hd].reshape(t, nq, 2 * hd)[..., hd:].astype(np.float64)
    want = np.empty((t, nq, hd))
    for g in range(nkv):
        heads = slice(g * rep, (g + 1) * rep)
        want[:, heads] = ops.attention(qh[:, heads], kd[g : g + 1, :s].transpose(1, 0, 2).astype(np.float64),
                                       vd[g : g + 1, :s].transpose(1, 0, 2).astype(np.float64),
                                       np.arange(pos0, s), hd ** -0.5)
    return want * ops.sigmoid(gate)


@pytest.mark.parametrize("fmt", ROTATED)
@pytest.mark.parametrize("hd", [64, 256])
def test_store_kernel_quantizes_like_the_spec(cp, K, fmt, hd):
    f = F.get_format(fmt)
    rng = np.random.default_rng(hd + f.k_bits)
    t, nq, nkv, rd, max_pos, pos0 = 5, 6, 2, hd // 4, 40, 11
    qg = cp.asarray(rng.standard_normal((t, 2 * nq * hd)).astype(np.float32))
    kv = cp.asarray((rng.standard_normal((t, 2 * nkv * hd)) * 3).astype(np.float32))
    qn = cp.asarray((rng.standard_normal(hd) * 0.1).astype(np.float32))
    kn = cp.asarray((rng.standard_normal(hd) * 0.1).astype(np.float32))
    inv = cp.asarray(1.0 / (1e7 ** (np.arange(0, rd, 2, dtype=np.float64) / rd)))
    pos = cp.asarray(np.array([pos0], np.int32))
    q32, qr = cp.zeros((t, nq * hd), cp.float32), cp.zeros((t, nq * hd), cp.float32)
    k32, v32 = cp.zeros((nkv, max_pos, hd), cp.float32), cp.zeros((nkv, max_pos, hd), cp.float32)
    kb, vb = hd * f.k_bits // 8, hd * f.v_bits // 8
    kc, vc = cp.zeros((nkv, max_pos, kb), cp.uint8), cp.zeros((nkv, max_pos, vb), cp.uint8)
    ks, vs = cp.zeros((nkv, max_pos), cp.uint16), cp.zeros((nkv, max_pos), cp.uint16)
    K.qk_norm_rope_store(qg, 2 * nq * hd, kv, 2 * nkv * hd, qn, kn, 1e-6, nq, nkv, hd, rd, inv, pos, q32, nq * hd,
                         k32, v32, False, max_pos, t)
    K.qk_norm_rope_store_rot(qg, 2 * nq * hd, kv, 2 * nkv * hd, qn, kn, 1e-6, nq, nkv, hd, rd, inv, pos, qr, nq * hd,
                             kc, vc, ks, vs, f.k_bits, f.v_bits, K.rotated_kv_tables(f.k_bits),
                             K.rotated_kv_tables(f.v_bits), max_pos, t)
    want_q = F.rotate(q32.get().reshape(t, nq, hd)).reshape(t, -1)
    np.testing.assert_allclose(qr.get(), want_q, atol=1e-5)
    rows = slice(pos0, pos0 + t)
    for c32, codes, norms, bits in ((k32, kc, ks, f.k_bits), (v32, vc, vs, f.v_bits)):
        x = c32.get()[:, rows]
        want_c, want_n = F.lm_quantize(x, bits)
        got_c, got_n = codes.get()[:, rows], norms.get()[:, rows].view(np.float16)
        assert np.mean(F.unpack_codes(got_c, bits, hd) == F.unpack_codes(want_c, bits, hd)) >= 0.999
        np.testing.assert_allclose(got_n.astype(np.float32), want_n.astype(np.float32), rtol=2e-3)
        assert rel(F.lm_dequantize(got_c, got_n, bits, hd), x) < {3: 0.25, 5: 0.07}[bits]  # the codec's own error
    for a in (kc, vc, ks, vs):  # nothing outside the t rows written
        h = a.get()
        assert not h[:, :pos0].any() and not h[:, pos0 + t :].any()


def rotated_case(rng, fmt, t, pos0, hd, nq, nkv, poison=True):
    f = F.get_format(fmt)
    max_pos = pos0 + t + 9
    k = (rng.standard_normal((nkv, max_pos, hd)) * 1.5).astype(np.float32)
    v = rng.standard_normal((nkv, max_pos, hd)).astype(np.float32)
    kc, kn = F.lm_quantize(k, f.k_bits)
    vc, vn = F.lm_quantize(v, f.v_bits)
    if poison:  # rows no lane may look at: huge norms would show up in any output that read them
        kn[:, pos0 + t :] = np.float16(60000)
        vn[:, pos0 + t :] = np.float16(60000)
    kd, vd = F.lm_dequantize(kc, kn, f.k_bits, hd), F.lm_dequantize(vc, vn, f.v_bits, hd)
    return f, max_pos, (kc, vc, kn.view(np.uint16), vn.view(np.uint16)), kd, vd


@pytest.mark.parametrize("fmt", ROTATED)
@pytest.mark.parametrize("t,pos0,hd,nq,nkv", [(17, 0, 64, 4, 2), (100, 37, 128, 8, 2), (333, 4097, 256, 6, 1),
                                              (1024, 0, 256, 24, 4), (40, 7, 32, 4, 1)])
def test_prefill_attention_over_rotated_codes_matches_reference_and_split(cp, K, fmt, t, pos0, hd, nq, nkv):
    """The tiled kernel stages centroid * s / sqrt(d) as bf16 hi + lo (fp32-grade) against the
    rotated query, then unrotate_gate: float64 attention over the dequantized rows within 1e-4,
    and the split-K kernel over the same codes likewise."""
    if not K.rotated_prefill_fits(hd):
        pytest.skip("prefill tile does not fit this device's shared memory")
    rng = np.random.default_rng(t + pos0 + hd)
    f, max_pos, payload, kd, vd = rotated_case(rng, fmt, t, pos0, hd, nq, nkv)
    dev = [cp.asarray(a) for a in payload]
    ldq, ldqg, ldo = nq * hd + 32, 2 * nq * hd + 8, nq * hd + 64
    q = rng.standard_normal((t, ldq)).astype(np.float32)
    qg = rng.standard_normal((t, ldqg)).astype(np.float32)
    qd = cp.asarray(q)
    K.rotate_heads(qd, ldq, t, nq, hd, False)
    pos = cp.asarray(np.array([pos0], np.int32))
    kt, vt = K.rotated_kv_tables(f.k_bits)[0], K.rotated_kv_tables(f.v_bits)[0]
    out = cp.full((t, ldo), np.nan, cp.float32)
    K.attention_prefill_rotated(qd, ldq, *dev, f.k_bits, f.v_bits, kt, vt, max_pos, nq, nkv, hd, pos, cp.asarray(qg),
                                ldqg, out, ldo, t)
    got = out.get()
    assert np.isnan(got[:, nq * hd :]).all() and np.isfinite(got[:, : nq * hd]).all()
    got = got[:, : nq * hd].reshape(t, nq, hd)
    want = reference_attention(q, qg, kd, vd, t, pos0, nq, nkv, hd)
    err = rel(got, want)
    assert err < TOL, f"relative L2 error {err:.3g}"
    # the split-K kernel (decode / verify lanes) over the same codes, a lane block at a time
    split = np.empty_like(got)
    for l0 in range(0, t, 16):
        n = min(16, t - l0)
        part = cp.zeros(K.attention_partials_floats(n, nq, hd), dtype=cp.float32)
        o2 = cp.zeros((n, ldo), cp.float32)
        K.attention_rotated(qd[l0:], ldq, *dev, f.k_bits, f.v_bits, kt, vt, max_pos, nq, nkv, hd,
                            cp.asarray(np.array([pos0 + l0], np.int32)), 16, part, cp.asarray(qg[l0:]), ldqg, o2, ldo,
                            n)
        split[l0 : l0 + n] = o2.get()[:, : nq * hd].reshape(n, nq, hd)
    assert rel(got, split) < TOL


# ---------------------------------------------------------------- FastModel


def build(kv, chunk=32, max_context=512):
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint

    return FastModel(from_checkpoint(Checkpoint.open(DEFAULT_MODEL_DIR), "bf16", progress=False),
                     max_context=max_context, kv_dtype=kv, chunk=chunk)


@pytest.fixture(scope="module", params=ROTATED)
def fast(request, cp):
    return request.param, build(request.param)


@pytest.fixture(scope="module")
def refs():
    from q27py.model.reference import ReferenceModel

    return {fmt: ReferenceModel.load(DEFAULT_MODEL_DIR, kv=fmt) for fmt in ROTATED}


def ids_of(seed, n):
    return [int(i) for i in np.random.default_rng(seed).integers(100, 4000, n)]


def tracks(got, want):
    """Rotated KV: a code that flips on a codebook edge moves one coordinate by a centroid step, so
    near-ties can differ between the paths; the bulk must agree closely."""
    err = np.abs(got - want).max(axis=-1) / np.abs(want).max(axis=-1)
    assert np.median(err) < 3e-3 and err.max() < 1e-1, (np.median(err), err.max())
    assert np.mean(got.argmax(-1) == want.argmax(-1)) > 0.95


def test_fast_model_tracks_reference_with_the_same_format(fast, refs):
    fmt, m = fast
    ref = refs[fmt]
    ids = ids_of(3, 120)
    want = ref.forward(ref.new_state(), ids).logits
    st = m.new_state()
    # 90 prefill lanes in chunks of 32, 32, 26 (the tiled kernel over codes, pos0 0 / 32 / 64) ...
    got = m.forward(st, ids[:90], logits_rows=list(range(64, 90))).logits
    for i in range(90, 120):  # ... then decode steps (the split-K kernel over codes)
        got = np.concatenate([got, m.forward(st, ids[i : i + 1]).logits])
    tracks(got, want[64:])
    assert m.state_format == f"cuda-{fmt}kv"


def test_fast_model_mtp_layer_tracks_reference(fast, refs):
    """The MTP layer's KV in the format: both models get the same hidden rows (the reference's), so
    only the MTP layer and its KV path differ."""
    fmt, m = fast
    if not m.has_mtp:
        pytest.skip("no MTP head")
    ref = refs[fmt]
    ids = ids_of(5, 30)
    nxt = ids[1:] + [77]
    rs, fs = ref.new_state(), m.new_state()
    rh = ref.forward(rs, ids).hidden
    m.forward(fs, ids)
    want, _ = ref.mtp_forward(rs.mtp_kv, rh, nxt, 0)  # 30 MTP rows: the tiled kernel over the MTP KV ...
    got, _ = m.mtp_forward(fs.mtp_kv, rh, nxt, 0)
    tracks(got, want)
    rw, _ = ref.mtp_forward(rs.mtp_kv, rh[:8], ids[:8], 30)  # ... then 8 rows on the split-K kernel over it
    fw, _ = m.mtp_forward(fs.mtp_kv, rh[:8], ids[:8], 30)
    tracks(fw, rw)
    assert fs.mtp_k_norm[:, :38].get().all()  # every row stored a (nonzero) norm


def test_verify_lanes_equal_decode_steps_bitwise(fast):
    fmt, m = fast
    ids = ids_of(6, 37)
    drafts = [11, 12, 13, 14, 15]
    a, b = m.new_state(), m.new_state()
    m.forward(a, ids, logits_rows="last")
    m.forward(b, ids, logits_rows="last")
    dec = [m.forward(a, [t]).logits[0] for t in drafts]
    ver = m.forward(b, drafts, verify=True)
    for i in range(len(drafts)):
        np.testing.assert_array_equal(ver.logits[i], dec[i])
    m.commit(b, ver.trace, 3)
    np.testing.assert_array_equal(b.k[:, :, : len(ids) + 3].get(), a.k[:, :, : len(ids) + 3].get())
    np.testing.assert_array_equal(b.k_norm[:, :, : len(ids) + 3].get(), a.k_norm[:, :, : len(ids) + 3].get())


def test_graph_replay_matches_eager(fast):
    fmt, _ = fast
    model, eager = build(fmt, chunk=16), build(fmt, chunk=16)
    model.enable_graphs()
    ids = ids_of(7, 37)
    s1, s2 = model.new_state(), eager.new_state()
    model.forward(s1, ids, logits_rows="last")
    eager.forward(s2, ids, logits_rows="last")
    for step in range(4):  # step 0 eager, step 1 captures, steps 2-3 replay
        np.testing.assert_array_equal(model.forward(s1, [40 + step]).logits, eager.forward(s2, [40 + step]).logits)
        v1 = model.forward(s1, [50, 51, 52], verify=True)
        v2 = eager.forward(s2, [50, 51, 52], verify=True)
        np.testing.assert_array_equal(v1.logits, v2.logits)
        model.commit(s1, v1.trace, 2)
        eager.commit(s2, v2.trace, 2)
    assert model.graphs.replays > 0


def test_prefix_round_trip_bitwise_and_other_formats_refused(fast):
    fmt, m = fast
    f = F.get_format(fmt)
    cfg = m.cfg
    ids = ids_of(4, 40)
    a = m.new_state()
    hid = m.forward(a, ids[:30]).hidden
    if m.has_mtp:  # MTP rows 0..28 (row p pairs hidden p with token p + 1)
        m.mtp_forward(a.mtp_kv, hid[:29], ids[1:30], 0, logits_rows="none")
    arrays = m.export_prefix(a)
    n = a.position
    assert arrays["k"].dtype == np.uint8 and arrays["k"].shape[-1] == cfg.head_dim * f.k_bits // 8
    assert arrays["v"].shape[-1] == cfg.head_dim * f.v_bits // 8
    assert arrays["k.norm"].dtype == np.uint16 and arrays["k.norm"].shape[-1] == n
    assert "k.exp" not in arrays
    if m.has_mtp:
        assert arrays["mtp.k.norm"].shape[-1] == arrays["mtp.k"].shape[1] == a.mtp_kv.length
    b = m.new_state()
    m.import_prefix(b, arrays, n)
    saved = m.save_recurrent(a)  # a DeviceSnapshot: GDN state only, the KV rows stay in the state
    la = m.forward(a, ids[30:34]).logits
    lb = m.forward(b, ids[30:34]).logits
    np.testing.assert_array_equal(la, lb)
    m.rewind(a, n, saved)  # rows past n are overwritten by the next forward, in the same format
    np.testing.assert_array_equal(m.forward(a, ids[30:34]).logits, la)
    if m.has_mtp:  # the MTP KV came back too: the next MTP rows read it
        ma, _ = m.mtp_forward(a.mtp_kv, hid[29:30], ids[30:31], 29)
        mb, _ = m.mtp_forward(b.mtp_kv, hid[29:30], ids[30:31], 29)
        np.testing.assert_array_equal(ma, mb)
    other = build("fp8" if fmt != "fp8" else "k5v3")
    with pytest.raises(ValueError, match="another format"):
        other.import_prefix(other.new_state(), arrays, n)
    sibling = build("k3v3" if fmt == "k5v3" else "k5v3")
    with pytest.raises(ValueError, match="another format"):  # same names, other row widths (k5v3 K rows are wider)
        sibling.import_prefix(sibling.new_state(), arrays, n)


def test_memory_per_sequence_is_the_formats_byte_count(fast):
    fmt, m = fast
    per_tok = m.memory_per_sequence(1) - m.memory_per_sequence(0)
    assert per_tok == F.model_bytes_per_token(fmt, m.cfg, with_mtp=m.has_mtp)
    st = m.new_state()
    assert st.nbytes() == m.memory_per_sequence(m.max_pos)  # what a state allocates is what the budget counts


def test_state_formats_and_compat_hashes_differ(cp):
    from pathlib import Path

    from q27py.engine.prefix_cache import compat_hash

    models = {kv: build(kv, max_context=64) for kv in ("f32", "bf16", "fp8") + ROTATED}
    formats = {kv: m.state_format for kv, m in models.items()}
    assert formats["k5v3"] == "cuda-k5v3kv" and formats["k3v3"] == "cuda-k3v3kv"
    assert len(set(formats.values())) == len(formats)
    cfg = models["k3v3"].cfg
    hashes = {compat_hash(Path(DEFAULT_MODEL_DIR), cfg, "bf16", f) for f in formats.values()}
    assert len(hashes) == len(formats)


def test_greedy_speculation_equals_plain_greedy(fast):
    from q27py.config import SpecConfig
    from q27py.engine.api import SamplingParams
    from q27py.engine.decoder import DecodeStats, Decoder
    from q27py.engine.spec import SpecDecoder

    fmt, _ = fast
    m = build(fmt, chunk=64, max_context=1024)
    m.enable_graphs()
    prompt = ids_of(8, 24) * 2  # a repeat: the suffix drafter fires too

    def run(decoder):
        st, out = m.new_state(), []
        for chunk in decoder.run(st, prompt, 40, SamplingParams(), frozenset(), None, DecodeStats()):
            out.extend(chunk)
        return out

    plain = run(Decoder(m))
    assert len(plain) == 40
    for width, depth in ((6, 3), (16, 4)):
        assert run(SpecDecoder(m, SpecConfig(max_verify_width=width, max_depth=depth))) == plain


@pytest.mark.parametrize("fmt", ROTATED)
def test_disk_prefix_entries_restore_across_engines(tmp_path, fmt):
    """An entry written by one engine with --kv fmt restores in a fresh engine (same format): the
    restored turn's greedy tokens equal a cold engine's, with cached tokens reported."""
    from q27py.config import Q27Config
    from q27py.engine.api import GenerationRequest
    from q27py.engine.engine import LocalEngine

    def engine(cache):
        cfg = Q27Config()
        cfg.engine.device, cfg.engine.kv, cfg.engine.checkpoint_every = "cuda", fmt, 64
        if cache:
            cfg.engine.prefix_cache_dir = tmp_path
        eng = LocalEngine.load(cfg)
        if cache:
            eng.prefix.disk.min_tokens = 1
        assert eng.model.kv_name == fmt
        return eng

    def run(eng, ids, head):
        toks, stats = [], None
        for chunk in eng.generate(GenerationRequest(prompt_ids=ids, max_tokens=12, stable_len=head)):
            toks += chunk.token_ids
            stats = chunk.stats or stats
        return toks, stats

    ids = ids_of(9, 200)
    writer = engine(True)
    run(writer, ids, 180)
    writer.prefix.disk.flush()
    assert list(tmp_path.glob("*.q27p"))
    reader = engine(True)
    warm, stats = run(reader, ids, 180)
    cold, _ = run(engine(False), ids, 180)
    assert warm == cold and stats["cached_tokens"] > 0
