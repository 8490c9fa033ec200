"""Seeded, position-keyed token choice, shared by the plain and the speculative decoder.

The randomness of the token at absolute position q is one uniform number
u(seed, q), a pure function of the request seed and q. Nothing else is random,
so the token chosen at q depends only on (logits row, sampling settings, seed, q).

Why: a speculative verify lane computes the same logits row as a plain decode
step would (bitwise on the reference path), and therefore draws exactly the token
plain sampling would draw at that position. A draft is accepted exactly when it
equals that token. The output is then identical whatever the speculation settings
(width, depth, drafter), and the distribution is exactly the served one: for a
draft d the acceptance probability is p(d), as in Leviathan/Chen rejection
sampling with a point-mass draft, and on rejection the emitted token is the
plain sample, which given the rejection is distributed as p without d,
renormalized (rejection sampling's residual distribution).

The served distribution, in this order (vLLM / transformers order):
  1. temperature: softmax(logits / T) in float64 (T <= 0 means greedy: argmax,
     ties to the lowest id; no randomness is consumed);
  2. top-k: keep the k most probable tokens (k <= 0: off; here and in top-p,
     equal probabilities rank by ascending id);
  3. top-p: keep the smallest most-probable prefix whose mass reaches top_p
     (measured on the top-k-renormalized distribution; top_p >= 1: off);
  4. min-p: keep tokens with p >= min_p * p_max (ratios survive renormalization,
     so the place of this step in the order does not matter);
  5. renormalize the kept set.
The token is the first kept token, in ascending id order, whose cumulative
probability exceeds u x total: one uniform per position, and a prefix sum a GPU
kernel can reproduce (the order changes which token a given u maps to, never
the distribution). Drafts stay greedy (the MTP head's argmax): a draft d is then
accepted with probability p(d), which measured better than drafting with the
same uniform from the MTP head's own, flatter distribution.

u(seed, q) = top 53 bits of splitmix64(splitmix64(seed) ^ splitmix64(q + C)) / 2^53,
with C = 0x632BE59BD9B4E019 (a fixed odd constant separating the two inputs);
64-bit wrapping arithmetic, so a GPU kernel can reproduce it exactly.
"""

from __future__ import annotations

import secrets

import numpy as np

from q27py.engine.api import SamplingParams

_MASK64 = (1 << 64) - 1
_POSITION_SALT = 0x632BE59BD9B4E019


def splitmix64(x: int) -> int:
    """The splitmix64 finalizer (Steele et al.): a bijective 64-bit mix."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that decides the token at `position` for `seed`."""
    h = splitmix64(splitmix64(seed & _MASK64) ^ splitmix64((position + _POSITION_SALT) & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))


HEAD = 64  # first ranked block when searching for the top-p nucleus


def top_ranked(p: np.ndarray, h: int) -> np.ndarray:
    """The first h token ids in rank order (descending p, ties by ascending id), in that order.

    O(V + h log h): a partition finds the h-th largest value, then only h ids are sorted.
    """
    v = p.shape[0]
    if h >= v:
        return np.lexsort((np.arange(v), -p))
    t = np.partition(p, v - h)[v - h]
    above = np.flatnonzero(p > t)
    tied = np.flatnonzero(p == t)[: h - above.shape[0]]  # lowest ids first among the tied
    ids = np.concatenate([above, tied])
    return ids[np.lexsort((ids, -p[ids]))]


def served_distribution(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(kept token ids in ascending order, their probabilities summing to 1) for temperature > 0."""
    x = np.asarray(logits, dtype=np.float64) / float(params.temperature)
    p = np.exp(x - x.max())  # unnormalized; the top token has p == 1
    vocab = p.shape[0]
    ranked: np.ndarray | None = None  # kept ids in rank order; None = every token so far
    if 0 < params.top_k < vocab:
        ranked = top_ranked(p, params.top_k)
    if params.top_p < 1.0:
        if ranked is None:
            # Widen a ranked head until it holds the nucleus (one step for peaked rows).
            target, h = params.top_p * p.sum(), HEAD
            while True:
                head = top_ranked(p, h)
                cum = np.cumsum(p[head])
                if cum[-1] >= target or h >= vocab:
                    break
                h *= 8
        else:
            head = ranked
            cum = np.cumsum(p[head])
            target = params.top_p * cum[-1]
        ranked = head[: min(int(np.searchsorted(cum, target, side="left")) + 1, head.shape[0])]
    if ranked is None:
        kept = np.flatnonzero(p >= params.min_p) if params.min_p > 0.0 else np.arange(vocab)
    else:
        kept = np.sort(ranked[p[ranked] >= params.min_p] if params.min_p > 0.0 else ranked)
    probs = p[kept]
    return kept, probs / probs.sum()


def draw(ids: np.ndarray, probs: np.ndarray, u: float) -> int:
    """Inverse CDF: the first candidate whose cumulative probability exceeds u."""
    cum = np.cumsum(probs)
    i = int(np.searchsorted(cum, u * cum[-1], side="right"))
    return int(ids[min(i, ids.shape[0] - 1)])


class PositionSampler:
    """Chooses the token at an absolute position from a logits row (see module docstring)."""

    def __init__(self, params: SamplingParams, seed: int | None = None):
        self.params = params
        if seed is None:
            seed = params.seed
        # An unseeded request still needs one fixed seed for all of its positions.
        self.seed = int(seed) if seed is not None else secrets.randbits(63)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def pick(self, logits: np.ndarray, position: int) -> int:
        """The token at absolute `position` (0-based index in prompt + output) given its logits row."""
        if self.params.greedy:
            return int(np.argmax(logits))
        ids, probs = served_distribution(logits, self.params)
        return draw(ids, probs, position_uniform(self.seed, position))


def validate(params: SamplingParams) -> None:
    """Reject settings with no meaning (a clear error beats a silent clamp)."""
    from q27py.errors import ConfigError

    if params.temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {params.temperature}")
    if not 0.0 < params.top_p <= 1.0:
        raise ConfigError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise ConfigError(f"top_k must be >= 0, got {params.top_k}")
    if not 0.0 <= params.min_p <= 1.0:
        raise ConfigError(f"min_p must be in [0, 1], got {params.min_p}")
