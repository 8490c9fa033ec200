"""A byte grammar (engine/grammar.py) applied to a token vocabulary: allowed-token masks per state.

The vocabulary is indexed once per tokenizer (VocabIndex): token byte strings
sorted, so every prefix is a contiguous range (an implicit trie: a node is
(depth, lo, hi) and its children are the runs of equal bytes at that depth).
A state's mask is a trie walk from the root that prunes at the first byte the
grammar refuses. Two things keep it cheap:

- states are interned to small ints and each one's mask is computed once
  (agent clients send the same tools every turn, so compiled constraints are
  kept per grammar key and their masks survive across requests);
- "loop" states (a JSON string body, raw XML text: most bytes lead back to the
  same state) do not walk their subtree: for the byte class C that loops, a
  precomputed per-token "last byte outside C" array says which tokens stay in
  the state entirely (accepted at once, vectorized); only the few tokens with a
  byte outside C (a quote, a backslash, `<`) are simulated byte by byte.

A decode step then costs a few dictionary lookups (advance the state by the
chosen token's bytes, fetch the cached mask); docs/PERF.md, "Output control",
has the measured figures (`q27py bench grammar`).

Special (added) tokens take part only where the grammar names their text
(the XML call grammar admits `<tool_call>` / `</tool_call>`); end-of-sequence
ids are allowed exactly in accepting states. A state whose mask would be empty
(a vocabulary that cannot spell the next byte) allows the end ids, so a request
ends instead of wedging.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from q27py.engine.grammar import Grammar

DEAD = -1
TRIE_DEPTH = 32  # bytes of each token kept in the column matrix; longer tokens finish by simulation
LOOP_MIN_RANGE = 48  # ranges smaller than this are walked, not checked for a loop class
LOOP_MIN_BYTES = 32  # a loop class must hold this many bytes to be worth the vectorized path


class TokenMask:
    """Allowed tokens as the shorter of two sorted int32 id lists: the allowed ids (`allow`
    True), or the refused ids (`allow` False: a string body refuses a few thousand of 248K)."""

    __slots__ = ("allow", "ids", "count")

    def __init__(self, allow: bool, ids: np.ndarray, count: int):
        self.allow, self.ids, self.count = allow, ids, count

    @classmethod
    def from_bool(cls, keep: np.ndarray) -> "TokenMask":
        n = int(keep.sum())
        if n <= keep.shape[0] // 2:
            return cls(True, np.flatnonzero(keep).astype(np.int32), n)
        return cls(False, np.flatnonzero(~keep).astype(np.int32), n)

    def __contains__(self, token: int) -> bool:
        i = int(np.searchsorted(self.ids, token))
        found = i < self.ids.shape[0] and int(self.ids[i]) == token
        return found == self.allow

    def __len__(self) -> int:
        return self.count

    def dense(self, vocab_size: int) -> np.ndarray:
        out = np.full(vocab_size, not self.allow, dtype=bool)
        out[self.ids] = self.allow
        return out

    def apply(self, logits):
        """logits with refused ids at -inf (numpy, or a device array: its own module is used)."""
        return mask_logits(logits, self)

    def greedy(self, logits: np.ndarray) -> int:
        """argmax over the allowed ids (ties: the lowest id, as argmax on the masked row)."""
        if self.allow:
            return int(self.ids[int(np.argmax(logits[self.ids]))])
        return int(np.argmax(self.apply(logits)))



class VocabIndex:
    """The token byte strings of one tokenizer, sorted, with the arrays the mask walk needs."""

    def __init__(self, token_bytes: list[bytes | None], specials: dict[str, int], vocab_size: int):
        self.vocab_size = vocab_size
        self.specials = dict(specials)  # added special text -> id (never in the trie)
        special_ids = set(specials.values())
        ids = [i for i, b in enumerate(token_bytes) if b and i not in special_ids and i < vocab_size]
        ids.sort(key=lambda i: token_bytes[i])
        self.order = np.asarray(ids, dtype=np.int64)  # sorted position -> token id
        toks = [token_bytes[i] for i in ids]
        self.toks = toks
        self.lens = np.fromiter((len(t) for t in toks), dtype=np.int64, count=len(toks))
        L = TRIE_DEPTH
        self.cols = np.frombuffer(b"".join(t[:L].ljust(L, b"\0") for t in toks), dtype=np.uint8).reshape(len(toks), L)
        self.flat = np.frombuffer(b"".join(toks), dtype=np.uint8)
        self.starts = np.zeros(len(toks), dtype=np.int64)
        np.cumsum(self.lens[:-1], out=self.starts[1:])
        self.pos = np.arange(self.flat.shape[0], dtype=np.int64) - np.repeat(self.starts, self.lens)
        self._children: dict[tuple[int, int], list] = {}
        self._lastbad: dict[bytes, np.ndarray] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None) -> "VocabIndex":
        n = vocab_size or tokenizer.vocab_size
        specials = dict(getattr(tokenizer, "special_ids", {}) or {})
        limit = min(n, tokenizer.vocab_size)
        return cls([tokenizer.token_bytes(i) for i in range(limit)] + [None] * (n - limit), specials, n)

    def children(self, d: int, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(byte, lo, hi) runs at depth d of the range [lo, hi) (tokens of length d excluded)."""
        key = (d, lo)
        got = self._children.get(key)
        if got is not None:
            return got
        lens = self.lens
        while lo < hi and lens[lo] == d:
            lo += 1
        out = []
        if lo < hi:
            col = self.cols[lo:hi, d]
            cuts = np.flatnonzero(col[1:] != col[:-1]) + 1
            edges = [0, *cuts.tolist(), hi - lo]
            out = [(int(col[a]), lo + a, lo + b) for a, b in zip(edges[:-1], edges[1:])]
        self._children[key] = out
        return out

    def lastbad(self, loop: bytes) -> np.ndarray:
        """Per sorted token: 1 + index of its last byte outside the class (0 when none)."""
        got = self._lastbad.get(loop)
        if got is None:
            inside = np.zeros(256, dtype=bool)
            inside[np.frombuffer(loop, dtype=np.uint8)] = True
            val = np.where(inside[self.flat], 0, self.pos + 1)
            got = np.maximum.reduceat(val, self.starts) if len(self.starts) else val
            self._lastbad[loop] = got
        return got


