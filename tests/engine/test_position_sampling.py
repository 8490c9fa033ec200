"""engine/sampling.py: the served distribution, the position-keyed randomness, the coupling."""

import numpy as np
import pytest

from chi_square import critical_value, statistic
from q27py.engine.api import SamplingParams
from q27py.engine.sampling import PositionSampler, draw, position_uniform, served_distribution, top_ranked, validate
from q27py.errors import ConfigError


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _brute_force(logits, p: SamplingParams) -> np.ndarray:
    """The served distribution over the whole vocabulary, by the definitions, token by token."""
    probs = _softmax(np.asarray(logits, np.float64) / p.temperature)
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    if p.top_k > 0:
        order = order[: p.top_k]
    kept = probs[order] / probs[order].sum()
    if p.top_p < 1.0:
        mass, n = 0.0, 0
        while n < len(kept) and mass < p.top_p:
            mass += kept[n]
            n += 1
        order, kept = order[:n], kept[:n]
    if p.min_p > 0:
        n = sum(1 for x in kept if x >= p.min_p * kept[0])
        order = order[:n]
    out = np.zeros(len(probs))
    out[order] = probs[order] / probs[order].sum()
    return out


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("params", PARAMS)
def test_served_distribution_matches_definitions(params):
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(size=40) * 2.0
        ids, probs = served_distribution(logits, params)
        got = np.zeros(40)
        got[ids] = probs
        np.testing.assert_allclose(got, _brute_force(logits, params), rtol=1e-12, atol=1e-15)
        assert np.all(np.diff(ids) > 0), "kept ids are drawn in ascending id order"


@pytest.mark.parametrize("params", PARAMS + [SamplingParams(temperature=2.0, top_k=300), SamplingParams(temperature=3.0, top_p=0.99)])
def test_large_vocabulary_kept_set(params):
    """Kept sets larger than the first ranked block (the nucleus search widens it)."""
    logits = np.random.default_rng(4).normal(size=3000) * 1.5
    ids, probs = served_distribution(logits, params)
    got = np.zeros(3000)
    got[ids] = probs
    np.testing.assert_allclose(got, _brute_force(logits, params), rtol=1e-9, atol=1e-15)
    assert np.all(np.diff(ids) > 0)


def test_top_ranked_breaks_ties_by_id():
    p = np.array([0.5, 1.0, 0.5, 0.2, 0.5, 1.0])
    assert top_ranked(p, 3).tolist() == [1, 5, 0]
    assert top_ranked(p, 4).tolist() == [1, 5, 0, 2]
    assert top_ranked(p, 6).tolist() == [1, 5, 0, 2, 4, 3]


def test_ties_at_the_top_k_boundary_keep_the_lowest_ids_and_greedy_takes_the_lowest():
    logits = np.array([0.0, 3.0, 1.0, 3.0, 3.0])
    ids, probs = served_distribution(logits, SamplingParams(temperature=1.0, top_k=2))
    assert list(ids) == [1, 3] and np.allclose(probs, 0.5)
    greedy = PositionSampler(SamplingParams(), seed=5)
    assert {greedy.pick(logits, q) for q in range(50)} == {1}


def test_uniform_is_a_pure_function_of_seed_and_position():
    assert position_uniform(7, 123) == position_uniform(7, 123)
    u = np.array([position_uniform(7, q) for q in range(20000)])
    assert u.min() >= 0.0 and u.max() < 1.0
    assert len(set(u.tolist())) == u.size
    assert position_uniform(7, 123) != position_uniform(8, 123)
    counts = np.histogram(u, bins=32, range=(0, 1))[0]
    chi2, df = statistic(counts, np.full(32, 1 / 32))
    assert chi2 < critical_value(df)
    # Neighbouring positions and neighbouring seeds are not correlated.
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.05
    v = np.array([position_uniform(8, q) for q in range(20000)])
    assert abs(np.corrcoef(u, v)[0, 1]) < 0.05


@pytest.mark.parametrize("params", PARAMS[1:])
def test_draws_follow_the_served_distribution(params):
    """Many positions of one logits row: the empirical distribution is the served one."""
    logits = np.random.default_rng(1).normal(size=12) * 1.5
    sampler = PositionSampler(params, seed=11)
    counts = np.bincount([sampler.pick(logits, q) for q in range(6000)], minlength=12)
    want = _brute_force(logits, params)
    chi2, df = statistic(counts, want)
    assert chi2 < critical_value(max(df, 1))
    # Power: the same draws are far from the unfiltered distribution.
    unfiltered = _softmax(logits / params.temperature)
    counts_ok = np.where(want > 0, counts, 0)
    assert counts_ok.sum() == counts.sum(), "no draw outside the kept set"
    chi2_bad = ((counts - unfiltered * counts.sum()) ** 2 / (unfiltered * counts.sum())).sum()
    assert chi2_bad > critical_value(11)


def test_draw_inverse_cdf_edges():
    ids, probs = np.array([4, 2, 9]), np.array([0.5, 0.3, 0.2])
    assert draw(ids, probs, 0.0) == 4
    assert draw(ids, probs, 0.49) == 4
    assert draw(ids, probs, 0.5) == 2
    assert draw(ids, probs, 0.81) == 9
    assert draw(ids, probs, 1.0 - 1e-16) == 9


def test_unseeded_sampler_still_has_one_seed():
    s = PositionSampler(SamplingParams(temperature=1.0))
    logits = np.zeros(1000)
    assert s.pick(logits, 5) == s.pick(logits, 5)
    assert PositionSampler(SamplingParams(temperature=1.0, seed=4)).seed == 4


@pytest.mark.parametrize("bad", [
    SamplingParams(temperature=-1), SamplingParams(top_p=0.0), SamplingParams(top_p=1.5),
    SamplingParams(top_k=-2), SamplingParams(min_p=1.5),
])
def test_validate_rejects_meaningless_settings(bad):
    with pytest.raises(ConfigError):
        validate(bad)
