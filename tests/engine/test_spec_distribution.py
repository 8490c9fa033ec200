"""The sampled output distribution is the served one, through speculation (chi-square, many draws).

A Markov model on a 4-token vocabulary makes the exact law of the generated
tokens a product of table rows, and draws cheap. Its MTP head is
right only part of the time, so rounds accept, reject and stop mid-round.
"""

import itertools

import numpy as np
import pytest

from chi_square import critical_value, statistic
from markov_model import MarkovModel, StrictMarkovModel
from q27py.config import SpecConfig
from q27py.engine.api import SamplingParams
from q27py.engine.decoder import DecodeStats, Decoder
from q27py.engine.sampling import served_distribution
from q27py.engine.spec import SpecDecoder

VOCAB, LENGTH, WINDOW, DRAWS = 4, 5, 3, 2000
PROMPT = [0, 1, 0, 1, 0]  # repetitive: the suffix drafter fires too


def exact(model, params):
    """P(last WINDOW tokens of a LENGTH-token continuation) for every window value.

    Five tokens let one round verify three drafts (prefill decides the first);
    the window's first token is LENGTH-WINDOW+1 chain steps after the prompt's last.
    """
    step = np.zeros((VOCAB, VOCAB))
    for prev in range(VOCAB):
        ids, probs = served_distribution(model.table[prev], params)
        step[prev, ids] = probs
    lead = np.linalg.matrix_power(step, LENGTH - WINDOW + 1)[PROMPT[-1]]
    out = {}
    for seq in itertools.product(range(VOCAB), repeat=WINDOW):
        p = lead[seq[0]]
        for a, b in zip(seq, seq[1:]):
            p *= step[a, b]
        out[seq] = p
    return out


def sample_counts(model, decoder, params, draws=DRAWS):
    counts, stats = {}, DecodeStats()
    for seed in range(draws):
        sp = SamplingParams(**{**params.__dict__, "seed": seed})
        out = tuple(t for c in decoder.run(model.new_state(), PROMPT, LENGTH, sp, frozenset(), None, stats) for t in c)
        assert len(out) == LENGTH
        counts[out[-WINDOW:]] = counts.get(out[-WINDOW:], 0) + 1
    return counts, stats


def chi2_against(counts, probs):
    keys = list(probs)
    assert set(counts) <= {k for k in keys if probs[k] > 0}, "a draw has probability 0 under the served distribution"
    return statistic(np.array([counts.get(k, 0) for k in keys]), np.array([probs[k] for k in keys]))


@pytest.mark.parametrize("params,cfg", [
    (SamplingParams(temperature=1.0),
     SpecConfig(max_verify_width=4, max_depth=3, adaptive_depth=False, suffix_min_match=2)),
    (SamplingParams(temperature=1.0, top_k=3, top_p=0.9, min_p=0.1),
     SpecConfig(max_verify_width=4, max_depth=3, adaptive_depth=False, suffix_min_match=1, arbitration="agree")),
], ids=["plain-T1", "filtered-agree"])
def test_speculative_samples_follow_the_served_distribution(params, cfg):
    model = MarkovModel.random(VOCAB, seed=3, sharpness=0.7, mtp_noise=0.7)
    counts, stats = sample_counts(model, SpecDecoder(model, cfg), params)
    probs = exact(model, params)
    chi2, df = chi2_against(counts, probs)
    assert chi2 < critical_value(df), f"chi2 {chi2:.1f} over df {df}"
    # The draws went through speculation, with both outcomes of verification.
    d = stats.as_dict()
    assert d["rounds"] < DRAWS * LENGTH
    assert len(d["acceptance_by_depth"]) == 3
    assert all(0.1 < a < 0.95 for a in d["acceptance_by_depth"])
    assert d["rounds_by_source"]["mtp"] > 0 and d["rounds_by_source"]["suffix"] > 0
    # Power: the same counts are rejected against the unfiltered / untempered chain.
    wrong = exact(model, SamplingParams(temperature=1.3))
    chi2_wrong, df_wrong = statistic(np.array([counts.get(k, 0) for k in wrong]), np.array(list(wrong.values())))
    assert chi2_wrong > critical_value(df_wrong)


def test_speculative_and_plain_draws_are_the_same_draws():
    """Not just the same distribution: the same seed gives the same tokens, draw by draw."""
    model = MarkovModel.random(VOCAB, seed=5, sharpness=1.0, mtp_noise=1.0)
    params = SamplingParams(temperature=1.0, top_p=0.95)
    cfgs = [SpecConfig(max_verify_width=w, max_depth=min(max(w - 1, 1), 7), adaptive_depth=False, suffix_min_match=2)
            for w in (1, 2, 4, 8)]
    for seed in range(150):
        sp = SamplingParams(**{**params.__dict__, "seed": seed})
        want = [t for c in Decoder(model).run(model.new_state(), PROMPT, 6, sp) for t in c]
        for cfg in cfgs:
            assert [t for c in SpecDecoder(model, cfg).run(model.new_state(), PROMPT, 6, sp) for t in c] == want


def test_decoders_keep_the_fast_paths_usage_rules():
    """Commit right after its verify; hidden rows read before the next model call."""
    model = StrictMarkovModel.random(VOCAB, seed=7, sharpness=1.0, mtp_noise=1.0)
    prompt = PROMPT * 3
    for cfg in (SpecConfig(), SpecConfig(arbitration="suffix_first", suffix_min_match=1, max_verify_width=6),
                SpecConfig(suffix=False, max_depth=7, adaptive_depth=False)):
        for seed in range(20):
            sp = SamplingParams(temperature=1.0, seed=seed)
            want = [t for c in Decoder(model).run(model.new_state(), prompt, 12, sp) for t in c]
            assert [t for c in SpecDecoder(model, cfg).run(model.new_state(), prompt, 12, sp) for t in c] == want
