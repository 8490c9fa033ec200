"""Stopping (EOS ids mid-round, max_tokens mid-round, cancel) and statistics that are computed
from what happened (recomputed here from the trace and the output)."""

import threading
from collections import Counter

import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.config import SpecConfig
from q27py.engine.api import SamplingParams
from q27py.engine.decoder import DecodeStats, Decoder
from q27py.engine.spec import SpecDecoder
from q27py.model.reference import ReferenceModel
from q27py.tokenizer import Tokenizer
from test_spec_rollback import assert_same_state

REPEAT = "x = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2"
CODE = "def area(shape):\n    if shape.kind == 'circle':\n        return"
WIDE = SpecConfig(max_verify_width=16, max_depth=3, suffix_min_match=2)


@pytest.fixture(scope="module")
def model():
    return ReferenceModel.load(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)


def run(decoder, model, ids, max_tokens, stop_ids=frozenset(), sampling=SamplingParams(), cancel=None):
    state, stats = model.new_state(), DecodeStats(record_trace=True)
    chunks = []
    for c in decoder.run(state, ids, max_tokens, sampling, stop_ids, cancel, stats):
        chunks.append(list(c))
    return chunks, state, stats


def _without_mtp(state):
    s = state.snapshot()
    s.mtp_kv = None
    return s


def test_eos_inside_a_round_ends_the_output_there(model, tok):
    ids = tok.encode(REPEAT)
    plain = [t for c in run(Decoder(model), model, ids, 20)[0] for t in c]
    stop = plain[5]  # the first "1" the model writes, deep inside a suffix round
    j = plain.index(stop)
    want = plain[: j + 1]
    pchunks, pstate, _ = run(Decoder(model), model, ids, 20, frozenset({stop}))
    chunks, state, stats = run(SpecDecoder(model, WIDE), model, ids, 20, frozenset({stop}))
    assert [t for c in chunks for t in c] == want == [t for c in pchunks for t in c]
    last = stats.trace[-1]
    # It really was mid-round: the stop token was an accepted draft with more drafts after it.
    assert len(last["drafts"]) > last["accepted"] and last["drafts"][last["accepted"] - 1] == stop
    # The stop token is emitted but never run through the model, as in plain decoding.
    assert state.position == len(ids) + len(want) - 1
    assert_same_state(_without_mtp(state), _without_mtp(pstate))
    # A consumer that stops iterating at the EOS chunk (as LocalEngine does) still leaves
    # the MTP rows at rest: written up to position-2, ready for prefix reuse.
    early = model.new_state()
    for chunk in SpecDecoder(model, WIDE).run(early, ids, 20, SamplingParams(), frozenset({stop}), None, DecodeStats()):
        if stop in chunk:
            break
    assert early.position == state.position and early.mtp_kv.length == early.position - 1


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 6, 11, 17])
def test_max_tokens_is_never_exceeded(model, tok, max_tokens):
    ids = tok.encode(REPEAT)
    plain_chunks, pstate, _ = run(Decoder(model), model, ids, max_tokens)
    chunks, state, stats = run(SpecDecoder(model, WIDE), model, ids, max_tokens)
    out = [t for c in chunks for t in c]
    assert out == [t for c in plain_chunks for t in c] and len(out) == max_tokens
    produced = 0
    for entry, chunk in zip(stats.trace, chunks):
        # No round drafts past what may still be emitted (a draft past the limit is wasted work).
        assert len(entry["drafts"]) <= max_tokens - produced - 1 or produced == 0
        produced += len(chunk)
        assert produced <= max_tokens
    assert_same_state(_without_mtp(state), _without_mtp(pstate))


def test_max_tokens_zero_and_cancel(model, tok):
    ids = tok.encode(CODE)
    assert run(SpecDecoder(model, WIDE), model, ids, 0)[0] == []
    cancel = threading.Event()
    gen = SpecDecoder(model, WIDE).run(model.new_state(), ids, 50, SamplingParams(), frozenset(), cancel, DecodeStats())
    first = next(gen)
    cancel.set()
    assert list(gen) == [] and len(first) == 1
    cancel_early = threading.Event()
    cancel_early.set()
    assert run(SpecDecoder(model, WIDE), model, ids, 50, cancel=cancel_early)[0] == []


def _recompute(stats, chunks):
    """Statistics rebuilt from the trace + the emitted tokens alone."""
    out = [t for c in chunks for t in c]
    assert [e["accepted"] for e in stats.trace] == [len(c) for c in chunks]
    proposed, accepted = Counter(), Counter()
    pos = 0
    for e in stats.trace:
        emitted = out[pos : pos + e["accepted"]]
        k = 0
        while k < len(e["drafts"]) and k < len(emitted) and e["drafts"][k] == emitted[k]:
            k += 1
        for d in range(len(e["drafts"])):
            proposed[d] += 1
            accepted[d] += d < k
        pos += e["accepted"]
    depth = max(proposed, default=-1) + 1
    return {
        "generated": len(out),
        "rounds": len(stats.trace),
        "by_source": Counter(e["source"] for e in stats.trace),
        "acceptance": [accepted[d] / proposed[d] for d in range(depth)],
        "lanes": sum(1 + len(e["drafts"]) for e in stats.trace[1:]),
    }


@pytest.mark.parametrize("text,cfg,sampling", [
    (REPEAT, WIDE, SamplingParams()),
    (CODE, SpecConfig(max_depth=5, adaptive_depth=False, suffix=False), SamplingParams()),
    (CODE, SpecConfig(), SamplingParams(temperature=0.8, seed=4)),
], ids=["repeat-wide", "code-mtp5", "code-sampled"])
def test_statistics_are_what_happened(model, tok, text, cfg, sampling):
    chunks, _, stats = run(SpecDecoder(model, cfg), model, tok.encode(text), 24, sampling=sampling)
    want = _recompute(stats, chunks)
    d = stats.as_dict()
    assert stats.generated == want["generated"] == 24
    assert d["rounds"] == want["rounds"] and d["tokens_per_round"] == pytest.approx(24 / want["rounds"])
    assert d["rounds_by_source"] == {s: want["by_source"].get(s, 0) for s in ("none", "mtp", "suffix")}
    assert d["share_by_source"]["mtp"] == pytest.approx(want["by_source"].get("mtp", 0) / want["rounds"])
    assert d["acceptance_by_depth"] == pytest.approx(want["acceptance"])
    assert d["verify_lanes"] == want["lanes"]
    assert d["trace"] == stats.trace
    assert d["rounds"] < 24, "speculation committed several tokens in some rounds"
    mtp_rounds = want["by_source"].get("mtp", 0)
    assert d["mtp_steps"] >= mtp_rounds


def test_plain_decoder_statistics_and_trace(model, tok):
    chunks, _, stats = run(Decoder(model), model, tok.encode(CODE), 7)
    d = stats.as_dict()
    assert d["rounds"] == 7 and d["tokens_per_round"] == 1.0 and d["rounds_by_source"]["none"] == 7
    # (lanes: main-model rows of the round -- the first token comes from the prefill, the rest from
    # one decode lane each; mtp_steps: MTP passes. Recorded for the trace replay bench.)
    assert d["trace"] == ([{"source": "none", "drafts": [], "accepted": 1, "lanes": 0, "mtp_steps": 0}] +
                          [{"source": "none", "drafts": [], "accepted": 1, "lanes": 1, "mtp_steps": 0}] * 6)
    assert "trace" not in DecodeStats().as_dict()
