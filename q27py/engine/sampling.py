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
from dataclasses import dataclass

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
    if not params.repetition_penalty > 0.0:
        raise ConfigError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -2.0 <= value <= 2.0:
            raise ConfigError(f"{name} must be in [-2, 2], got {value}")


# ---------------------------------------------------------------------------
# Penalties, constraints and log probabilities around the position sampler


def penalize(logits: np.ndarray, params: SamplingParams, output_counts: dict[int, int],
             seen: set[int] | frozenset[int]) -> np.ndarray:
    """The logits row with the penalties applied (vLLM's order and definitions):

    - repetition_penalty r (HF/vLLM) on every token of prompt + output so far (`seen`):
      a positive logit is divided by r, a negative one multiplied by r;
    - frequency_penalty f and presence_penalty p (OpenAI) on output tokens only:
      logit -= f * count + p * (count > 0).

    A pure function of (row, settings, token history), so a verify lane with its own
    history gets exactly the numbers a plain decode step would. Returns the row itself
    when no penalty is on."""
    rep = params.repetition_penalty
    freq, pres = params.frequency_penalty, params.presence_penalty
    use_rep = rep != 1.0 and seen
    use_out = (freq != 0.0 or pres != 0.0) and output_counts
    if not use_rep and not use_out:
        return logits
    x = np.array(logits, dtype=np.float32, copy=True)
    if use_rep:
        ids = np.fromiter(seen, dtype=np.int64, count=len(seen))
        ids = ids[ids < x.shape[0]]
        v = x[ids]
        x[ids] = np.where(v > 0, v / np.float32(rep), v * np.float32(rep))
    if use_out:
        ids = np.fromiter(output_counts.keys(), dtype=np.int64, count=len(output_counts))
        counts = np.fromiter(output_counts.values(), dtype=np.float32, count=len(output_counts))
        keep = ids < x.shape[0]
        ids, counts = ids[keep], counts[keep]
        x[ids] -= np.float32(freq) * counts + np.float32(pres)
    return x


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the top_logprobs most likely (id, logprob), best first


