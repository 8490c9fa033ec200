"""The fast forward (q27py/gpu/forward.py) against the numpy reference and the golden fixtures.

Tolerances: bf16 tier (weights exactly the checkpoint's): max |Δlogit| <= 1e-3 x the logit
scale, against transformers' goldens and the reference; greedy tokens must agree wherever the
golden margin is above 1e-2. Quantized tiers track the bf16 tier loosely (stated per test).
Bitwise: verify lanes == decode steps, commit(n) == n decode steps, lanes independent of the
verify width, graph replays == eager runs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.gpu

CASES = ["rand-a", "rand-c-vl-layout", "q36-tiny-code"]


def close(got, want, factor=1e-3):
    scale = float(np.abs(want).max())
    err = float(np.abs(np.asarray(got, np.float64) - want).max())
    assert err <= factor * scale, f"max |Δ| {err:.3g} > {factor} x scale {scale:.3g}"


def build(model_dir, tier="bf16", kv="f32", chunk=64, max_context=512):
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint

    ckpt = Checkpoint.open(model_dir)
    return FastModel(from_checkpoint(ckpt, tier, progress=False), max_context=max_context, kv_dtype=kv, chunk=chunk)


@pytest.fixture(scope="module", params=CASES)
def golden(request, fixtures_dir):
    base = fixtures_dir / "golden" / request.param
    model_dir = base
    if request.param == "q36-tiny-code":  # no longer the bundled model: its checkpoint lives in ../shared/models
        model_dir = fixtures_dir.parent / "models" / "q36-tiny-code"
        if not model_dir.is_dir():
            pytest.skip(f"{model_dir} not found (carry ../shared/models/q36-tiny-code beside the fixtures)")
    gold = dict(np.load(base / "golden.npz"))
    meta = json.loads((base / "golden.json").read_text())
    return request.param, build(model_dir), gold, meta


def test_prefill_logits_and_hidden(golden):
    name, model, gold, meta = golden
    st = model.new_state()
    out = model.forward(st, gold["prompt_ids"], logits_rows=gold["prefill_logits_positions"])
    close(out.logits, gold["prefill_logits"])
    close(out.hidden[-1], gold["hidden_last_position"][-1])
    assert int(np.argmax(out.logits[-1])) == meta["pending_after_prompt"] or meta.get("decode_margins", [1])[0] < 1e-2


def test_greedy_decode_steps(golden):
    name, model, gold, meta = golden
    st = model.new_state()
    model.forward(st, gold["prompt_ids"], logits_rows="last")
    tokens = gold["decode_tokens"]
    for i, tok in enumerate(tokens):
        logits = model.forward(st, [tok]).logits[0]
        close(logits, gold["decode_logits"][i])
        if i + 1 < len(tokens) and meta["decode_margins"][i] > 1e-2:
            assert int(np.argmax(logits)) == tokens[i + 1]


def test_mtp_draft_chain(golden):
    name, model, gold, meta = golden
    if not model.has_mtp:
        pytest.skip("no MTP head")
    ids = gold["prompt_ids"]
    st = model.new_state()
    out = model.forward(st, ids, logits_rows="last")
    next_ids = np.concatenate([ids[1:], [meta["pending_after_prompt"]]])
    logits, hm = model.mtp_forward(st.mtp_kv, out.hidden, next_ids, 0)
    step_logits, h, tok = [logits[-1]], hm[-1:], int(np.argmax(logits[-1]))
    for k in range(1, len(gold["mtp_drafts"])):
        lg, h = model.mtp_forward(st.mtp_kv, h, [tok], len(ids) - 1 + k)
        tok = int(np.argmax(lg[0]))
        step_logits.append(lg[0])
    close(np.stack(step_logits), gold["mtp_logits"])


@pytest.fixture(scope="module")
def tiny():
    return build(DEFAULT_MODEL_DIR, chunk=16)


def prompt():
    return [int(x) for x in np.random.default_rng(0).integers(0, 16000, 37)]


def test_chunked_prefill_matches_reference(tiny):
    from q27py.model.reference import ReferenceModel

    ref = ReferenceModel.load(DEFAULT_MODEL_DIR)
    ids = prompt()  # 37 tokens: chunks of 16, 16, 5
    st = tiny.new_state()
    got = tiny.forward(st, ids, logits_rows="last").logits
    want = ref.forward(ref.new_state(), ids, logits_rows="last").logits
    close(got, want)
    assert st.position == len(ids)


def test_verify_commit_equals_decode_bitwise(tiny):
    ids = prompt()
    drafts = [11, 12, 13, 14, 15]
    a, b = tiny.new_state(), tiny.new_state()
    tiny.forward(a, ids, logits_rows="last")
    tiny.forward(b, ids, logits_rows="last")
    dec = [tiny.forward(a, [t]).logits[0] for t in drafts]
    ver = tiny.forward(b, drafts, verify=True)
    for i in range(len(drafts)):
        np.testing.assert_array_equal(ver.logits[i], dec[i])
    tiny.commit(b, ver.trace, 3)
    assert b.position == len(ids) + 3
    # continue both from 3 committed tokens: states must be identical
    a2 = tiny.new_state()
    tiny.forward(a2, ids, logits_rows="last")
    for t in drafts[:3]:
        tiny.forward(a2, [t])
    np.testing.assert_array_equal(b.gdn.get(), a2.gdn.get())
    np.testing.assert_array_equal(b.window.get(), a2.window.get())
    np.testing.assert_array_equal(tiny.forward(b, [99]).logits, tiny.forward(a2, [99]).logits)


def test_verify_lanes_are_width_invariant(tiny):
    ids = prompt()
    lanes = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]
    results = {}
    for w in (1, 2, 5, 8, 9, 12):
        st = tiny.new_state()
        tiny.forward(st, ids, logits_rows="last")
        results[w] = tiny.forward(st, lanes[:w], verify=True).logits
    for w, lg in results.items():
        np.testing.assert_array_equal(lg, results[12][:w])


def test_graph_replay_matches_eager():
    model = build(DEFAULT_MODEL_DIR, chunk=16)
    eager = build(DEFAULT_MODEL_DIR, chunk=16)
    model.enable_graphs()
    ids = prompt()
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


@pytest.mark.parametrize("tier,factor", [("q8", 0.05), ("q4s", 0.3), ("q5f", 0.3)])
def test_quantized_tiers_track_bf16(tiny, tier, factor):
    q = build(DEFAULT_MODEL_DIR, tier=tier, kv="bf16", chunk=16)
    ids = prompt()
    want = tiny.forward(tiny.new_state(), ids, logits_rows="last").logits
    got = q.forward(q.new_state(), ids, logits_rows="last").logits
    assert np.isfinite(got).all()
    close(got, want, factor)


def test_unsupported_dims_are_refused(fixtures_dir):
    from q27py.errors import ConfigError

    with pytest.raises(ConfigError):
        build(fixtures_dir / "golden" / "rand-b")  # head_dim 16


def test_engine_cuda_greedy_equals_reference_engine():
    """The engine on --device cuda (speculative rounds: MTP drafts, verify widths that vary, commits)
    emits the reference engine's greedy tokens: lanes are width-invariant and commit == decode."""
    from q27py.bench.shortbench import chat_prompt
    from q27py.config import Q27Config
    from q27py.engine.api import GenerationRequest
    from q27py.engine.engine import LocalEngine

    outs = {}
    for device in ("cpu", "cuda"):
        cfg = Q27Config()
        cfg.engine.device = device
        eng = LocalEngine.load(cfg)
        ids = eng.tokenizer.encode(chat_prompt("Write a Python function `flatten(items)`: Flatten a nested list into a flat list."))
        toks = []
        for chunk in eng.generate(GenerationRequest(prompt_ids=ids, max_tokens=32)):
            toks.extend(chunk.token_ids)
        outs[device] = toks
    assert outs["cuda"] == outs["cpu"]


def test_state_buffers_are_filled_on_the_model_stream(tiny, monkeypatch):
    """FastState zero-fills on the model's (non-blocking) stream: fills on the legacy stream were not
    ordered before the first forward's KV stores (a race the attn_probe hit, issue 17)."""
    import cupy as cp

    seen = []
    real = cp.zeros

    def spy(*a, **k):
        seen.append(cp.cuda.get_current_stream().ptr)
        return real(*a, **k)

    monkeypatch.setattr(cp, "zeros", spy)
    tiny.new_state()
    assert seen and set(seen) == {tiny.stream.ptr}