class CompiledConstraint:
    """One grammar over one vocabulary: interned states, transitions, cached masks. Shared by
    every request with the same grammar key; calls are serialized by the engine thread."""

    def __init__(self, grammar: Grammar, vocab: VocabIndex, max_mask_bytes: int = 256 << 20):
        self.grammar = grammar
        self.vocab = vocab
        self._ids: dict[frozenset, int] = {}
        self._sets: list[frozenset] = []
        self._next: list[dict[int, int]] = []
        self._accepts: list[bool] = []
        self._loop: dict[int, bytes | None] = {}
        self._masks: OrderedDict[tuple, TokenMask] = OrderedDict()  # (sid, end ids) -> mask
        self._mask_bytes = 0
        self.max_mask_bytes = max_mask_bytes
        self._special_ids = {t: i for t, i in vocab.specials.items() if t in grammar.specials}
        self._all_specials = frozenset(vocab.specials.values())
        self._dist: dict[int, int] = {}
        self._closing: dict = {}
        self.start = self._intern(grammar.start())
        self.stats = {"mask_misses": 0, "mask_hits": 0}

    def _intern(self, states: frozenset) -> int:
        if not states:
            return DEAD
        sid = self._ids.get(states)
        if sid is None:
            sid = len(self._sets)
            self._ids[states] = sid
            self._sets.append(states)
            self._next.append({})
            self._accepts.append(self.grammar.accepts(states))
        return sid

    def step(self, sid: int, b: int) -> int:
        nxt = self._next[sid]
        got = nxt.get(b)
        if got is None:
            got = self._intern(self.grammar.step(self._sets[sid], b))
            nxt[b] = got
        return got

    def step_bytes(self, sid: int, data: bytes) -> int:
        for b in data:
            if sid == DEAD:
                return DEAD
            sid = self.step(sid, b)
        return sid

    def accepts(self, sid: int) -> bool:
        return sid != DEAD and self._accepts[sid]

    def advance(self, sid: int, token: int, token_bytes) -> int:
        """The state after `token` (DEAD if the grammar refuses it). token_bytes: id -> bytes."""
        if sid == DEAD:
            return DEAD
        for text, tid in self._special_ids.items():
            if tid == token:
                return self.step_bytes(sid, text.encode())
        if token in self._all_specials:
            return DEAD
        data = token_bytes(token)
        return self.step_bytes(sid, data) if data else DEAD

    def _loop_class(self, sid: int) -> bytes | None:
        got = self._loop.get(sid, 0)
        if got == 0:
            loop = bytes(b for b in range(256) if self.step(sid, b) == sid)
            got = loop if len(loop) >= LOOP_MIN_BYTES else None
            self._loop[sid] = got
        return got

    def allowed(self, sid: int, stop_ids=()) -> "TokenMask":
        """The tokens allowed in state sid, the end ids included when it accepts (or when nothing
        else is: a request then ends instead of wedging). Shared objects: do not modify."""
        key = (sid, stop_ids if isinstance(stop_ids, frozenset) else frozenset(stop_ids))
        mask = self._masks.get(key)
        if mask is not None:
            self._masks.move_to_end(key)
            self.stats["mask_hits"] += 1
            return mask
        self.stats["mask_misses"] += 1
        keep = self._compute(sid)
        ends = [t for t in key[1] if 0 <= t < self.vocab.vocab_size]
        if ends and (self.accepts(sid) or not keep.any()):
            keep[ends] = True
        mask = TokenMask.from_bool(keep)
        self._masks[key] = mask
        self._mask_bytes += mask.ids.nbytes
        while self._mask_bytes > self.max_mask_bytes and len(self._masks) > 1:
            _, old = self._masks.popitem(last=False)
            self._mask_bytes -= old.ids.nbytes
        return mask

    def dense_mask(self, sid: int, stop_ids=()) -> np.ndarray:
        """allowed() as a bool vector over the vocabulary (for a device upload)."""
        return self.allowed(sid, stop_ids).dense(self.vocab.vocab_size)

    def _compute(self, sid: int) -> np.ndarray:
        v = self.vocab
        keep = np.zeros(v.vocab_size, dtype=bool)
        if sid == DEAD:
            return keep
        picked: list[np.ndarray] = []
        single: list[int] = []
        self._walk(sid, 0, 0, len(v.toks), picked, single)
        for text, tid in self._special_ids.items():
            if self.step_bytes(sid, text.encode()) != DEAD:
                single.append(tid)
        for ids in picked:
            keep[ids] = True
        if single:
            keep[np.asarray(single, dtype=np.int64)] = True
        return keep

    def _walk(self, sid: int, d: int, lo: int, hi: int, picked: list, single: list) -> None:
        """Tokens in sorted [lo, hi) share their first d bytes, after which the grammar is in sid."""
        v = self.vocab
        lens = v.lens
        while lo < hi and lens[lo] == d:  # tokens that end here are allowed
            single.append(int(v.order[lo]))
            lo += 1
        if lo >= hi:
            return
        loop = self._loop_class(sid) if hi - lo >= LOOP_MIN_RANGE else None
        if loop is not None:
            lb = v.lastbad(loop)[lo:hi]
            good = lb <= d
            picked.append(v.order[lo:hi][good])
            for k in (np.flatnonzero(~good) + lo).tolist():
                if self.step_bytes(sid, v.toks[k][d:]) != DEAD:
                    single.append(int(v.order[k]))
            return
        if d >= TRIE_DEPTH:
            for k in range(lo, hi):
                if self.step_bytes(sid, v.toks[k][d:]) != DEAD:
                    single.append(int(v.order[k]))
            return
        for b, lo2, hi2 in v.children(d, lo, hi):
            nsid = self.step(sid, b)
            if nsid != DEAD:
                self._walk(nsid, d + 1, lo2, hi2, picked, single)


    # -- finishing within the token budget -------------------------------------------------

    def distance(self, sid: int, limit: int = 4096) -> int:
        """Fewest bytes from sid to an accepting state (a bound on the tokens needed to finish,
        given single-byte tokens); `limit` + 1 when none is found within `limit` bytes."""
        got = self._dist.get(sid)
        if got is not None:
            return got
        # Breadth-first over byte transitions; every state settled on the way gets its answer
        # only if it is the start (distances of others depend on their own searches).
        seen = {sid: 0}
        frontier = [sid]
        d = 0
        found = limit + 1
        while frontier and d <= limit:
            nxt = []
            for s in frontier:
                if self.accepts(s):
                    found = d
                    nxt = []
                    break
                for b in range(256):
                    t = self.step(s, b)
                    if t != DEAD and t not in seen:
                        seen[t] = d + 1
                        nxt.append(t)
            if found <= limit:
                break
            frontier = nxt
            d += 1
        self._dist[sid] = found
        return found

    def closing(self, sid: int, stop_ids=()) -> "TokenMask":
        """Tokens on a shortest way to an accepting state (every byte one step closer), or the end
        ids when sid accepts. Used when the token budget leaves no room for anything else."""
        key = (sid, tuple(sorted(stop_ids)))
        got = self._closing.get(key)
        if got is not None:
            return got
        if self.accepts(sid):
            got = np.asarray(sorted(t for t in stop_ids if 0 <= t < self.vocab.vocab_size), dtype=np.int64)
        else:
            picked: list[int] = []
            self._close_walk(sid, 0, 0, len(self.vocab.toks), picked)
            for text, tid in self._special_ids.items():
                cur, ok = sid, True
                for b in text.encode():
                    nxt = self.step(cur, b)
                    if nxt == DEAD or self.distance(nxt) != self.distance(cur) - 1:
                        ok = False
                        break
                    cur = nxt
                if ok:
                    picked.append(tid)
            got = np.asarray(sorted(set(picked)), dtype=np.int64)
        got = TokenMask(True, got.astype(np.int32), int(got.shape[0]))
        self._closing[key] = got
        return got

    def _close_walk(self, sid, d, lo, hi, picked):
        v = self.vocab
        while lo < hi and v.lens[lo] == d:
            if d:
                picked.append(int(v.order[lo]))
            lo += 1
        if lo >= hi or d >= TRIE_DEPTH:
            return
        here = self.distance(sid)
        if here == 0:
            return  # accepting: a longer token would have to leave and come back
        for b, lo2, hi2 in v.children(d, lo, hi):
            nsid = self.step(sid, b)
            if nsid != DEAD and self.distance(nsid) == here - 1:
                self._close_walk(nsid, d + 1, lo2, hi2, picked)


