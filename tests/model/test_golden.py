"""The reference model against transformers' own numbers (../shared/fixtures/golden).

Tolerance: max |Δlogit| <= 1e-4 x the logit scale (max |logit|) of the fixture.
Greedy choices are compared where the fixture's top1-top2 margin is not a tie.
"""

import json

import numpy as np
import pytest

from q27py.model.reference import ReferenceModel

CASES = ["rand-a", "rand-b", "rand-c-vl-layout", "q36-tiny-code"]


def _load(fixtures_dir, name):
    base = fixtures_dir / "golden" / name
    model_dir = base if name != "q36-tiny-code" else fixtures_dir.parent / "models" / "q36-tiny-code"
    gold = dict(np.load(base / "golden.npz"))
    meta = json.loads((base / "golden.json").read_text())
    return ReferenceModel.load(model_dir), gold, meta


def _close(got, want):
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max())
    assert err <= 1e-4 * scale, f"max |Δ| {err:.3g} > 1e-4 x scale {scale:.3g}"


@pytest.fixture(scope="module", params=CASES)
def golden(request, fixtures_dir):
    return (request.param,) + _load(fixtures_dir, request.param)


def test_prefill_logits(golden):
    name, model, gold, meta = golden
    st = model.new_state()
    out = model.forward(st, gold["prompt_ids"], logits_rows=gold["prefill_logits_positions"])
    _close(out.logits, gold["prefill_logits"])
    assert int(np.argmax(model.forward(model.new_state(), gold["prompt_ids"], logits_rows="last").logits[-1])) == meta["pending_after_prompt"]


def test_hidden_states_last_position(golden):
    name, model, gold, meta = golden
    st = model.new_state()
    out = model.forward(st, gold["prompt_ids"], logits_rows="last")
    _close(out.hidden[-1], gold["hidden_last_position"][-1])


def test_greedy_decode_steps(golden):
    name, model, gold, meta = golden
    st = model.new_state()
    model.forward(st, gold["prompt_ids"], logits_rows="last")
    tokens = gold["decode_tokens"]
    assert tokens[0] == meta["pending_after_prompt"]
    for i, tok in enumerate(tokens):
        logits = model.forward(st, [tok]).logits[0]
        _close(logits, gold["decode_logits"][i])
        if i + 1 < len(tokens) and meta["decode_margins"][i] > 1e-3:
            assert int(np.argmax(logits)) == tokens[i + 1]


def test_mtp_draft_chain(golden):
    name, model, gold, meta = golden
    ids = gold["prompt_ids"]
    st = model.new_state()
    out = model.forward(st, ids, logits_rows="last")
    pending = meta["pending_after_prompt"]
    next_ids = np.concatenate([ids[1:], [pending]])
    logits, hm = model.mtp_forward(st.mtp_kv, out.hidden, next_ids, 0)
    step_logits, h, tok = [logits[-1]], hm[-1:], int(np.argmax(logits[-1]))
    drafts = [tok]
    for k in range(1, len(gold["mtp_drafts"])):
        lg, h = model.mtp_forward(st.mtp_kv, h, [tok], len(ids) - 1 + k)
        tok = int(np.argmax(lg[0]))
        step_logits.append(lg[0])
        drafts.append(tok)
    _close(np.stack(step_logits), gold["mtp_logits"])
    assert drafts == [int(x) for x in gold["mtp_drafts"]]
