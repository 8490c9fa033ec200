"""Pearson's chi-square goodness of fit without scipy (tests only: numpy + pytest)."""

from __future__ import annotations

import math

import numpy as np

Z_1E4 = 3.7190164854556804  # standard normal quantile for an upper tail of 1e-4


def critical_value(df: int, z: float = Z_1E4) -> float:
    """Upper quantile of chi-square(df) by the Wilson-Hilferty cube approximation (good for df >= 3)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def statistic(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """(chi-square, degrees of freedom); cells expected below min_expected are pooled into one."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    n = counts.sum()
    assert abs(probs.sum() - 1.0) < 1e-9, "probabilities must sum to 1"
    # A draw in a cell of probability 0 is a hard failure, never averaged away.
    assert not np.any((probs == 0) & (counts > 0)), "a draw landed on a token of probability 0"
    expected = probs * n
    big = expected >= min_expected
    obs = list(counts[big])
    exp = list(expected[big])
    if (~big).any() and expected[~big].sum() > 0:
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    obs, exp = np.array(obs), np.array(exp)
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1