class ConstraintCache:
    """Compiled constraints by grammar key, least recently used dropped first."""

    def __init__(self, vocab_factory, size: int = 16):
        self._vocab_factory = vocab_factory
        self._vocab: VocabIndex | None = None
        self._items: OrderedDict[str, CompiledConstraint] = OrderedDict()
        self.size = size

    @property
    def vocab(self) -> VocabIndex:
        if self._vocab is None:
            self._vocab = self._vocab_factory()
        return self._vocab

    def get(self, grammar: Grammar) -> CompiledConstraint:
        got = self._items.get(grammar.key)
        if got is None:
            got = CompiledConstraint(grammar, self.vocab)
            self._items[grammar.key] = got
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(grammar.key)
        return got


class ConstraintRun:
    """One request's position in a constraint. The state is a plain value, so speculative lanes
    can carry their own: ("free", k) while a think block is still open (k bytes of `</think>`
    matched), then the grammar state id."""

    THINK_CLOSE = b"</think>"

    def __init__(self, compiled: CompiledConstraint, token_bytes, stop_ids=frozenset(), after_think: bool = False):
        self.c = compiled
        self.token_bytes = token_bytes
        self.stop_ids = frozenset(stop_ids)
        self.state = ("free", 0) if after_think else compiled.start

    def allowed(self, state) -> TokenMask | None:
        """The allowed tokens in `state`; None while free (every token)."""
        if isinstance(state, tuple):
            return None
        return self.c.allowed(state, self.stop_ids)

    def next_state(self, state, token: int):
        """The state after token, or None when the constraint refuses it."""
        if isinstance(state, tuple):
            k = state[1]
            data = self.token_bytes(token) or b""
            close = self.THINK_CLOSE
            for i, b in enumerate(data):
                k = k + 1 if b == close[k] else (1 if b == close[0] else 0)
                if k == len(close):
                    # The grammar starts right after `</think>` (its leading whitespace allowance
                    # takes the template's "\n\n").
                    return self.c.step_bytes(self.c.start, data[i + 1 :]) if i + 1 < len(data) else self.c.start
            return ("free", k)
        if token in self.stop_ids:
            return state if self.c.accepts(state) else None
        nxt = self.c.advance(state, token, self.token_bytes)
        return None if nxt == DEAD else nxt

    def distance(self, state) -> int | None:
        """Bytes still needed to finish (None while free: nothing is promised inside thinking)."""
        return None if isinstance(state, tuple) else self.c.distance(state)

    def closing(self, state) -> TokenMask:
        return self.c.closing(state, self.stop_ids)

    def permits(self, state, token: int) -> bool:
        allowed = self.allowed(state)
        return allowed is None or token in allowed


def mask_logits(logits, mask: TokenMask):
    """logits with every refused id at -inf, for a numpy row or a device (cupy) row.

    Host: a copy with the short id list written. Device: the same two cases with the id list
    uploaded (the place for a cached device mask and a fused mask+argmax kernel)."""
    if type(logits).__module__.split(".")[0] == "cupy":  # pragma: no cover - exercised on the GPU
        import cupy as xp

        ids = xp.asarray(mask.ids)
        if mask.allow:
            out = xp.full(logits.shape, -xp.inf, dtype=logits.dtype)
            out[..., ids] = logits[..., ids]
        else:
            out = logits.copy()
            out[..., ids] = -xp.inf
        return out
    if mask.allow:
        out = np.full(logits.shape, -np.inf, dtype=logits.dtype)
        out[..., mask.ids] = logits[..., mask.ids]
    else:
        out = np.array(logits, copy=True)
        out[..., mask.ids] = -np.inf
    return out