class TokenPicker:
    """Chooses every output token for one request: penalties, then the output constraint's mask,
    then the position-keyed sampler; records log probabilities when asked.

    The choice at a position is a function of (logits row, token history before it, seed,
    position) only. A speculative verify lane passes the drafts it assumes (`ahead`), so it
    makes the choice plain decoding would make after those tokens: output stays identical with
    speculation on or off under penalties and constraints alike.

    Log probabilities are those of the penalized logits row, before temperature, truncation and
    the constraint mask (the model's own distribution with the request's penalties; a forced token
    shows how unlikely the model found it). They come from the same verify row that chose the
    token, so they are exact for speculative and plain decoding.
    """

    def __init__(self, params: SamplingParams, prompt_ids=(), constraint=None, logprobs: int | None = None,
                 max_tokens: int | None = None, device_masks: bool = False):
        self.sampler = PositionSampler(params)
        # EngineConfig.device_masks: a constrained greedy pick on the fast path takes the device's
        # masked argmax (FastOutput.masked_greedy_ids) instead of downloading its logits row.
        self.device_masks = device_masks
        self._prefetch_out = None
        self._prefetched: dict = {}
        self.max_tokens = max_tokens  # with a constraint: the output is finished within this budget
        self.emitted = 0
        self.params = params
        self.constraint = constraint  # engine.constraint.ConstraintRun or None
        self.state = constraint.state if constraint is not None else None
        self.want_logprobs = logprobs is not None
        self.top_n = int(logprobs or 0)
        self.counts: dict[int, int] = {}
        self.seen: set[int] = set(int(t) for t in prompt_ids) if params.repetition_penalty != 1.0 else set()
        self.logprobs: list[TokenLogprob] = []
        self._lanes: list[TokenLogprob | None] = []
        self._lane_states: list = []  # constraint state after ahead[:t], per lane t (this round)
        self._round_ahead: list[int] | None = None

    @property
    def greedy(self) -> bool:
        return self.sampler.greedy

    @property
    def plain(self) -> bool:
        """Nothing besides the sampler: the fast path may use its own argmax."""
        p = self.params
        return (self.constraint is None and not self.want_logprobs and p.repetition_penalty == 1.0
                and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0)

    def _state_after(self, ahead) -> object:
        state = self.state
        for tok in ahead:
            state = self.constraint.next_state(state, tok)
            if state is None:
                raise ValueError("a lane assumes a token the constraint refuses")
        return state

    def _ends_at(self, state) -> bool:
        mask = self.constraint.allowed(state)
        return mask is not None and len(mask) == 0

    @property
    def finished(self) -> bool:
        """The constraint allows no token after the committed ones: the generation is over.

        With end ids this never happens (a complete document allows them, and so does a state
        whose mask would be empty: CompiledConstraint.allowed), so the end id is emitted and the
        stop-id rule ends the run. A request with no end ids (GenerationRequest.stop_ids empty:
        the engine API and the CLI allow it) reaches a complete document, then a trailing
        whitespace allowance, then a state with nothing to emit: the decoders end there (the
        document is delivered, finish_reason "stop") instead of sampling over an empty mask.
        A function of the committed tokens only, so both decoders end after the same token."""
        return self.constraint is not None and self._ends_at(self.state)

    def viable(self, drafts: list[int]) -> list[int]:
        """The longest prefix of drafts the constraint permits after the committed tokens (a refused
        draft would be a rejected lane anyway: the masked choice can never equal it). The prefix
        also stops before a draft that leaves nothing to emit after it (`finished`): no verify
        lane then sits past the end of the output, so every lane has a token to choose; the
        last kept lane still chooses that draft when the model agrees, and the round ends there."""
        if self.constraint is None or not drafts:
            return drafts
        state = self.state
        for i, tok in enumerate(drafts):
            if not self.constraint.permits(state, tok):
                return drafts[:i]
            state = self.constraint.next_state(state, tok)
            if state is None or self._ends_at(state):
                return drafts[:i]
        return drafts

    @property
    def device_maskable(self) -> bool:
        """A constrained greedy pick with nothing that needs the row on the host (penalties change
        the row, log probabilities read it): the device's masked argmax makes the same choice."""
        p = self.params
        return (self.device_masks and self.constraint is not None and self.greedy and not self.want_logprobs
                and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0)

    def pick_output(self, out, row: int, position: int, ahead=()) -> int:
        """pick() for logits row `row` of a forward output. With nothing besides a greedy sampler
        (`plain`), the fast path's device argmax decides (FastOutput.greedy_ids: numpy.argmax's
        choice, ties to the lowest index, so the same token), and W token ids are downloaded
        instead of W vocabulary-sized rows with a host argmax each. A constrained greedy pick
        (`device_maskable`) uploads the state's packed mask and takes the device's masked argmax
        (the choice TokenMask.greedy makes on the host: numpy.argmax over the allowed ids)."""
        if self.plain and self.greedy and hasattr(out, "greedy_ids"):
            return int(out.greedy_ids()[row])
        if self.device_maskable and hasattr(out, "masked_greedy_ids"):
            tok = self._decide(position, ahead, lambda mask: self._device_choose(out, row, mask))
            self._record(len(ahead), None)
            return tok
        return self.pick(out.logits[row], position, ahead)

    def prefetch(self, out, drafts: list[int]) -> None:
        """A verify round's masked picks in one launch: lane t's mask is the state's after
        drafts[:t] (the lanes pick_output will be asked for, in order); lanes past a refused draft
        are left out (viable() cut such drafts already). No-op unless device_maskable."""
        self._prefetch_out, self._prefetched = None, {}
        if not (self.device_maskable and hasattr(out, "masked_greedy_ids")):
            return
        state, picks, masks = self.state, [], []
        for t in range(len(drafts) + 1):
            mask = self.constraint.allowed(state)
            if mask is not None:
                picks.append(t)
                masks.append(mask)
            if t == len(drafts):
                break
            state = self.constraint.next_state(state, drafts[t])
            if state is None:
                break
        if picks:
            v = self.constraint.c.vocab.vocab_size
            ids = out.masked_greedy_ids(picks, np.stack([m.packed(v) for m in masks]))
            self._prefetch_out = out
            self._prefetched = {(t, id(m)): int(i) for t, m, i in zip(picks, masks, ids)}
            self._prefetch_masks = masks  # keeps the masks alive: their ids are the keys

    def _device_choose(self, out, row: int, mask) -> int:
        if mask is None:  # free (inside a think block): the plain device argmax
            return int(out.greedy_ids()[row])
        if out is self._prefetch_out:
            got = self._prefetched.get((row, id(mask)))
            if got is not None:
                return got
        v = self.constraint.c.vocab.vocab_size
        return int(out.masked_greedy_ids([row], mask.packed(v)[None, :])[0])

    def _decide(self, position: int, ahead, choose) -> int:
        """The constrained choice: choose(mask) under the state's mask, then the token-budget rule
        (choose(closing mask)). choose(None) is the unconstrained choice."""
        if self.constraint is None:
            return choose(None)
        state = self._state_after(ahead)
        mask = self.constraint.allowed(state)
        if mask is not None and not len(mask):
            # The decoders end a run once `finished` (and viable() keeps lanes short of it): a pick
            # here is a decoder bug, named instead of numpy's argmax-of-an-empty-sequence error.
            raise RuntimeError("the output constraint allows no token here: the generation should have ended")
        tok = choose(mask)
        if self.max_tokens is not None and tok not in self.constraint.stop_ids:
            # Finish within the budget: when the chosen token would leave fewer tokens than
            # the shortest completion needs (bytes, each at worst one token, plus the end id
            # when there is one to emit), choose among the tokens on a shortest way to the end
            # instead. A function of the state and the position, so speculative lanes make the
            # same choice.
            left = self.max_tokens - (self.emitted + len(ahead)) - 1
            after = self.constraint.next_state(state, tok)
            need = self.constraint.distance(after)
            end = 1 if self.constraint.stop_ids else 0
            if need is not None and need + end > left:
                closing = self.constraint.closing(state)
                if len(closing):
                    tok = choose(closing)
        return tok

    def _record(self, lane: int, record) -> None:
        del self._lanes[lane:]
        while len(self._lanes) < lane:
            self._lanes.append(None)
        self._lanes.append(record)

    def pick(self, logits: np.ndarray, position: int, ahead=()) -> int:
        """The token at absolute `position`, after the committed tokens and then `ahead`."""
        counts, seen = self.counts, self.seen
        if ahead and not self.plain:
            counts = dict(counts)
            seen = set(seen) if self.params.repetition_penalty != 1.0 else seen
            for t in ahead:
                counts[t] = counts.get(t, 0) + 1
                if self.params.repetition_penalty != 1.0:
                    seen.add(t)
        x = penalize(logits, self.params, counts, seen)
        tok = self._decide(position, ahead, lambda mask: self._choose(x, position, mask))
        record = None
        if self.want_logprobs:
            lp = log_softmax(x)
            top = top_ranked(lp, self.top_n) if self.top_n > 0 else np.zeros(0, dtype=np.int64)
            record = TokenLogprob(tok, float(lp[tok]), [(int(i), float(lp[i])) for i in top])
        self._record(len(ahead), record)
        return tok

    def _choose(self, x, position: int, mask) -> int:
        """The sampler's choice with the refused tokens' probability at 0 (engine.constraint.TokenMask)."""
        if mask is None:
            return self.sampler.pick(x, position)
        if self.sampler.greedy:
            return mask.greedy(np.asarray(x))
        if mask.allow:  # the kept set is small: sample inside it (same token as on the -inf row)
            ids, probs = served_distribution(np.asarray(x)[mask.ids], self.params)
            return int(mask.ids[draw(ids, probs, position_uniform(self.sampler.seed, position))])
        return self.sampler.pick(mask.apply(np.asarray(x)), position)

    def commit(self, tokens: list[int]) -> None:
        """The tokens a round emitted (each one the pick of its lane, in order)."""
        if self.want_logprobs:
            for t, tok in enumerate(tokens):
                rec = self._lanes[t] if t < len(self._lanes) else None
                assert rec is not None and rec.token == tok, "commit must follow the lanes' picks"
                self.logprobs.append(rec)
        self._lanes = []
        self.emitted += len(tokens)
        for tok in tokens:
            self.counts[tok] = self.counts.get(tok, 0) + 1
            if self.params.repetition_penalty != 1.0:
                self.seen.add(tok)
            if self.constraint is not None:
                nxt = self.constraint.next_state(self.state, tok)
                # A stop id in an accepting state keeps the state; nothing follows it.
                self.state = nxt if nxt is not None else self.state
