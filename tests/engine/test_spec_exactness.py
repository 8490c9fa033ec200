"""Speculative output == plain output, token for token: greedy for every width / depth / drafter
setting, sampled for every seed. Also: the final state equals plain decoding's, bitwise."""

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.config import SpecConfig
from q27py.engine.api import SamplingParams
from q27py.engine.decoder import DecodeStats, Decoder
from q27py.engine.spec import SpecDecoder
from q27py.model.reference import ReferenceModel
from q27py.tokenizer import Tokenizer
from test_spec_rollback import assert_same_state

CHAT = "<|im_start|>user\nWrite a Python function `{}`: {}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
PROMPTS = [
    CHAT.format("merge_intervals(intervals)", "Merge overlapping intervals and return them sorted."),
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    # Repetitive: the suffix drafter fires.
    "x = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2",
    "def setup(self, a, b, c, d):\n    self.a = a\n    self.b = b\n    self.c = c\n    self",
]

SETTINGS = {
    "default": SpecConfig(),
    "w2-d1-mtp": SpecConfig(max_verify_width=2, max_depth=1, suffix=False),
    "w16-d7-fixed": SpecConfig(max_verify_width=16, max_depth=7, adaptive_depth=False, suffix_min_match=2),
    "w5-gated": SpecConfig(max_verify_width=5, confidence_margin=3.0),
    "agree": SpecConfig(arbitration="agree", max_verify_width=12, suffix_min_match=3),
    "w1": SpecConfig(max_verify_width=1),
    "suffix-eager": SpecConfig(max_verify_width=16, max_depth=2, suffix_min_match=1),
}

MAX_TOKENS = 20


@pytest.fixture(scope="module")
def model():
    return ReferenceModel.load(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def prompts():
    tok = Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)
    return [tok.encode(p) for p in PROMPTS]


def generate(decoder, model, ids, sampling=SamplingParams(), max_tokens=MAX_TOKENS, stop_ids=frozenset()):
    state, stats, out = model.new_state(), DecodeStats(record_trace=True), []
    chunks = list(decoder.run(state, ids, max_tokens, sampling, stop_ids, None, stats))
    for c in chunks:
        out.extend(c)
    return out, state, stats, chunks


@pytest.fixture(scope="module")
def plain_greedy(model, prompts):
    return [generate(Decoder(model), model, ids) for ids in prompts]


@pytest.fixture(scope="module")
def greedy_runs(model, prompts):
    """Every setting on every prompt, run once: {setting: [(output, state, stats), ...]}."""
    return {name: [generate(SpecDecoder(model, cfg), model, ids)[:3] for ids in prompts] for name, cfg in SETTINGS.items()}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_greedy_speculation_is_token_identical(greedy_runs, plain_greedy, name):
    for (got, state, _), (want, plain_state, _, _) in zip(greedy_runs[name], plain_greedy):
        assert got == want, f"{name}: speculative output differs from plain greedy"
        # The committed state is the plain decoder's, bitwise (MTP rows aside: plain has none).
        spec_state, plain_cmp = state.snapshot(), plain_state.snapshot()
        spec_state.mtp_kv = plain_cmp.mtp_kv = None
        assert_same_state(spec_state, plain_cmp)
        assert state.hidden_last.tobytes() == plain_state.hidden_last.tobytes()


def test_greedy_sweep_exercised_every_path(greedy_runs):
    """The sweep saw rejections, full accepts, both drafters and the confidence gate."""
    rounds = [r for runs in greedy_runs.values() for _, _, stats in runs for r in stats.trace[1:]]
    assert sum(r["accepted"] <= len(r["drafts"]) for r in rounds) > 10  # a draft was rejected
    assert sum(len(r["drafts"]) > 0 and r["accepted"] == len(r["drafts"]) + 1 for r in rounds) > 10
    assert sum(r["source"] == "suffix" for r in rounds) > 5 and sum(r["source"] == "mtp" for r in rounds) > 20
    gated = [stats for _, _, stats in greedy_runs["w5-gated"]]
    assert sum(s.rounds_by_source["none"] for s in gated) > len(gated) * 2


def test_greedy_without_an_mtp_head_uses_the_suffix_drafter(prompts, plain_greedy):
    model = ReferenceModel.load(DEFAULT_MODEL_DIR)
    model.has_mtp = False
    for ids, (want, *_) in zip(prompts, plain_greedy):
        got, state, stats, _ = generate(SpecDecoder(model, SpecConfig(suffix_min_match=3)), model, ids)
        assert got == want and state.mtp_kv is None
        assert stats.rounds_by_source["mtp"] == 0


