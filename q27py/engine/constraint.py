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

- a stack topped by a leaf frame (a string body, raw text, a number, a literal) composes its
  mask from that frame's own mask (FrameMask: computed once per vocabulary for every node of
  the same signature and local state, whatever stack it tops and whatever grammar it is in)
  and the few tokens that leave the frame mid-token, whose remainders the stack below reads;
  frames whose next read is a call for any byte (a Seq, a value about to start) are pushed
  first, so every parameter value of every tool lands on the one shared frame mask. Only
  container frames (object keys, `<parameter=` names) still walk the trie per stack, and a
  whitespace run there reads a flattened table of the vocabulary's whitespace prefixes
  (VocabIndex.ws_table) instead of ~500 trie nodes;
- the frame masks of the common leaves are built with the index at server start; a new
  grammar's own leaves and its start state's mask when it is compiled (precompute).

A decode step then costs a few dictionary lookups (advance the state by the
chosen token's bytes, fetch the cached mask); docs/PERF.md, "Output control",
has the measured figures (`q27py bench grammar`).

Special (added) tokens take part only where the grammar names their text
(the XML call grammar admits `<tool_call>` / `</tool_call>`); end-of-sequence
ids are allowed exactly in accepting states. A state whose mask would be empty
(a vocabulary that cannot spell the next byte) allows the end ids, so a request
ends instead of wedging. With no end ids such a mask is empty (also past a complete
document's trailing whitespace): engine/sampling.py TokenPicker.finished ends the run there.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import numpy as np

from q27py.engine.grammar import (ANYTHING, CALL, MAX_WS, TAIL, WS as WS_BYTES, Grammar, GrammarError, Lit, advance,
                                   common_leaves, common_loop_classes, grammar_leaves, leaf_locals, stack_first)

DEAD = -1
TRIE_DEPTH = 32  # bytes of each token kept in the column matrix; longer tokens finish by simulation
LOOP_MIN_RANGE = 48  # ranges smaller than this are walked, not checked for a loop class
LOOP_MIN_BYTES = 32  # a loop class must hold this many bytes to be worth the vectorized path
SHORT_SIDE = 32768  # id lists up to this long are sorted directly (else one dense pass)
ROOT_LOOPS_KEPT = 64  # whole-vocabulary masks of loop states kept per constraint (248 KB each)
FRAMES_KEPT = 4096  # frame masks kept per vocabulary (shared by every grammar)
PARTS_KEPT = 8192  # per-stack and per-state mask parts kept per constraint
PARTS_BYTES = 64 << 20  # and at most this many bytes of walked position lists in them
KID_MEMO_KEPT = 1 << 17  # filtered children lists kept per trie index (CompiledConstraint._kids)
FRAME_EXITS_MAX = 32768  # a frame that more tokens leave mid-token is walked per stack instead
_NO_POS = np.zeros(0, dtype=np.int64)


class TokenMask:
    """Allowed tokens as the shorter of two sorted int32 id lists: the allowed ids (`allow`
    True), or the refused ids (`allow` False: a string body refuses a few thousand of 248K)."""

    __slots__ = ("allow", "ids", "count", "_packed")

    def __init__(self, allow: bool, ids: np.ndarray, count: int):
        self.allow, self.ids, self.count = allow, ids, count
        self._packed = None

    def packed(self, vocab_size: int) -> np.ndarray:
        """The mask as the device bitmask (pack_bits of dense(vocab_size)), made once per mask."""
        got = self._packed
        if got is None or got.shape[0] * 32 < vocab_size:
            got = self._packed = pack_bits(self.dense(vocab_size))
        return got

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



def pack_bits(keep: np.ndarray) -> np.ndarray:
    """A bool vector over token ids as uint32 words, bit i & 31 of word i >> 5 for id i (the
    layout top2_partial_masked in cuda/sampling.cu reads); bits past the end are 0 (refused)."""
    keep = np.asarray(keep, dtype=bool)
    words = (keep.shape[0] + 31) // 32
    raw = np.packbits(keep, bitorder="little")
    out = np.zeros(words * 4, dtype=np.uint8)
    out[: raw.shape[0]] = raw
    return out.view("<u4").astype(np.uint32)


def masked_argmax(logits: np.ndarray, words: np.ndarray) -> int:
    """What the device's masked argmax computes, in numpy (the spec the GPU test compares with):
    numpy.argmax of the row with the ids whose bit is 0 at -inf."""
    v = logits.shape[0]
    keep = np.unpackbits(np.ascontiguousarray(words, dtype="<u4").view(np.uint8), bitorder="little")[:v].astype(bool)
    return int(np.argmax(np.where(keep, logits, -np.inf)))


class TrieIndex:
    """Byte strings sorted, so every prefix is a contiguous range (an implicit trie), with the
    arrays a mask walk needs. order[k]: what sorted string k stands for (a token id)."""

    def __init__(self, toks: list[bytes], order: np.ndarray):
        self.order = order
        self.toks = toks
        self.lens = np.fromiter((len(t) for t in toks), dtype=np.int64, count=len(toks))
        L = TRIE_DEPTH
        self.cols = np.frombuffer(b"".join(t[:L].ljust(L, b"\0") for t in toks), dtype=np.uint8).reshape(len(toks), L)
        self.flat = np.frombuffer(b"".join(toks), dtype=np.uint8)
        self.starts = np.zeros(len(toks), dtype=np.int64)
        np.cumsum(self.lens[:-1], out=self.starts[1:])
        self.pos = np.arange(self.flat.shape[0], dtype=np.int64) - np.repeat(self.starts, self.lens)
        self._children: dict[tuple[int, int], list] = {}
        self._child_maps: dict[tuple[int, int], dict] = {}
        self._lastbad: dict[bytes, np.ndarray] = {}
        self._kid_memo: dict[tuple, list] = {}

    def __len__(self) -> int:
        return len(self.toks)

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

    def child_map(self, d: int, lo: int, hi: int) -> dict[int, tuple[int, int]]:
        """children() as {byte: (lo, hi)}: a state with few first bytes looks them up instead of
        scanning a node's (up to 256) children."""
        key = (d, lo)
        got = self._child_maps.get(key)
        if got is None:
            got = self._child_maps[key] = {b: (a, z) for b, a, z in self.children(d, lo, hi)}
        return got

    def lastbad(self, loop: bytes) -> np.ndarray:
        """Per sorted token: 1 + index of its last byte outside the class (0 when none)."""
        got = self._lastbad.get(loop)
        if got is None:
            val = np.where(_inside(loop)[self.flat], 0, self.pos + 1)
            got = np.maximum.reduceat(val, self.starts) if len(self.starts) else val
            self._lastbad[loop] = got
        return got


def _inside(loop: bytes) -> np.ndarray:
    inside = np.zeros(256, dtype=bool)
    inside[np.frombuffer(loop, dtype=np.uint8)] = True
    return inside


class LoopTable:
    """One loop class over a whole vocabulary (per tokenizer, shared by every grammar): the tokens
    made only of class bytes, and for the others the suffix from their first byte outside the
    class. A loop state L (a string body: it reads every class byte back into itself) keeps a
    token with no outside byte, and decides every other one by that suffix alone (the bytes
    before it left L at L) -- so L's whole-vocabulary mask is `good` plus a walk over the few
    thousand distinct suffixes (`suffixes`, a TrieIndex), not over 248K tokens."""

    def __init__(self, vocab: "TrieIndex", loop: bytes):
        n = len(vocab)
        big = np.int64(1) << 40
        val = np.where(_inside(loop)[vocab.flat], big, vocab.pos)
        first = np.minimum.reduceat(val, vocab.starts) if n else np.zeros(0, dtype=np.int64)
        self.good = first >= big  # per sorted position: no byte outside the class
        bad = np.flatnonzero(~self.good)
        sufs = [vocab.toks[k][j:] for k, j in zip(bad.tolist(), first[bad].tolist())]
        uniq = sorted(set(sufs))
        where = {u: i for i, u in enumerate(uniq)}
        self.bad_pos = bad  # sorted positions (in vocab) of the tokens with an outside byte
        self.bad_suffix = np.fromiter((where[u] for u in sufs), dtype=np.int64, count=len(sufs))
        self.suffixes = TrieIndex(uniq, np.arange(len(uniq), dtype=np.int64))


class VocabIndex(TrieIndex):
    """The token byte strings of one tokenizer (specials excluded: they are matched by text), as a
    TrieIndex, plus the per-class loop tables. Built once per tokenizer (at engine start)."""

    def __init__(self, token_bytes: list[bytes | None], specials: dict[str, int], vocab_size: int):
        self.vocab_size = vocab_size
        self.specials = dict(specials)  # added special text -> id (never in the trie)
        special_ids = set(specials.values())
        ids = [i for i, b in enumerate(token_bytes) if b and i not in special_ids and i < vocab_size]
        ids.sort(key=lambda i: token_bytes[i])
        super().__init__([token_bytes[i] for i in ids], np.asarray(ids, dtype=np.int64))
        self.pos_of = np.full(vocab_size, -1, dtype=np.int64)  # token id -> sorted position (-1: not in the trie)
        self.pos_of[self.order] = np.arange(len(ids), dtype=np.int64)
        self.outside = np.flatnonzero(self.pos_of < 0)  # ids outside the trie (specials, padding rows)
        self._tables: dict[bytes, LoopTable] = {}
        self._ws_table = None
        self.frames: OrderedDict[tuple, object] = OrderedDict()  # (leaf signature, local) -> FrameMask
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int | None = None, warm: bool = True) -> "VocabIndex":
        n = vocab_size or tokenizer.vocab_size
        specials = dict(getattr(tokenizer, "special_ids", {}) or {})
        limit = min(n, tokenizer.vocab_size)
        out = cls([tokenizer.token_bytes(i) for i in range(limit)] + [None] * (n - limit), specials, n)
        if warm:
            out.warm()
        return out

    def warm(self) -> None:
        """Build what the common grammars' first masks need (the loop tables of JSON string bodies
        and XML raw values), so a first constrained request does not pay for them."""
        for loop in common_loop_classes():
            self.loop_table(loop)
            self.lastbad(loop)
        self.warm_whitespace(MAX_WS + 2)
        for _, lo, hi in self.children(0, 0, len(self)):
            self.child_map(1, lo, hi)  # the first-byte nodes' children: every container walk starts there
        self.ws_table()
        self.warm_frames(common_leaves())

    def warm_frames(self, leaves) -> None:
        """Build the frame masks of `leaves` at every local state they reach (shared by every
        grammar on this vocabulary: a JSON string body, a raw XML value, its closer...)."""
        scratch = CompiledConstraint(Grammar(Lit(b"\0"), "warm"), self)
        for node in leaves:
            for local in leaf_locals(node):
                scratch._frame(node, node.signature(), local)

    def mask_from_sorted(self, acc: np.ndarray, extra) -> TokenMask:
        """A TokenMask from kept sorted positions plus kept ids (`extra`), without a scatter over the
        whole vocabulary when the short side is short (a dense state refuses a few thousand ids)."""
        acc = acc.copy() if extra else acc
        rest = []
        for t in extra:
            p = int(self.pos_of[t])
            if p >= 0:
                acc[p] = True
            else:
                rest.append(t)
        rest = np.unique(np.asarray(rest, dtype=np.int64))
        n = int(np.count_nonzero(acc)) + int(rest.shape[0])
        if n <= self.vocab_size // 2:
            if n <= SHORT_SIDE:
                ids = np.sort(np.concatenate([self.order[np.flatnonzero(acc)], rest]))
                return TokenMask(True, ids.astype(np.int32), n)
        elif self.vocab_size - n <= SHORT_SIDE:
            out = self.outside[~np.isin(self.outside, rest)] if rest.shape[0] else self.outside
            ids = np.sort(np.concatenate([self.order[np.flatnonzero(~acc)], out]))
            return TokenMask(False, ids.astype(np.int32), n)
        keep = np.zeros(self.vocab_size, dtype=bool)
        keep[self.order[acc]] = True
        keep[rest] = True
        return TokenMask.from_bool(keep)

    def warm_whitespace(self, depth: int) -> None:
        """The trie nodes under whitespace-only prefixes (up to `depth` bytes): every JSON state
        between tokens walks them, so their child maps are built here rather than on a request."""
        stack = [(0, 0, len(self))]
        while stack:
            d, lo, hi = stack.pop()
            for b, (lo2, hi2) in self.child_map(d, lo, hi).items():
                if b in WS_BYTES and d + 1 < depth:
                    stack.append((d + 1, lo2, hi2))

    def ws_table(self):
        """The vocabulary's whitespace-prefix trie nodes, flattened (built once): `pure_pos` /
        `pure_len`, the tokens made only of whitespace (at most MAX_WS bytes) and their lengths;
        `by_byte[b]`: the ranges (k, lo, hi) of tokens that are k >= 1 whitespace bytes then b,
        by k. A state in a whitespace run reads each such range as it reads b (Node.ws_run), so
        its walk visits these ranges instead of the ~500 whitespace nodes one by one."""
        got = self._ws_table
        if got is None:
            pure_pos: list[int] = []
            pure_len: list[int] = []
            by_byte: dict[int, list] = {}
            todo = [(0, 0, len(self))]
            while todo:
                d, lo, hi = todo.pop()
                for b, lo2, hi2 in self.children(d, lo, hi):
                    if b in WS_BYTES:
                        if d + 1 <= MAX_WS:
                            k = lo2
                            while k < hi2 and self.lens[k] == d + 1:
                                pure_pos.append(k)
                                pure_len.append(d + 1)
                                k += 1
                            todo.append((d + 1, lo2, hi2))
                    elif d > 0:
                        by_byte.setdefault(b, []).append((d, lo2, hi2))
            for entries in by_byte.values():
                entries.sort()
            got = self._ws_table = (np.asarray(pure_pos, dtype=np.int64), np.asarray(pure_len, dtype=np.int64),
                                    by_byte)
        return got

    def loop_table(self, loop: bytes) -> LoopTable:
        got = self._tables.get(loop)
        if got is None:
            got = self._tables[loop] = LoopTable(self, loop)
        return got


class PosSet:
    """A set of sorted vocabulary positions (tokens of a VocabIndex) as its shorter side: the
    kept positions (`allow`) or the refused ones. `n` kept in all. The token-id list (what a
    TokenMask holds) is made once per set and kept: a frame's set is shared by many states."""

    __slots__ = ("allow", "pos", "n", "_bool", "_ids")

    def __init__(self, allow: bool, pos: np.ndarray, n: int, keep: np.ndarray | None = None):
        self.allow, self.pos, self.n = allow, pos, n
        self._bool = keep
        self._ids = None

    @classmethod
    def from_bool(cls, acc: np.ndarray, keep_bool: bool = False) -> "PosSet":
        n = int(np.count_nonzero(acc))
        if n <= acc.shape[0] // 2:
            out = cls(True, np.flatnonzero(acc), n)
        else:
            out = cls(False, np.flatnonzero(~acc), n)
        if keep_bool:
            out._bool = acc
        return out

    @classmethod
    def from_walk(cls, acc: np.ndarray, single: list, spans: list) -> "PosSet":
        """from_bool of a walk's result (acc, with `single` positions not yet set), reading only
        the spans the walk wrote when they are short (a container frame keeps a few hundred
        tokens: no pass over all 248K)."""
        total = sum(s[1] - s[0] if isinstance(s, tuple) else s.shape[0] for s in spans)
        if single:
            acc[np.asarray(single, dtype=np.int64)] = True
        if total > acc.shape[0] // 8:
            return cls.from_bool(acc)
        pieces = [np.asarray(single, dtype=np.int64)]
        for s in spans:
            pieces.append(s[0] + np.flatnonzero(acc[s[0]:s[1]]) if isinstance(s, tuple) else s)
        pos = np.unique(np.concatenate(pieces))
        return cls(True, pos, int(pos.shape[0]))

    def bool(self, size: int) -> np.ndarray:
        """The set as a bool per sorted position (shared when kept: do not modify)."""
        if self._bool is not None:
            return self._bool
        out = np.full(size, not self.allow, dtype=bool)
        out[self.pos] = self.allow
        return out

    def ids(self, vocab: "VocabIndex") -> np.ndarray:
        """The TokenMask id list of this set alone (sorted int32): the kept token ids, or the
        refused ones with the ids outside the trie (specials, padding rows) among them."""
        got = self._ids
        if got is None:
            ids = vocab.order[self.pos]
            if not self.allow:
                ids = np.concatenate([ids, vocab.outside])
            got = self._ids = np.sort(ids).astype(np.int32)
        return got


class Parts:
    """A whole-vocabulary mask as the union of shared sets (frame masks, walked masks) and a few
    extra kept positions (tokens that leave a frame and are checked against the stack below)."""

    __slots__ = ("bases", "extra")

    def __init__(self, bases: tuple, extra: np.ndarray):
        self.bases, self.extra = bases, extra

    @staticmethod
    def union(items) -> "Parts":
        items = list(items)
        if len(items) == 1:
            return items[0]
        bases, seen, extras = [], set(), []
        for it in items:
            for b in it.bases:
                if id(b) not in seen and b.n:
                    seen.add(id(b))
                    bases.append(b)
            if it.extra.shape[0]:
                extras.append(it.extra)
        extra = np.unique(np.concatenate(extras)) if extras else _NO_POS
        return Parts(tuple(bases), extra)

    def empty(self) -> bool:
        return not self.extra.shape[0] and not any(b.n for b in self.bases)

    def nbytes(self) -> int:
        """Bytes this entry holds (its sets' position lists, counted even when shared)."""
        return int(self.extra.nbytes) + sum(int(b.pos.nbytes) for b in self.bases)

    def bool(self, size: int) -> np.ndarray:
        acc = np.zeros(size, dtype=bool)
        for b in self.bases:
            if b.n:
                acc |= b.bool(size)
        acc[self.extra] = True
        return acc


class FrameMask:
    """The tokens of one lone frame (node, local), whatever stack it tops (engine docs: frame
    masks). `inside`: tokens whose bytes keep the frame (or frames it calls) alive, or finish it
    exactly at their last byte -- allowed under any stack. Tokens that finish the frame before
    their last byte leave it: each such (token, exit point) is kept as the remaining bytes
    (`rems`, a TrieIndex of the distinct remainders; `ex_pos` / `ex_rem` pair a token's sorted
    position with a remainder), which the stack below must read. Tokens allowed in the lone
    frame are not listed as leaving (they are allowed anyway). Whether the frame may end before
    reading anything (can_end) is the caller's: the stack below then reads the whole token."""

    __slots__ = ("inside", "rems", "ex_pos", "ex_rem")

    def __init__(self, inside: PosSet | None, rems, ex_pos: np.ndarray, ex_rem: np.ndarray):
        # inside None: too many tokens leave this frame for the remainder check to pay (a
        # whitespace run: " word"); stacks topped by it walk the trie.
        self.inside, self.rems, self.ex_pos, self.ex_rem = inside, rems, ex_pos, ex_rem


class CompiledConstraint:
    """One grammar over one vocabulary: interned states, transitions, cached masks. Shared by
    every request with the same grammar key; calls are serialized by the engine thread."""

    def __init__(self, grammar: Grammar, vocab: VocabIndex, max_mask_bytes: int = 256 << 20,
                 frames: bool = True):
        self.grammar = grammar
        self.vocab = vocab
        # frames: masks composed from per-frame masks shared across stacks and grammars (the
        # default); False: every state walks the whole trie (the earlier path, kept as the check).
        self.frames = frames
        self._anything: list[bool] = []
        self._ws_runs: dict[int, tuple | None] = {}
        self._stack_parts: OrderedDict[tuple, Parts] = OrderedDict()
        self._parts_bytes = 0
        self._sid_parts: OrderedDict[int, Parts] = OrderedDict()
        self._ids: dict[frozenset, int] = {}
        self._sets: list[frozenset] = []
        self._next: list[dict[int, int]] = []
        self._accepts: list[bool] = []
        self._loop: dict[int, bytes | None] = {}
        self._first: dict[int, frozenset] = {}
        self._root_loops: OrderedDict[int, np.ndarray] = OrderedDict()  # loop sid -> sorted keep
        self._masks: OrderedDict[tuple, TokenMask] = OrderedDict()  # (sid, end ids) -> mask
        self._mask_bytes = 0
        self.max_mask_bytes = max_mask_bytes
        self._special_ids = {t: i for t, i in vocab.specials.items() if t in grammar.specials}
        self._all_specials = frozenset(vocab.specials.values())
        self._dist: dict[int, int] = {}
        self._closing: dict = {}
        self.start = self._intern(grammar.start())
        self.compile_s = 0.0
        self.stats = {"mask_misses": 0, "mask_hits": 0}

    def precompute(self) -> None:
        """Work done when a request's constraint is compiled, before its decoding starts: the
        frame masks of the grammar's leaves (enum values, literals; the common ones are built with
        the vocabulary index) and the start state's mask, which every output visits."""
        t0 = time.perf_counter()
        if self.frames:
            leaves = grammar_leaves(self.grammar.root)
            for node in leaves:
                for local in leaf_locals(node):
                    self._frame(node, node.signature(), local)
        self.allowed(self.start)  # (kept for every request's end ids unless the start accepts)
        self.compile_s += time.perf_counter() - t0

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
            self._anything.append(((ANYTHING, 0),) in states)
        return sid

    def step(self, sid: int, b: int) -> int:
        nxt = self._next[sid]
        got = nxt.get(b)
        if got is None:
            got = self._intern(self.grammar.step(self._sets[sid], b))
            nxt[b] = got
        return got

    def first_bytes(self, sid: int) -> frozenset:
        """A superset of the bytes state sid does not refuse (grammar.stack_first over its stacks)."""
        got = self._first.get(sid)
        if got is None:
            got = frozenset().union(*(stack_first(st) for st in self._sets[sid])) if sid != DEAD else frozenset()
            self._first[sid] = got
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
            got = loop_class(self._sets[sid])
            self._loop[sid] = got
        return got

    def allowed(self, sid: int, stop_ids=()) -> "TokenMask":
        """The tokens allowed in state sid, the end ids included when it accepts (or when nothing
        else is: a request then ends instead of wedging). Shared objects: do not modify."""
        key = (sid, stop_ids if isinstance(stop_ids, frozenset) else frozenset(stop_ids))
        mask = self._masks.get(key)
        if mask is None and key[1] and not self.accepts(sid):
            # A state that does not accept and allows some token has the same mask whatever the
            # end ids are (they are added only to accepting or empty states): one entry for all,
            # so a mask made at compile time (no end ids known) serves every request.
            key0 = (sid, frozenset())
            mask = self._masks.get(key0)
            if mask is not None and len(mask):
                key = key0
            else:
                mask = None
        if mask is not None:
            self._masks.move_to_end(key)
            self.stats["mask_hits"] += 1
            return mask
        self.stats["mask_misses"] += 1
        ends = [t for t in key[1] if 0 <= t < self.vocab.vocab_size]
        if self.frames:
            parts = self._state_parts(sid) if sid != DEAD else Parts((), _NO_POS)
            extra = self._special_extra(sid)
            with_ends = bool(ends) and (self.accepts(sid) or not (extra or not parts.empty()))
            if with_ends:
                extra = extra + ends
            mask = self._parts_mask(parts, extra)
        else:
            acc, extra = self._compute(sid)
            with_ends = bool(ends) and (self.accepts(sid) or not (extra or acc.any()))
            if with_ends:
                extra = extra + ends
            mask = self.vocab.mask_from_sorted(acc, extra)
        if key[1] and not with_ends and not self.accepts(sid) and len(mask):
            key = (sid, frozenset())  # (the end ids did not enter it: see above)
        self._masks[key] = mask
        self._mask_bytes += mask.ids.nbytes
        while self._mask_bytes > self.max_mask_bytes and len(self._masks) > 1:
            _, old = self._masks.popitem(last=False)
            self._mask_bytes -= old.ids.nbytes
        return mask

    def dense_mask(self, sid: int, stop_ids=()) -> np.ndarray:
        """allowed() as a bool vector over the vocabulary (for a device upload)."""
        return self.allowed(sid, stop_ids).dense(self.vocab.vocab_size)

    def _compute(self, sid: int) -> tuple[np.ndarray, list[int]]:
        """(kept trie tokens as a bool per sorted position, kept special ids)."""
        if sid == DEAD:
            return np.zeros(len(self.vocab), dtype=bool), []
        return self._kept(self.vocab, sid), self._special_extra(sid)

    def _kept(self, ix, sid: int) -> np.ndarray:
        """A bool per sorted position of index ix: the tokens state sid keeps (one whole walk)."""
        acc = np.zeros(len(ix), dtype=bool)
        single: list[int] = []
        self._walk(ix, sid, 0, 0, len(ix), acc, single)
        if single:
            acc[np.asarray(single, dtype=np.int64)] = True
        return acc

    def _special_extra(self, sid: int) -> list[int]:
        if sid == DEAD or not self._special_ids:
            return []
        fb = self.first_bytes(sid)  # (a special whose first byte the state refuses needs no steps)
        return [tid for text, tid in self._special_ids.items()
                if text.encode()[0] in fb and self.step_bytes(sid, text.encode()) != DEAD]

    # -- masks composed from frame masks ---------------------------------------------------
    # A state's mask is the union of its stacks' masks. A stack's tokens either stay in its top
    # frame (or what that frame calls) or finish it mid-token and go on in the stack below, which
    # does not change while the top frame reads. So a stack topped by a leaf frame takes that
    # frame's mask (FrameMask: computed once per vocabulary for every node of the same signature
    # and local state, whatever stack it tops), plus the few tokens that leave the frame whose
    # remaining bytes the stack below reads (a walk over the frame's distinct remainders), plus,
    # when the frame may end at once, the stack below's own mask. Frames whose next read is the
    # same call for every byte (a Seq, a value about to start) are pushed first (Node.expand), so
    # `<parameter=K>\n` of every parameter lands on the one shared raw-text frame mask.

    def _expand(self, stack: tuple, out: set, depth: int = 0) -> None:
        """The stacks that read the next byte as `stack` would (grammar.advance, with the frames
        whose actions do not depend on the byte applied ahead of it)."""
        if not stack:
            return  # a finished run reads nothing more
        if depth > 64:
            raise GrammarError("grammar recursion without progress")
        node, local = stack[-1]
        acts = node.expand(local)
        if acts is None:
            out.add(stack)
            return
        rest = stack[:-1]
        for act in acts:
            if act[0] == CALL:
                child = act[2]
                self._expand(rest + ((node, act[1]), (child, child.init)), out, depth + 1)
            elif act[0] == TAIL:
                child = act[1]
                self._expand(rest + ((child, child.init),), out, depth + 1)
            else:  # pragma: no cover - Node.expand promises CALL / TAIL only
                raise AssertionError(f"{type(node).__name__}.expand gave {act!r}")
        if node.can_end(local):
            self._expand(rest, out, depth + 1)

    def _state_parts(self, sid: int) -> Parts:
        got = self._sid_parts.get(sid)
        if got is not None:
            self._sid_parts.move_to_end(sid)
            return got
        stacks: set = set()
        for st in self._sets[sid]:
            self._expand(st, stacks)
        got = Parts.union([self._stack_mask(st) for st in stacks]) if stacks else Parts((), _NO_POS)
        self._sid_parts[sid] = got
        while len(self._sid_parts) > PARTS_KEPT:
            self._sid_parts.popitem(last=False)
        return got

    def _stack_mask(self, stack: tuple) -> Parts:
        got = self._stack_parts.get(stack)
        if got is not None:
            self._stack_parts.move_to_end(stack)
            return got
        node, local = stack[-1]
        sig = node.signature()
        v = self.vocab
        fm = None if sig is None else self._frame(node, sig, local)
        if sig is None or fm.inside is None:  # a container frame (or one many tokens leave): walk
            sid = self._intern(frozenset([stack]))
            loop = self._loop_class(sid)
            if loop is not None:  # (the root walk of a loop state would ask for this very mask)
                acc = self._loop_walk(sid, loop)
                got = Parts((PosSet.from_bool(acc),), _NO_POS)
            else:
                acc = np.zeros(len(v), dtype=bool)
                single: list[int] = []
                spans: list = []
                self._walk(v, sid, 0, 0, len(v), acc, single, spans)
                got = Parts((PosSet.from_walk(acc, single, spans),), _NO_POS)
        else:
            rest = stack[:-1]
            got = Parts((fm.inside,), _NO_POS)
            if rest:
                rsid = self._intern(frozenset([rest]))
                got = Parts((fm.inside,), self._crossing(fm, rsid))
                if node.can_end(local):
                    got = Parts.union([got, self._state_parts(rsid)])
        self._stack_parts[stack] = got
        self._parts_bytes += got.nbytes()
        while (len(self._stack_parts) > PARTS_KEPT or self._parts_bytes > PARTS_BYTES) and len(self._stack_parts) > 1:
            _, old = self._stack_parts.popitem(last=False)
            self._parts_bytes -= old.nbytes()
        return got

    def _crossing(self, fm: FrameMask, rsid: int) -> np.ndarray:
        """Sorted positions of the tokens that leave frame mask fm and whose remainder the
        stack below (state rsid) reads."""
        if fm.rems is None or rsid == DEAD:
            return _NO_POS
        sacc = self._kept(fm.rems, rsid)
        return np.unique(fm.ex_pos[sacc[fm.ex_rem]])

    def _frame(self, node, sig, local) -> FrameMask:
        frames = self.vocab.frames
        key = (sig, local)
        got = frames.get(key)
        if got is not None:
            frames.move_to_end(key)
            return got
        got = self._build_frame(node, local)
        frames[key] = got
        while len(frames) > FRAMES_KEPT:
            frames.popitem(last=False)
        return got

    def _build_frame(self, node, local) -> FrameMask:
        """A leaf frame's mask: `inside` from a walk of the lone frame; the tokens that leave it
        from a second walk with a parent that reads anything (ANYTHING) under the frame -- the
        tokens it keeps and `inside` does not -- each simulated for its exit points."""
        v = self.vocab
        n = len(v)
        lone = ((node, local),)
        sid = self._intern(frozenset([lone]))
        loop = self._loop_class(sid)
        if loop is not None:  # a string body: the per-class table and a walk over its suffixes
            inside = self._loop_walk(sid, loop)
            under = self._loop_walk(self._intern(frozenset([((ANYTHING, 0),) + lone])), loop)
        else:
            inside = np.zeros(n, dtype=bool)
            single: list[int] = []
            self._walk(v, sid, 0, 0, n, inside, single)
            if single:
                inside[np.asarray(single, dtype=np.int64)] = True
            # The parent's walk starts after the frame's first byte: a frame that may end at once
            # hands the whole token to the stack below, which the caller adds (not an exit here).
            under = np.zeros(n, dtype=bool)
            single = []
            for b, lo, hi in self._kids(v, sid, 0, 0, n):
                out: list = []
                advance(lone, b, out)
                if out:
                    s1 = self._intern(frozenset(((ANYTHING, 0),) + st for st in out))
                    self._walk(v, s1, 1, lo, hi, under, single)
            if single:
                under[np.asarray(single, dtype=np.int64)] = True
        leaving = np.flatnonzero(under & ~inside)
        if leaving.shape[0] > FRAME_EXITS_MAX:
            return FrameMask(None, None, _NO_POS, _NO_POS)
        rem_of: dict[bytes, int] = {}
        ex_pos: list[int] = []
        ex_rem: list[int] = []
        toks = v.toks
        for p in leaving.tolist():
            t = toks[p]
            s = sid
            for j in range(len(t) - 1):
                s = self.step(s, t[j])
                if s == DEAD:
                    break
                if self._accepts[s]:  # the frame may be finished after t[:j + 1]
                    ex_pos.append(p)
                    ex_rem.append(rem_of.setdefault(t[j + 1:], len(rem_of)))
        rems = None
        if rem_of:
            uniq = sorted(rem_of)
            remap = np.empty(len(uniq), dtype=np.int64)
            for i, u in enumerate(uniq):
                remap[rem_of[u]] = i
            rems = TrieIndex(uniq, np.arange(len(uniq), dtype=np.int64))
            ex = remap[np.asarray(ex_rem, dtype=np.int64)]
        else:
            ex = _NO_POS
        return FrameMask(PosSet.from_bool(inside, keep_bool=loop is not None), rems,
                         np.asarray(ex_pos, dtype=np.int64), ex)

    def _parts_mask(self, parts: Parts, extra_ids: list[int]) -> TokenMask:
        """The TokenMask of parts plus kept ids (specials, end ids). One shared set adjusted by
        a few ids (the common case) costs a short merge, not a pass over the vocabulary."""
        v = self.vocab
        add_pos = [parts.extra]
        add_ids = []
        for t in extra_ids:
            p = int(v.pos_of[t])
            if p >= 0:
                add_pos.append(np.asarray([p], dtype=np.int64))
            else:
                add_ids.append(t)
        bases = [b for b in parts.bases if b.n]
        if len(bases) > 1:
            acc = parts.bool(len(v))
            return v.mask_from_sorted(acc, extra_ids)
        add = np.concatenate([v.order[np.concatenate(add_pos)], np.asarray(add_ids, dtype=np.int64)])
        add = np.unique(add).astype(np.int32)
        if not bases:
            return TokenMask(True, add, int(add.shape[0]))
        base = bases[0]
        ids = base.ids(v)
        if base.allow:
            if add.shape[0]:
                add = add[~np.isin(add, ids, assume_unique=True)]
                if add.shape[0]:
                    ids = np.sort(np.concatenate([ids, add]))
            return TokenMask(True, ids, int(ids.shape[0]))
        if add.shape[0]:
            ids = ids[~np.isin(ids, add, assume_unique=True)]
        return TokenMask(False, ids, v.vocab_size - int(ids.shape[0]))

    def _walk(self, ix: TrieIndex, sid: int, d: int, lo: int, hi: int, acc: np.ndarray, single: list,
              spans: list | None = None) -> None:
        """Strings in sorted [lo, hi) of ix share their first d bytes, after which the grammar is in
        sid; mark the ones it keeps alive in acc (or single: sorted positions). spans (optional)
        gets every (lo, hi) range of acc written and every array of positions set, so a sparse
        result is read back without a pass over the whole vocabulary (PosSet.from_walk)."""
        lens = ix.lens
        while lo < hi and lens[lo] == d:  # strings that end here are allowed
            single.append(lo)
            lo += 1
        if lo >= hi:
            return
        if self._anything[sid]:  # the stand-in parent reads every byte string
            acc[lo:hi] = True
            if spans is not None:
                spans.append((lo, hi))
            return
        main = ix is self.vocab
        if d == 0 and main and self.frames and lo == 0 and hi == len(ix):
            run = self._ws_run(sid)
            if run is not None:
                self._walk_ws_run(sid, run, acc, single, spans)
                return
        # (Suffix tables: every string starts outside the class, so not at their root; below it the
        # ranges are small but the check is cheap and spares a byte-by-byte walk of each.)
        loop = (self._loop_class(sid) if (hi - lo >= LOOP_MIN_RANGE or sid in self._root_loops if main
                                          else d > 0 and hi - lo >= 4) else None)
        if loop is not None:
            if main and not ix.toks[lo][:d].translate(None, loop):
                # The shared prefix is all class bytes, which the loop state sid reads back into
                # itself: each token's fate from here is its fate from sid at the vocabulary root,
                # so the range takes sid's whole-vocabulary mask (one table per loop state: a raw
                # XML value's tokens, the token after `</` inside one, a string body mid-token).
                acc[lo:hi] |= self._root_loop(sid, loop)[lo:hi]
                if spans is not None:
                    spans.append((lo, hi))
                return
            lb = ix.lastbad(loop)[lo:hi]
            good = lb <= d
            acc[lo:hi] |= good
            if spans is not None:
                spans.append((lo, hi))
            toks = ix.toks
            for k in (np.flatnonzero(~good) + lo).tolist():
                if self.step_bytes(sid, toks[k][d:]) != DEAD:
                    single.append(k)
            return
        if d >= TRIE_DEPTH:
            for k in range(lo, hi):
                if self.step_bytes(sid, ix.toks[k][d:]) != DEAD:
                    single.append(k)
            return
        for b, lo2, hi2 in self._kids(ix, sid, d, lo, hi):
            nsid = self.step(sid, b)
            if nsid != DEAD:
                self._walk(ix, nsid, d + 1, lo2, hi2, acc, single, spans)

    def _ws_run(self, sid: int):
        """(count, bound) when state sid is one stack whose top frame is in a whitespace run
        (Node.ws_run) and whitespace reaches no frame below it; else None."""
        got = self._ws_runs.get(sid, 0)
        if got == 0:
            got = None
            states = self._sets[sid]
            if len(states) == 1:
                (stack,) = states
                if stack:
                    node, local = stack[-1]
                    run = node.ws_run(local)
                    if run is not None and run[1] <= MAX_WS and (
                            not node.can_end(local) or not (stack_first(stack[:-1]) & WS_BYTES)):
                        got = run[:2]
            self._ws_runs[sid] = got
        return got

    def _walk_ws_run(self, sid: int, run: tuple, acc: np.ndarray, single: list, spans: list | None = None) -> None:
        """_walk from the root for a state in a whitespace run: the tokens that start with a
        non-whitespace byte as usual; whitespace-only tokens by length; `k` whitespace bytes then
        b (k within the run's room) by the one state after b, the same for every k (ws_run)."""
        v = self.vocab
        count, bound = run
        room = bound - count
        for b, lo, hi in self._kids(v, sid, 0, 0, len(v)):
            if b not in WS_BYTES:
                nsid = self.step(sid, b)
                if nsid != DEAD:
                    self._walk(v, nsid, 1, lo, hi, acc, single, spans)
        if room <= 0:
            return
        pure_pos, pure_len, by_byte = v.ws_table()
        pure = pure_pos[pure_len <= room]
        acc[pure] = True
        if spans is not None:
            spans.append(pure)
        for b in self.first_bytes(sid):
            entries = by_byte.get(b)
            if not entries or b in WS_BYTES:
                continue
            nsid = self.step(sid, b)
            if nsid == DEAD:
                continue
            for k, lo, hi in entries:
                if k > room:
                    break
                self._walk(v, nsid, k + 1, lo, hi, acc, single, spans)

    def _root_loop(self, sid: int, loop: bytes) -> np.ndarray:
        """Per sorted vocabulary position: the loop state sid keeps the token (with frames: its
        composed mask; else _loop_walk)."""
        got = self._root_loops.get(sid)
        if got is not None:
            self._root_loops.move_to_end(sid)
            return got
        got = self._state_parts(sid).bool(len(self.vocab)) if self.frames else self._loop_walk(sid, loop)
        self._root_loops[sid] = got
        while len(self._root_loops) > ROOT_LOOPS_KEPT:
            self._root_loops.popitem(last=False)
        return got

    def _loop_walk(self, sid: int, loop: bytes) -> np.ndarray:
        """The loop state sid's whole-vocabulary keep (VocabIndex.loop_table: the class-only
        tokens, plus a walk over the distinct suffixes from the first outside byte)."""
        tab = self.vocab.loop_table(loop)
        got = tab.good.copy()
        sacc = self._kept(tab.suffixes, sid)
        got[tab.bad_pos[sacc[tab.bad_suffix]]] = True
        return got

    def _kids(self, ix: TrieIndex, sid: int, d: int, lo: int, hi: int):
        """The children of trie node (d, lo, hi) whose byte sid may read: the state's first bytes
        looked up when they are few, else the node's children filtered by them. Either way no
        transition is made for a byte the grammar refuses outright (most of a cold walk's cost)."""
        fb = self.first_bytes(sid)
        # Memoized per (node, first-byte set) on the index: states of one frame kind share their
        # first bytes (every `<parameter=` position reads `<`), so each node filters once.
        key = (d, lo, fb)
        memo = ix._kid_memo
        got = memo.get(key)
        if got is not None:
            return got
        kids = ix.children(d, lo, hi)
        if len(fb) * 4 < len(kids):
            cmap = ix.child_map(d, lo, hi)
            got = [(b, *cmap[b]) for b in sorted(fb) if b in cmap]
        else:
            got = [k for k in kids if k[0] in fb]
        if len(memo) >= KID_MEMO_KEPT:
            memo.clear()  # (a bound, not an LRU: entries are cheap to make again)
        memo[key] = got
        return got

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
                for b in self.first_bytes(s):
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
        for b, lo2, hi2 in self._kids(v, sid, d, lo, hi):
            nsid = self.step(sid, b)
            if nsid != DEAD and self.distance(nsid) == here - 1:
                self._close_walk(nsid, d + 1, lo2, hi2, picked)


def loop_class(states: frozenset) -> bytes | None:
    """Bytes that read every stack of `states` back into itself (so the state maps to itself),
    from the top frames' structural answers (Node.loop_bytes); None when fewer than
    LOOP_MIN_BYTES. Exact by construction: each such byte leaves each stack unchanged. (Stepping
    all 256 bytes of every state to find this cost 70% of a cold mask walk.)"""
    common = None
    for stack in states:
        if not stack:  # a finished run (a lone frame done, in a frame mask walk) reads no byte
            return None
        node, local = stack[-1]
        got = node.loop_bytes(local)
        if not got:
            return None
        common = got if common is None else common & got
    if common is None or len(common) < LOOP_MIN_BYTES:
        return None
    return bytes(sorted(common))


class ConstraintCache:
    """Compiled constraints by grammar key, least recently used dropped first."""

    def __init__(self, vocab_factory, size: int = 16):
        self._vocab_factory = vocab_factory
        self._vocab: VocabIndex | None = None
        self._vocab_lock = threading.Lock()
        self._items: OrderedDict[str, CompiledConstraint] = OrderedDict()
        self.size = size
        self.index_build_s: float | None = None

    @property
    def vocab(self) -> VocabIndex:
        if self._vocab is None:
            with self._vocab_lock:  # a request arriving while prepare() builds it waits for it
                if self._vocab is None:
                    t0 = time.perf_counter()
                    self._vocab = self._vocab_factory()
                    self.index_build_s = time.perf_counter() - t0
        return self._vocab

    def prepare(self, background: bool = True, on_ready=None) -> None:
        """Build the vocabulary index now (the server calls this at start: about 1.5 s for the 248K
        vocabulary, which the first constrained request would otherwise wait for); then on_ready()."""

        def build() -> None:
            self.vocab
            if on_ready is not None:
                on_ready()

        if background:
            threading.Thread(target=build, name="q27-vocab-index", daemon=True).start()
        else:
            build()

    def get(self, grammar: Grammar) -> CompiledConstraint:
        got = self._items.get(grammar.key)
        if got is None:
            got = CompiledConstraint(grammar, self.vocab)
            got.precompute()
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
