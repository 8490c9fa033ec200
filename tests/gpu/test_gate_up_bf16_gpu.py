"""EngineConfig.prefill_gate_up_bf16 (env Q27_PREFILL_GATE_UP_BF16, on by default): prefill chunks on cuBLAS's
bf16 route have the MLP's gate_up GEMM write gate and up as bf16 (fp32 accumulation, one round to nearest each)
and SwiGLU read those (q27py/gpu/blas.py _gemm_expanded, cuda/dequant.cu swiglu_tiles_zbf16 / _bf16).

What is held, and to what:
- the SwiGLU kernels alone: BITWISE swiglu_tiles / swiglu_tiles_bf16 (today's kernels: the same product per
  output, the same device expf) run on fp32 rows holding the same bf16 values, and equal to the numpy emulation
  (widen, g * (1 / (1 + exp(-g))) * u in fp32, round to bf16 nearest even) except where the device expf (<= 2 ulp)
  and numpy's exp put the fp32 product on the other side of a bf16 rounding boundary: at most 1e-3 of the outputs,
  each 1 bf16 ulp away;
- cuBLAS's bf16 output: the fp32 output of the same GEMM rounded to nearest even, except where a different
  accumulation order lands next to a rounding boundary (<= 1e-3 of the values, 1 ulp; truncating would miss ~50%);
- the route end to end on the bundled tiny model (q4s, 300-token prefills): logits within 5e-3 relative L2 of the
  fp32 route (why that bound: see test_route_end_to_end), greedy decode after it equal (a divergence only where the
  fp32 route's own top-1 margin is a near tie), and 2,048 held-out tokens inside the a8 tier's accepted gate;
- switch off: no new launch, no bf16 GEMM output, the same bits before and after a run with it on.

Without a GPU only the CPU checks run (config / env, launch arguments; the nvcc builds are in test_compile.py).
`python3 tests/gpu/test_gate_up_bf16_gpu.py` prints the quality numbers (KL, top-1, NLL) on the device.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import pytest

from q27py.gpu import layout as L

sys.path.insert(0, str(Path(__file__).parent))
from test_prefill_rows import bits, poisoned, swiglu_case  # noqa: E402

gpu = pytest.mark.gpu  # the CPU checks at the end are unmarked
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cp():
    import cupy

    from q27py.gpu.runtime import Runtime

    Runtime.get().module("dequant")
    return cupy


@pytest.fixture
def K(cp, monkeypatch):
    from q27py.gpu import blas
    from q27py.gpu import kernels

    if not blas.available():
        pytest.skip("cuBLAS not reachable through CuPy")
    monkeypatch.setattr(kernels, "PREFILL_GEMM", "auto")  # the bf16 route (an fp8 env would bypass it)
    monkeypatch.setattr(kernels, "PREFILL_GATE_UP_BF16", False)
    return kernels


def _gate_up_z(rng, ntok: int, nout: int, scale: float = 2.5) -> tuple[np.ndarray, int]:
    """bf16 bits of a GEMM output [ntok][nrows] in the interleaved layout (nrows = row_tiles * 16 as the route's),
    |gate| kept under 20 (no fp32 subnormal products: the kernels run with -ftz=true)."""
    nrows = L.round_up(2 * L.round_up(nout, 8), 16)
    z = np.clip(rng.standard_normal((ntok, nrows)) * scale, -19.5, 19.5).astype(np.float32)
    z[:, ::7] *= 1e-3  # small values too (sigmoid near 1/2, products far below 1)
    return L.bf16_bits(z), nrows


def _emulate(zb: np.ndarray, nout: int) -> np.ndarray:
    """numpy emulation of the SwiGLU over bf16 gate / up: widen, silu(g) * u in fp32 as the kernel orders it."""
    z = L.bf16_to_f32(zb)
    t = z.reshape(z.shape[0], -1, 2, 8)
    g = t[:, :, 0, :].reshape(z.shape[0], -1)[:, :nout]
    u = t[:, :, 1, :].reshape(z.shape[0], -1)[:, :nout]
    with np.errstate(over="ignore"):
        e = np.exp(-g.astype(np.float64)).astype(np.float32)  # correctly rounded exp (the device's expf: <= 2 ulp)
    sig = np.float32(1) / (np.float32(1) + e)
    return (g * sig) * u


def _ulps_bf16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in bf16 ulps of same-sign finite bf16 bit patterns."""
    return np.abs(a.astype(np.int32) - b.astype(np.int32))


# ---------------------------------------------------------------- (a) the kernels alone
@gpu
@pytest.mark.parametrize("nout,ntok,pad", [(768, 37, 64), (300, 200, 20), (17408, 9, 0), (13, 5, 3)])
def test_swiglu_zbf16_is_bitwise_the_fp32_kernels_on_the_same_values(cp, K, nout, ntok, pad):
    """Ragged nout (a partial last group: the one-by-one stores), row strides that are not multiples of 8 (pad 3,
    20: unaligned rows take the scalar stores too), the 27B's inner size; nothing written past nout."""
    from q27py.gpu.runtime import Runtime, i32

    rt = Runtime.get()
    rng = np.random.default_rng(nout + ntok)
    zb, nrows = _gate_up_z(rng, ntok, nout)
    z16 = cp.asarray(zb)
    z32 = cp.asarray(L.bf16_to_f32(zb))  # the same values as fp32 rows (exact)
    ldy = nout + pad
    grid_new, grid32, grid16 = (-(-nout // 2048), ntok), (-(-nout // 256), ntok), (-(-nout // 512), ntok)
    want32, got32 = poisoned(cp, (ntok, ldy)), poisoned(cp, (ntok, ldy))
    rt.launch("dequant", "swiglu_tiles", grid32, 256, (z32, i32(nrows), i32(nout), want32, i32(ldy)))
    rt.launch("dequant", "swiglu_tiles_zbf16", grid_new, 256, (z16, i32(nrows), i32(nout), got32, i32(ldy)))
    want16, got16 = poisoned(cp, (ntok, ldy), cp.uint16), poisoned(cp, (ntok, ldy), cp.uint16)
    rt.launch("dequant", "swiglu_tiles_bf16", grid16, 256, (z32, i32(nrows), i32(nout), want16, i32(ldy)))
    rt.launch("dequant", "swiglu_tiles_zbf16_bf16", grid_new, 256, (z16, i32(nrows), i32(nout), got16, i32(ldy)))
    w32, g32, w16, g16 = want32.get(), got32.get(), want16.get(), got16.get()
    assert not np.isnan(w32[:, :nout]).any()
    np.testing.assert_array_equal(bits(g32[:, :nout]), bits(w32[:, :nout]))
    np.testing.assert_array_equal(g16[:, :nout], w16[:, :nout])
    np.testing.assert_array_equal(g16[:, :nout], L.bf16_bits(w32[:, :nout]))  # one rounding of today's product
    assert np.isnan(g32[:, nout:]).all() and (g16[:, nout:] == 0x7FC1).all(), "wrote past nout"

    # the numpy emulation (module docstring: equal but where expf and numpy's exp straddle a bf16 boundary)
    emu = _emulate(zb, nout)
    eb = L.bf16_bits(emu)
    off = g16[:, :nout] != eb
    assert off.sum() <= max(1, 1e-3 * off.size), f"{off.sum()} of {off.size} bf16 outputs differ from the emulation"
    assert (_ulps_bf16(g16[:, :nout][off], eb[off]) <= 1).all()
    np.testing.assert_allclose(g32[:, :nout], emu, rtol=2.0 ** -20, atol=1e-30)  # a few fp32 ulps (expf)


@gpu
@pytest.mark.parametrize("cols", [640, 5120])
def test_cublas_bf16_output_is_the_fp32_output_rounded(cp, K, cols):
    """gemm_bf16(out_bf16=True): compute type fp32, C as bf16 -- the fp32 GEMM's values rounded to nearest even
    (up to where another accumulation order sits next to a rounding boundary: 1 ulp, rare)."""
    from q27py.gpu import blas

    rng = np.random.default_rng(cols)
    rows, ntok = 608, 200
    pm = L.pack_matrix(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, L.FMT_Q4)
    m = K.upload_packed(pm)
    kpad = pm.shape.kpad
    w = blas.dequantize_to_bf16(m, cp.empty(blas.expanded_bytes(m) // 2, dtype=cp.uint16))
    x = cp.asarray(L.bf16_bits(rng.standard_normal((ntok, kpad)).astype(np.float32)))
    nrows = pm.shape.row_tiles * 16
    y32 = poisoned(cp, (ntok, nrows))
    y16 = poisoned(cp, (ntok, nrows), cp.uint16)
    blas.gemm_bf16(w, kpad, x, kpad, ntok, nrows, kpad, y32, nrows, accumulate=False)
    blas.gemm_bf16(w, kpad, x, kpad, ntok, nrows, kpad, y16, nrows, accumulate=False, out_bf16=True)
    want = L.bf16_bits(y32.get())
    got = y16.get()
    assert not np.isnan(y32.get()).any()
    off = got != want
    assert off.mean() <= 1e-3, f"{off.sum()} of {off.size}: not round to nearest even of the fp32 output"
    assert (_ulps_bf16(got[off], want[off]) <= 1).all()


@gpu
@pytest.mark.parametrize("fmt", [L.FMT_Q8, L.FMT_Q4])
def test_plan_route_is_the_composition(cp, K, fmt, monkeypatch):
    """A SwiGLU plan on the cuBLAS route with the switch on, writing bf16 rows (the forward's run(y_bf16=...)) and
    fp32 rows: bitwise the bf16-output GEMM followed by today's kernels on the widened values; and within the
    tolerance of the fp32 route (bf16 rounding of gate and up: ~2^-9 relative per value)."""
    from q27py.gpu import blas
    from q27py.gpu.runtime import Runtime, i32

    rng, rows, cols, ntok, pm, m, x = swiglu_case(K, fmt, 90 + fmt)
    assert ntok >= blas.MIN_TOKENS
    kpad, nrows = pm.shape.kpad, pm.shape.row_tiles * 16
    xd = cp.asarray(x)
    ldb = L.round_up(rows, 64)

    def run(on: bool):
        monkeypatch.setattr(K, "PREFILL_GATE_UP_BF16", on)
        y, yb = poisoned(cp, (ntok, rows)), poisoned(cp, (ntok, ldb), cp.uint16)
        K.GemvPlan([m], [(y, rows)], K.Workspace()).run(xd, kpad, ntok)
        y2 = poisoned(cp, (ntok, rows))
        K.GemvPlan([m], [(y2, rows)], K.Workspace()).run(xd, kpad, ntok, x_bf16=cp.asarray(L.bf16_bits(x)), y_bf16=yb)
        assert np.isnan(y2.get()).all(), "the fp32 rows were written as well"
        return y.get(), yb.get()

    base32, base16 = run(False)
    got32, got16 = run(True)
    # the composition, by hand
    wexp = blas.dequantize_to_bf16(m, cp.empty(blas.expanded_bytes(m) // 2, dtype=cp.uint16))
    z16 = cp.empty((ntok, nrows), dtype=cp.uint16)
    blas.gemm_bf16(wexp, kpad, cp.asarray(L.bf16_bits(x)), kpad, ntok, nrows, kpad, z16, nrows, accumulate=False,
                   out_bf16=True)
    z32 = cp.asarray(L.bf16_to_f32(z16.get()))
    want32, want16 = poisoned(cp, (ntok, rows)), poisoned(cp, (ntok, ldb), cp.uint16)
    rt = Runtime.get()
    rt.launch("dequant", "swiglu_tiles", (-(-rows // 256), ntok), 256, (z32, i32(nrows), i32(rows), want32, i32(rows)))
    rt.launch("dequant", "swiglu_tiles_bf16", (-(-rows // 512), ntok), 256,
              (z32, i32(nrows), i32(rows), want16, i32(ldb)))
    np.testing.assert_array_equal(bits(got32), bits(want32.get()))
    np.testing.assert_array_equal(got16, want16.get())
    assert (got16[:, rows:] == 0x7FC1).all()
    # against the fp32 route: gate and up each moved by <= 2^-9 relative (numpy emulation of these sizes: 2.6e-3
    # relative L2 of silu(g) * u; silu amplifies a relative change of g by up to ~2 where g < 0)
    a, b = got32.astype(np.float64), base32.astype(np.float64)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 5e-3
    assert not np.array_equal(bits(got32), bits(base32)), "the switch changed nothing: the route did not run"
    np.testing.assert_array_equal(base16[:, :rows], L.bf16_bits(base32))  # switch off: today's bytes


# ---------------------------------------------------------------- (b), (c) the route in the forward
@pytest.fixture(scope="module")
def tiny():
    """The bundled tiny model (q4s: its MLPs' gate_up / down take the cuBLAS route) and held-out text ids."""
    from q27py import DEFAULT_MODEL_DIR
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint
    from q27py.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(Path(DEFAULT_MODEL_DIR))
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "q27py" / "engine").glob("*.py")))
    ids = np.asarray(tok.encode(text), dtype=np.int64)
    return from_checkpoint(Checkpoint.open(Path(DEFAULT_MODEL_DIR)), "q4s", progress=False), ids


@contextlib.contextmanager
def module_switch(K, name: str, on: bool):
    """A kernels-module switch (read per call) set to `on` for the block, then restored."""
    saved = getattr(K, name)
    setattr(K, name, on)
    try:
        yield
    finally:
        setattr(K, name, saved)


def _switch(K, on: bool):
    return module_switch(K, "PREFILL_GATE_UP_BF16", on)


def _prefill_and_decode(model, prompt, steps: int) -> dict:
    st = model.new_state()
    out = model.forward(st, prompt, logits_rows="all")
    res = {"logits": out.logits.astype(np.float64).copy(), "hidden": np.asarray(out.hidden).copy()}
    res.update({k: np.asarray(v) for k, v in model.export_prefix(st).items()})  # KV rows, GDN state, window
    tok = int(res["logits"][-1].argmax())
    toks, rows = [tok], [res["logits"][-1]]
    for _ in range(steps):
        lg = model.forward(st, [tok]).logits[0].astype(np.float64)
        tok = int(lg.argmax())
        toks.append(tok)
        rows.append(lg.copy())
    res["greedy"], res["greedy_logits"] = np.asarray(toks), np.stack(rows)
    return res


PREFILL_TOKENS = 300
DECODE_STEPS = 32


@gpu
def test_route_end_to_end(cp, K, tiny):
    """Three 300-token prefills of held-out text (one chunk on the cuBLAS route) with the switch off and on.

    Logits bound, relative L2 over every row: 5e-3. Why: the CPU study (docs/QUANT.md) moved the logits by at most
    2.6e-3 of their scale at its worst position of 6,142 (max abs, tiny models), and the L2 over 300 rows sits below
    the worst element; 5e-3 leaves ~2x for this tier's bf16 activations around the MLPs. Expected: ~1e-3. A wrong
    route (gate / up swapped or misread, truncation instead of rounding) moves them by O(1).
    Greedy: the 33 tokens after each prefill are equal; if a prompt diverges, it must be at a near tie -- the fp32
    route's margin between its pick and the other route's under 4x the largest logit change the prefill rows saw
    (the study flips 0.16-0.29% of top-1 picks, all such ties)."""
    switch_end_to_end(K, tiny, _switch)


def switch_end_to_end(K, tiny, switch, prompts: int = 3, bound: float = 5e-3) -> list[float]:
    """`prompts` 300-token prefills of held-out text with a prefill switch off and on (`switch(K, on)`: this file's or
    another prefill switch's, e.g. test_gdn_out_tf32.py's): every row's logits moved and within `bound` relative L2; the
    33 greedy tokens after each equal, or diverging only at a near tie (test_route_end_to_end's rule). Returns the
    relative L2 of each prompt."""
    from q27py.gpu.forward import FastModel

    weights, ids = tiny
    model = FastModel(weights, max_context=PREFILL_TOKENS + DECODE_STEPS + 64, kv_dtype="bf16", chunk=512)
    rels, diverged = [], []
    for p in range(prompts):
        prompt = ids[p * PREFILL_TOKENS : (p + 1) * PREFILL_TOKENS]
        with switch(K, False):
            off = _prefill_and_decode(model, prompt, DECODE_STEPS)
        with switch(K, True):
            on = _prefill_and_decode(model, prompt, DECODE_STEPS)
        a, b = on["logits"], off["logits"]
        rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        print(f"prompt {p}: logits rel L2 {rel:.2e}, max abs {np.abs(a - b).max():.2e} (scale {np.abs(b).max():.2f})")
        assert rel < bound, rel
        assert rel > 0, "the switch changed nothing: the route did not run"
        same = on["greedy"] == off["greedy"]
        if not same.all():
            i = int(np.argmin(same))  # the first divergence; before it both saw the same tokens
            lo = off["greedy_logits"][i]
            margin = lo[off["greedy"][i]] - lo[on["greedy"][i]]
            tie = 4 * np.abs(a - b).max()
            diverged.append((p, i, margin, tie))
            assert margin <= tie, f"prompt {p}: greedy diverged at step {i} with a margin {margin:.3g} > {tie:.3g}"
        rels.append(rel)
    print(f"greedy: {prompts - len(diverged)} of {prompts} prompts equal over {DECODE_STEPS + 1} tokens; near ties: "
          f"{diverged}")
    return rels


def switch_launches_and_bits(K, tiny, switch, monkeypatch) -> tuple[list, list, list]:
    """A 300-token prefill of the tiny model with the switch off, on, off again: the kernel names each launched
    (three lists, for the caller's route checks); asserts that both off runs give the same bits (logits, KV rows, GDN
    state, window) and that the on run moved the logits."""
    from q27py.gpu.forward import FastModel
    from q27py.gpu.runtime import Runtime

    weights, ids = tiny
    rt = Runtime.get()
    launched = []
    real = rt.launch

    def launch(module, kernel, *a, **kw):
        launched.append(kernel)
        return real(module, kernel, *a, **kw)

    monkeypatch.setattr(rt, "launch", launch)
    model = FastModel(weights, max_context=PREFILL_TOKENS + 64, kv_dtype="bf16", chunk=512)

    def run(on: bool):
        launched.clear()
        with switch(K, on):
            st = model.new_state()
            out = model.forward(st, ids[:PREFILL_TOKENS], logits_rows=np.arange(0, PREFILL_TOKENS, 7))
            got = {"logits": out.logits.copy(), **{k: np.asarray(v) for k, v in model.export_prefix(st).items()}}
        return got, list(launched)

    off1, k1 = run(False)
    on, k2 = run(True)
    off2, k3 = run(False)
    for k in off1:
        np.testing.assert_array_equal(np.asarray(off1[k]).view(np.uint8), np.asarray(off2[k]).view(np.uint8), err_msg=k)
    assert not np.array_equal(on["logits"], off1["logits"])
    return k1, k2, k3


def assert_in_a8_gate(r: dict) -> None:
    """quality()'s result inside the a8 tier's accepted gate (docs/QUANT.md): mean KL 2.5e-4, p99.9 1.8e-3, top-1
    agreement 0.990, NLL within 5e-4."""
    assert r["kl_mean"] < 2.5e-4 and r["kl_p999"] < 1.8e-3, r
    assert r["top1_agree"] >= 0.990, r
    assert abs(r["nll_on"] - r["nll_off"]) < 5e-4, r


def quality(K, weights, ids, tokens: int = 2048, switch=_switch) -> dict:
    """Held-out text in 512-token chunks (each on the cuBLAS route), every row's logits, switch off vs on: KL mean /
    p99.9 / max, top-1 agreement, NLL (tools/fp8_prefill.py's quality(), for this switch; `switch(K, on)`: another
    prefill switch's context, e.g. test_gdn_out_tf32.py's)."""
    from q27py.gpu.forward import FastModel

    ids = ids[:tokens]
    logits = {}
    for on in (False, True):
        with switch(K, on):
            m = FastModel(weights, max_context=len(ids) + 64, kv_dtype="bf16", chunk=512)
            st = m.new_state()
            rows = [m.forward(st, ids[s : s + 512], logits_rows="all").logits.astype(np.float64)
                    for s in range(0, len(ids) - 1, 512)]
            logits[on] = np.concatenate(rows)[: len(ids) - 1]
            del m

    def lsm(x):
        mx = x.max(-1, keepdims=True)
        return x - mx - np.log(np.exp(x - mx).sum(-1, keepdims=True))

    lp, lq = lsm(logits[False]), lsm(logits[True])
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    tgt = np.asarray(ids[1:])
    return {"positions": int(len(tgt)), "kl_mean": float(kl.mean()), "kl_p999": float(np.quantile(kl, 0.999)),
            "kl_max": float(kl.max()), "top1_agree": float((lp.argmax(-1) == lq.argmax(-1)).mean()),
            "nll_off": float(-lp[np.arange(len(tgt)), tgt].mean()), "nll_on": float(-lq[np.arange(len(tgt)), tgt].mean())}


@gpu
def test_quality_inside_the_a8_gate(cp, K, tiny):
    """2,048 held-out tokens on the trained tiny model: the route stays inside the a8 tier's accepted gate (mean KL
    2.5e-4, p99.9 1.8e-3, top-1 0.990, NLL within 5e-4: docs/QUANT.md); the CPU study expects 35-40x under it."""
    r = quality(K, *tiny)
    print(r)
    assert_in_a8_gate(r)


@gpu
def test_switch_off_keeps_todays_route(cp, K, tiny, monkeypatch):
    """Regression guard: with the switch off (set explicitly), a prefill launches today's kernels only (no bf16 GEMM
    output, no swiglu_tiles_zbf16*), and its every output -- logits, hidden rows, KV rows, GDN state, conv window,
    the MTP head's -- is bit for bit the same before and after a run with the switch on (the bf16 rows share the fp32
    route's "z" scratch: nothing of them may leak)."""
    from q27py.gpu import blas
    from q27py.gpu.forward import FastModel
    from q27py.gpu.runtime import Runtime

    weights, ids = tiny
    rt = Runtime.get()
    launched, gemm_out16 = [], []
    real_launch, real_gemm = rt.launch, blas.gemm_bf16

    def launch(module, kernel, *a, **kw):
        launched.append(kernel)
        return real_launch(module, kernel, *a, **kw)

    def gemm(*a, out_bf16=False, **kw):
        gemm_out16.append(out_bf16)
        return real_gemm(*a, out_bf16=out_bf16, **kw)

    monkeypatch.setattr(rt, "launch", launch)
    monkeypatch.setattr(blas, "gemm_bf16", gemm)
    model = FastModel(weights, max_context=PREFILL_TOKENS + 64, kv_dtype="bf16", chunk=512)
    prompt = ids[:PREFILL_TOKENS]

    def run(on: bool):
        launched.clear()
        gemm_out16.clear()
        with _switch(K, on):
            st = model.new_state()
            out = model.forward(st, prompt, logits_rows=np.arange(0, PREFILL_TOKENS, 7))
            got = {"logits": out.logits.copy(), "hidden": np.asarray(out.hidden).copy()}
            if model.has_mtp:  # the MTP warm-up's prefill-sized call
                lg, hm = model.mtp_forward(st.mtp_kv, got["hidden"], list(prompt[1:]) + [0], 0,
                                           logits_rows=np.arange(0, PREFILL_TOKENS, 11))
                got.update({"mtp_logits": lg, "mtp_hidden": hm})
            got.update({k: np.asarray(v) for k, v in model.export_prefix(st).items()})
        return got, list(launched), list(gemm_out16)

    off1, k1, g1 = run(False)
    on, k2, g2 = run(True)
    off2, k3, g3 = run(False)
    for ks, gs in ((k1, g1), (k3, g3)):
        assert not any(k.startswith("swiglu_tiles_zbf16") for k in ks), "a new kernel with the switch off"
        assert "swiglu_tiles_bf16" in ks and not any(gs), "today's SwiGLU route did not run"
    assert "swiglu_tiles_zbf16_bf16" in k2 and "swiglu_tiles_bf16" not in k2 and any(g2), "the route did not run"
    assert off1.keys() == off2.keys() == on.keys()
    for k in off1:
        a, b = np.asarray(off1[k]), np.asarray(off2[k])
        assert a.dtype == b.dtype and a.shape == b.shape, k
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=k)
    assert not np.array_equal(np.asarray(on["logits"]), np.asarray(off1["logits"]))


# ---------------------------------------------------------------- CPU checks (no GPU)
def check_switch_config(monkeypatch, field: str, env: str, module_default, bad: str) -> None:
    """A prefill switch that is on by default: EngineConfig's field True, the env's 1 / 0 mapped into it and a value
    that is neither refused, and the kernels module's default (`module_default()`) following the env."""
    from q27py.config import EngineConfig, Q27Config, apply_env

    assert getattr(EngineConfig(), field) is True  # q27py/config.py says since when and why
    assert getattr(apply_env(Q27Config(), {env: "1"}).engine, field) is True
    assert getattr(apply_env(Q27Config(), {env: "0"}).engine, field) is False
    with pytest.raises(ValueError):
        apply_env(Q27Config(), {env: bad})
    monkeypatch.delenv(env, raising=False)
    assert module_default() is True
    monkeypatch.setenv(env, "0")
    assert module_default() is False


def test_config_field_env_and_module_default(monkeypatch):
    from q27py.gpu import kernels as K

    check_switch_config(monkeypatch, "prefill_gate_up_bf16", "Q27_PREFILL_GATE_UP_BF16", K._prefill_gate_up_bf16_default,
                        "yes")


def _swiglu_matrix(C):
    return type("M", (), {"mode": C.MODE_SWIGLU, "nout": 17408,
                          "shape": type("S", (), {"row_tiles": 2176, "kpad": 5120})()})()


def test_route_launches_with_every_parameter(monkeypatch):
    """blas._gemm_expanded with z_bf16: one bf16-output GEMM (compute fp32, beta 0, ld = the tiles' rows) into the
    "z" scratch, then the SwiGLU kernel with as many arguments as it has parameters (cuda/ parsed) and a grid of
    8 outputs per thread; without it, today's launches."""
    from q27py.gpu import blas
    from q27py.gpu import constants as C
    from tests.gpu.test_decode_batch_layout import _params, _Recorder

    rec = _Recorder()
    rec.cp = np
    monkeypatch.setattr(blas.Runtime, "get", staticmethod(lambda: rec))
    monkeypatch.setattr(blas, "_SCRATCH", blas._Scratch())  # host scratch, never the process's device one
    gemms = []
    monkeypatch.setattr(blas, "gemm_bf16", lambda *a, **k: gemms.append((a, k)))
    m = _swiglu_matrix(C)
    x, ntok, nrows = object(), 3, 2176 * 16
    yb = np.zeros((ntok, 17408), np.uint16)
    blas._gemm_expanded(m, x, x, ntok, x, 17408, y_bf16=yb, z_bf16=True)
    z = blas._SCRATCH.bufs["z"]
    assert z.nbytes >= ntok * nrows * 2
    blas._gemm_expanded(m, x, x, ntok, x, 17408, z_bf16=True)
    assert blas._SCRATCH.bufs["z"] is z
    blas._gemm_expanded(m, x, x, ntok, x, 17408, y_bf16=yb)  # today's fp32 rows: the same scratch, grown
    assert [c.kernel for c in rec.calls] == ["swiglu_tiles_zbf16_bf16", "swiglu_tiles_zbf16", "swiglu_tiles_bf16"]
    for c in rec.calls:
        assert len(c.args) == _params(c.module, c.kernel), c.kernel
    assert rec.calls[0].grid == (-(-17408 // 2048), ntok) == (9, 3) and rec.calls[0].block == 256
    assert rec.calls[0].args[1] == nrows and rec.calls[0].args[2] == 17408 and rec.calls[0].args[-1] == 17408
    assert rec.calls[2].grid == (34, 3)
    for (a, k), out16 in zip(gemms, (True, True, False)):
        assert bool(k.get("out_bf16", False)) is out16
        assert k["accumulate"] is False and a[5] == nrows and a[8] == nrows  # nrows rows of C, ldc = nrows
    assert gemms[0][0][7] is z and rec.calls[0].args[0] is z  # the GEMM writes what SwiGLU reads
    with pytest.raises(AssertionError):
        blas._gemm_expanded(type("M", (), {"mode": C.MODE_STORE, "nout": 8, "shape": m.shape})(), x, x, 1, x, 8,
                            z_bf16=True)


def test_kernels_gemm_passes_the_switch_for_swiglu_only(monkeypatch):
    """kernels.gemm asks for the bf16 gate / up rows only with the switch on, only for the SwiGLU matrix, only on the
    cuBLAS bf16 route (the fp8 route and the mma.sync kernel never see it)."""
    from q27py.gpu import blas
    from q27py.gpu import constants as C
    from q27py.gpu import kernels as K

    seen = []
    monkeypatch.setattr(blas, "available", lambda: True)
    monkeypatch.setattr(blas, "prefill_gemm", lambda m, *a, **k: seen.append((m.mode, k.get("z_bf16"))))
    monkeypatch.setattr(K, "PREFILL_GEMM", "auto")
    sw = _swiglu_matrix(C)
    st = type("M", (), {"mode": C.MODE_STORE, "nout": 8, "shape": sw.shape})()
    for on in (False, True):
        monkeypatch.setattr(K, "PREFILL_GATE_UP_BF16", on)
        for m in (sw, st):
            K.gemm(m, None, 0, blas.MIN_TOKENS, None, 0)
    assert seen == [(C.MODE_SWIGLU, False), (C.MODE_STORE, False), (C.MODE_SWIGLU, True), (C.MODE_STORE, False)]


def device_quality(label: str, switch=_switch) -> None:
    """Print quality() for a prefill switch on the bundled model's q4s and q8 tiers (the device numbers for
    docs/QUANT.md; run as a script on a GPU)."""
    import json

    from q27py import DEFAULT_MODEL_DIR
    from q27py.gpu import kernels
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint
    from q27py.tokenizer import Tokenizer

    kernels.PREFILL_GEMM = "auto"
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "q27py" / "engine").glob("*.py")))
    ids = np.asarray(Tokenizer.from_model_dir(Path(DEFAULT_MODEL_DIR)).encode(text), dtype=np.int64)
    for tier in ("q4s", "q8"):
        w = from_checkpoint(Checkpoint.open(Path(DEFAULT_MODEL_DIR)), tier, progress=False)
        print(f"{label} quality, q36-tiny-agent {tier}:", json.dumps(quality(kernels, w, ids, switch=switch)),
              flush=True)


if __name__ == "__main__":
    device_quality("gate_up bf16")