def test_greedy_on_a_random_model_where_drafts_mostly_fail(fixtures_dir):
    """rand-b's MTP head is random: nearly every draft is rejected, output still identical."""
    model = ReferenceModel.load(fixtures_dir / "golden" / "rand-b")
    rng = np.random.default_rng(0)
    for _ in range(2):
        ids = rng.integers(0, model.cfg.vocab_size, size=int(rng.integers(3, 30))).tolist()
        want = generate(Decoder(model), model, ids, max_tokens=16)[0]
        for cfg in (SpecConfig(max_verify_width=8, max_depth=7, adaptive_depth=False), SpecConfig(suffix_min_match=1)):
            assert generate(SpecDecoder(model, cfg), model, ids, max_tokens=16)[0] == want


def test_mtp_rows_stay_warm_through_rounds(model, prompts):
    """After a run the MTP KV holds rows 0..P-2, each pairing the right hidden with the right
    next token: equal (to rounding) to one MTP pass over the whole committed sequence."""
    ids = prompts[3]
    out, state, _, _ = generate(SpecDecoder(model, SETTINGS["default"]), model, ids)
    seq = ids + out
    p = state.position
    assert p == len(seq) - 1 and state.mtp_kv.length == p - 1
    ref = model.new_state()
    h = model.forward(ref, seq[:p], logits_rows="last").hidden
    model.mtp_forward(ref.mtp_kv, h[: p - 1], seq[1:p], 0)
    np.testing.assert_allclose(state.mtp_kv.k[: p - 1], ref.mtp_kv.k[: p - 1], rtol=0, atol=2e-5)
    np.testing.assert_allclose(state.mtp_kv.v[: p - 1], ref.mtp_kv.v[: p - 1], rtol=0, atol=2e-5)


SAMPLED = [  # (prompt index, sampling)
    (0, SamplingParams(temperature=0.8, top_p=0.95, seed=1)),
    (2, SamplingParams(temperature=1.0, seed=2)),
    (3, SamplingParams(temperature=0.6, top_k=20, min_p=0.05, seed=3)),
]


@pytest.mark.parametrize("prompt,sampling", SAMPLED, ids=lambda s: f"T{s.temperature}-seed{s.seed}" if hasattr(s, "seed") else str(s))
def test_same_seed_same_output_whatever_the_speculation(model, prompts, prompt, sampling):
    ids = prompts[prompt]
    want = generate(Decoder(model), model, ids, sampling)[0]
    outputs = {}
    for name in ("default", "w2-d1-mtp", "suffix-eager"):
        outputs[name] = generate(SpecDecoder(model, SETTINGS[name]), model, ids, sampling)[0]
    assert all(o == want for o in outputs.values()), outputs


def test_the_seed_matters(model, prompts):
    runs = {tuple(generate(Decoder(model), model, prompts[1], SamplingParams(temperature=1.5, seed=s))[0]) for s in range(3)}
    assert len(runs) >= 2


def test_resuming_a_kept_state_continues_exactly_with_warm_mtp_rows(model, prompts):
    """Prefix reuse: a state kept from an earlier request resumes (prompt tokens before
    state.position are not prefilled again), with the MTP rows still in step."""
    first, state, _, _ = generate(SpecDecoder(model, SETTINGS["default"]), model, prompts[1])
    assert state.mtp_kv.length == state.position - 1  # the at-rest invariant
    follow_up = prompts[1] + first + prompts[3]
    kept = state.snapshot()
    want_state, want_stats = state.snapshot(), DecodeStats()
    want = [t for c in Decoder(model).run(want_state, follow_up, 16, SamplingParams(), frozenset(), None, want_stats) for t in c]
    stats = DecodeStats()
    got = [t for c in SpecDecoder(model, SETTINGS["default"]).run(kept, follow_up, 16, SamplingParams(), frozenset(), None, stats) for t in c]
    assert got == want
    assert stats.mtp_steps > 0, stats.as_dict()
    seq = follow_up + got
    p = kept.position
    ref = model.new_state()
    h = model.forward(ref, seq[:p], logits_rows="last").hidden
    model.mtp_forward(ref.mtp_kv, h[: p - 1], seq[1:p], 0)
    np.testing.assert_allclose(kept.mtp_kv.k[: p - 1], ref.mtp_kv.k[: p - 1], rtol=0, atol=5e-5)
