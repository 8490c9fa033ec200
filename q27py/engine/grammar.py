"""Grammars over bytes: JSON Schema (the subset tools use), any JSON, and the Qwen XML tool-call syntax.

No grammar library (the design card admits none): a grammar is a small tree of
nodes, run as a pushdown automaton over bytes. A run's state is a set of stacks
(nondeterminism only where a schema is ambiguous, e.g. anyOf of overlapping
branches); a stack is a tuple of (node, local) frames, top last; both are
hashable, so the token-level code (engine/constraint.py) interns states to ints
and caches one allowed-token mask per state.

Node protocol:
  node.init            the local state a fresh frame starts in
  node.step(local, b)  the actions for consuming byte b in this frame:
                         (CONT, local')          keep the frame, now at local'
                         (DONE,)                 b consumed, the frame is finished
                         (CALL, local', child)   the frame resumes at local' after child; child consumes b
                         (TAIL, child)           the frame becomes child, which consumes b
  node.can_end(local)  the frame may finish here without consuming (its parent then reads b)
  node.expand(local)   step(local, b) when it is the same CALL / TAIL actions for every byte b
                       (a Seq, a Union, a value about to start), else None: the mask code pushes
                       such frames ahead of time so states share their top frame's mask
  node.ws_run(local)   (count, bound, local0) when the frame is in a bounded whitespace run:
                       a whitespace byte goes to the same local with count + 1 (refused at
                       bound), any other byte acts as at local0 (count 0); else None. The mask
                       walk then skips the vocabulary's whitespace-prefix nodes one by one
  node.signature()     (leaves) a hashable key equal for nodes that act the same, so a frame's
                       token mask is computed once per vocabulary for all of them; None: by identity

Every live state can be completed (no node enters a local it cannot finish from),
so "a token is allowed" only needs its bytes to keep some stack alive.

What is enforced, on purpose compact (docs/ARCHITECTURE.md, "Output control"):
- objects: declared properties only, each at most once, in any order, all
  `required` ones before `}`; an object schema without `properties` takes any
  keys (values per `additionalProperties`, else any JSON);
- strings with every JSON escape; enums / const as their canonical JSON text;
  integer vs number; booleans; null; arrays with minItems / maxItems;
  anyOf / oneOf / type lists (oneOf as anyOf: exclusivity is not checked);
  local $ref (#/$defs/.., #/definitions/..), recursion included;
- whitespace between tokens: runs of at most MAX_WS bytes (a bounded run keeps a
  weak model from spinning on blanks forever);
- not enforced (accepted and ignored): pattern, format, min/max length, numeric
  bounds, uniqueItems, propertyNames; nesting of "any JSON" is cut at ANY_DEPTH
  (deeper values are scalars).
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from q27py.errors import Q27Error

CONT, DONE, CALL, TAIL = 0, 1, 2, 3
MAX_WS = 16
ANY_DEPTH = 6
WS = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")


class GrammarError(Q27Error, ValueError):
    """A schema this engine cannot compile; the message names the place."""


class Node:
    init: Any = 0

    def step(self, local, b: int) -> list:
        raise NotImplementedError

    def can_end(self, local) -> bool:
        return False

    def expand(self, local) -> list | None:
        return None

    def signature(self):
        return None

    def ws_run(self, local):
        return None

    def loop_bytes(self, local) -> frozenset | None:
        """Bytes b with step(local, b) == [(CONT, local)] exactly while the frame cannot end here:
        a stack topped by this frame reads any of them back into itself. A structural answer (a
        subset is enough; None: none known), so the token-mask walk finds string bodies without
        stepping all 256 bytes of every state (engine/constraint.py, loop states)."""
        return None

    def first(self, local) -> frozenset:
        """A superset of the bytes this frame may consume at `local` (its callees' included; not
        the parent's after it ends: can_end says that). The mask walk steps only these bytes of a
        state, so refused bytes cost no transition (engine/constraint.py, first_bytes). Leaves
        (nodes that only CONT / DONE) get the exact set from step(); others say it structurally."""
        return ALL_BYTES

    def first0(self) -> frozenset:
        """first() of a fresh frame, as a caller that CALLs / TAILs it sees: every byte when the
        node may be empty (the caller's own continuation could then read it)."""
        got = self.__dict__.get("_first0")
        if got is None:
            self._first0 = ALL_BYTES  # re-entry (a left-recursive $ref): the safe answer
            got = ALL_BYTES if _nullable(self) else self.first(self.init)
            self._first0 = got
        return got


class Leaf(Node):
    """A node whose actions are only CONT / DONE: first() is read off step() (memoized)."""

    def first(self, local) -> frozenset:
        memo = self.__dict__.setdefault("_firsts", {})
        got = memo.get(local)
        if got is None:
            got = memo[local] = frozenset(b for b in range(256) if self.step(local, b))
        return got


ALL_BYTES = frozenset(range(256))


def stack_first(stack: tuple) -> frozenset:
    """A superset of the bytes that keep `stack` alive (top frame first, then each parent while
    the frames above it may end)."""
    out = frozenset()
    for node, local in reversed(stack):
        out |= node.first(local)
        if not node.can_end(local):
            break
    return out


def _next_bytes(prefix: bytes, texts) -> frozenset:
    n = len(prefix)
    return frozenset(t[n] for t in texts if len(t) > n and t.startswith(prefix))


# ---------------------------------------------------------------------------
# The automaton


def advance(stack: tuple, b: int, out: list, depth: int = 0) -> None:
    """Append to `out` every stack that results from consuming byte b."""
    if not stack:
        return
    if depth > 64:
        raise GrammarError("grammar recursion without progress")
    node, local = stack[-1]
    rest = stack[:-1]
    for act in node.step(local, b):
        kind = act[0]
        if kind == CONT:
            out.append(rest + ((node, act[1]),))
        elif kind == DONE:
            out.append(rest)
        elif kind == CALL:
            child = act[2]
            advance(rest + ((node, act[1]), (child, child.init)), b, out, depth + 1)
        else:  # TAIL
            child = act[1]
            advance(rest + ((child, child.init),), b, out, depth + 1)
    if node.can_end(local):
        advance(rest, b, out, depth + 1)


def step_set(states: frozenset, b: int) -> frozenset:
    out: list = []
    for stack in states:
        advance(stack, b, out)
    return frozenset(out)


def stack_accepts(stack: tuple) -> bool:
    return all(node.can_end(local) for node, local in stack)


class Grammar:
    """A compiled grammar: its start state, and which special tokens' texts it may use."""

    def __init__(self, root: Node, key: str, specials: frozenset[str] = frozenset()):
        self.root = root
        self.key = key  # identity for caches (same key -> same language)
        self.specials = specials  # added-token texts (e.g. "<tool_call>") that may stand for their bytes

    def start(self) -> frozenset:
        return frozenset([((self.root, self.root.init),)])

    def step(self, states: frozenset, b: int) -> frozenset:
        return step_set(states, b)

    def accepts(self, states: frozenset) -> bool:
        return any(stack_accepts(s) for s in states)

    def matches(self, data: bytes) -> bool:
        """The whole of data is a sentence of the grammar (tests, checks)."""
        states = self.start()
        for b in data:
            states = step_set(states, b)
            if not states:
                return False
        return self.accepts(states)

    def viable(self, data: bytes) -> bool:
        """data is a prefix of some sentence."""
        states = self.start()
        for b in data:
            states = step_set(states, b)
            if not states:
                return False
        return True


# ---------------------------------------------------------------------------
# Leaf nodes


class Lit(Leaf):
    """One fixed byte string."""

    def __init__(self, text: bytes):
        assert text
        self.text = text

    def signature(self):
        return ("Lit", self.text)

    def first(self, i):  # (Leaf.first would step all 256 bytes once per instance and local)
        return frozenset((self.text[i],))

    def step(self, i, b):
        if self.text[i] != b:
            return []
        return [(DONE,)] if i + 1 == len(self.text) else [(CONT, i + 1)]


class LitSet(Leaf):
    """One of several fixed byte strings (enum values, property names): a trie walk."""

    def __init__(self, texts):
        texts = sorted(set(texts))
        if not texts or any(not t for t in texts):
            raise GrammarError("an enum needs non-empty values")
        self.texts = tuple(texts)
        self.init = b""
        self._prefixes = {t[:i] for t in texts for i in range(len(t) + 1)}
        self._full = set(texts)

    def signature(self):
        return ("LitSet", self.texts)

    def step(self, prefix, b):
        nxt = prefix + bytes((b,))
        if nxt not in self._prefixes:
            return []
        acts = []
        if nxt in self._full:
            acts.append((DONE,))
        if any(len(t) > len(nxt) and t.startswith(nxt) for t in self.texts):
            acts.append((CONT, nxt))
        return acts


class Ws(Leaf):
    """Optional whitespace run (at most MAX_WS bytes). No signature: almost every token leaves a
    whitespace run mid-token (" word"), so a frame mask would list the vocabulary as exits; a
    stack topped by it walks the trie (its first bytes are few)."""

    def step(self, n, b):
        if b in WS and n < MAX_WS:
            return [(CONT, n + 1)]
        return []

    def can_end(self, n):
        return True

    def ws_run(self, n):
        return (n, MAX_WS, 0)

    def first(self, n):  # (every Seq has its own Ws: no per-instance memo of 256 steps per local)
        return WS if n < MAX_WS else frozenset()


class Anything(Leaf):
    """Every byte string: the stand-in parent under a lone frame when the mask code asks which
    tokens leave that frame mid-token (engine/constraint.py, FrameMask). Not a grammar node."""

    def step(self, local, b):
        return [(CONT, 0)]

    def can_end(self, local):
        return True

    def loop_bytes(self, local):
        return ALL_BYTES


ANYTHING = Anything()


_ESCAPES = frozenset(b'"\\/bfnrt')
_HEX = frozenset(b"0123456789abcdefABCDEF")
_STR_BODY = frozenset(b for b in range(256) if (b >= 0x20 and b != 0x7F or b >= 0x80) and b not in (0x22, 0x5C))
_STR_FIRST = {0: frozenset(b'"'), 1: _STR_BODY | frozenset(b'"\\'), 2: _ESCAPES | frozenset(b"u"), 3: _HEX}


class Str(Leaf):
    """A JSON string, quotes included. local: 0 before the quote, 1 in the body, 2 after a
    backslash, 3..6 inside \\uXXXX (6 - local hex digits to go)."""

    def signature(self):
        return ("Str",)

    def step(self, s, b):
        if s == 0:
            return [(CONT, 1)] if b == 0x22 else []
        if s == 1:
            if b == 0x22:
                return [(DONE,)]
            if b == 0x5C:
                return [(CONT, 2)]
            return [(CONT, 1)] if b >= 0x20 and b != 0x7F or b >= 0x80 else []
        if s == 2:
            if b == 0x75:
                return [(CONT, 3)]
            return [(CONT, 1)] if b in _ESCAPES else []
        if b in _HEX:
            return [(CONT, s + 1)] if s < 6 else [(CONT, 1)]
        return []

    def loop_bytes(self, s):
        return _STR_BODY if s == 1 else None

    def first(self, s):
        return _STR_FIRST[min(s, 3)]


class Num(Leaf):
    """A JSON number (integer=True: no fraction or exponent). local: 0 start, 1 after '-',
    2 after a leading 0, 3 integer digits, 4 after '.', 5 fraction digits, 6 after e/E,
    7 after the exponent sign, 8 exponent digits."""

    def __init__(self, integer: bool):
        self.integer = integer

    def signature(self):
        return ("Num", self.integer)

    _FIRSTS: dict = {}

    def first(self, s):  # memoized per (integer, local) for all instances, not per instance
        key = (self.integer, s)
        got = Num._FIRSTS.get(key)
        if got is None:
            got = Num._FIRSTS[key] = frozenset(b for b in range(256) if self.step(s, b))
        return got

    def step(self, s, b):
        d = b in DIGITS
        if s in (0, 1):
            if b == 0x2D and s == 0:
                return [(CONT, 1)]
            if b == 0x30:
                return [(CONT, 2)]
            return [(CONT, 3)] if d else []
        if s == 3 and d:
            return [(CONT, 3)]
        if s in (2, 3):
            if self.integer:
                return []
            if b == 0x2E:
                return [(CONT, 4)]
            return [(CONT, 6)] if b in (0x65, 0x45) else []
        if s in (4, 5):
            if d:
                return [(CONT, 5)]
            return [(CONT, 6)] if s == 5 and b in (0x65, 0x45) else []
        if s == 6:
            if b in (0x2B, 0x2D):
                return [(CONT, 7)]
            return [(CONT, 8)] if d else []
        if s in (7, 8):
            return [(CONT, 8)] if d else []
        return []

    def can_end(self, s):
        return s in (2, 3, 5, 8)


class Union(Node):
    """Any of the branches (the frame becomes the branch that reads the first byte)."""

    def __init__(self, branches):
        self.branches = list(branches)

    def step(self, local, b):
        return [(TAIL, br) for br in self.branches]

    def expand(self, local):
        return self.step(local, 0)

    def first(self, local):
        return frozenset().union(*(br.first0() for br in self.branches))


class Seq(Node):
    """Nodes one after another. local: index of the part being read."""

    def __init__(self, parts):
        self.parts = list(parts)

    def step(self, i, b):
        acts = []
        # The part at i reads b; when it can also be empty (Ws), a later part may read b.
        while i < len(self.parts):
            part = self.parts[i]
            acts.append((CALL, i + 1, part) if i + 1 < len(self.parts) else (TAIL, part))
            if not _nullable(part):
                break
            i += 1
        return acts

    def can_end(self, i):
        return all(_nullable(p) for p in self.parts[i:])

    def expand(self, i):
        return self.step(i, 0)  # the part at i (and any after nullable ones) reads whatever comes

    def first(self, i):
        out = frozenset()
        while i < len(self.parts):  # as step(): a part that may be empty lets the next one read
            part = self.parts[i]
            if not _nullable(part):
                return out | part.first(part.init)
            out |= part.first(part.init)
            i += 1
        return out


_OBJ_OPEN = frozenset(b"{")
_OBJ_COLON = WS | frozenset(b":")
_OBJ_AFTER = {1: WS | frozenset(b'}"'), 6: WS | frozenset(b",}"), 7: WS | frozenset(b'"')}


def _nullable(node) -> bool:
    return node.can_end(node.init)


class Ref(Node):
    """A late-bound node ($ref, recursion): becomes its target."""

    def __init__(self):
        self.target: Node | None = None

    def step(self, local, b):
        return [(TAIL, self.target)]

    def expand(self, local):
        return self.step(local, 0)

    def first(self, local):
        return self.target.first0()


# ---------------------------------------------------------------------------
# Containers


class ObjectNode(Node):
    """A JSON object. props: [(name, value node)]; required: names; extra: value node for
    undeclared keys (None: no undeclared keys).

    local = (phase, used bitmask, x):
      0 before '{'; 1 after '{' (x: ws run); 7 after ',' (x: ws run); 2 in a declared key
      (x: name bytes matched after the quote); 3 in an undeclared key (x: Str local);
      4 before ':' (x: (key index or -1, ws run)); 5 after ':' (x: same); 6 after a value (x: ws run)."""

    def __init__(self, props, required, extra):
        # Each name as written after its opening quote, closing quote included; both the UTF-8 and
        # the \u-escaped spelling (json.dumps' default) are admitted.
        self.names = [(i, sp[1:]) for i, (n, _) in enumerate(props) for sp in _spellings(n)]
        self.values = [v for _, v in props]
        index = {n: i for i, (n, _) in enumerate(props)}
        self.req_mask = 0
        for r in required:
            if r not in index:
                raise GrammarError(f"required property {r!r} is not declared")
            self.req_mask |= 1 << index[r]
        self.all_mask = (1 << len(props)) - 1
        self.extra = extra
        self.init = (0, 0, 0)
        self._key = Str()

    def _open_key(self, used, b):
        if b != 0x22:
            return []
        acts = []
        if used != self.all_mask:
            acts.append((CONT, (2, used, b"")))
        if self.extra is not None:
            acts.append((CONT, (3, used, 1)))
        return acts

    def step(self, local, b):
        phase, used, x = local
        ws = b in WS
        if phase == 0:
            return [(CONT, (1, 0, 0))] if b == 0x7B else []
        if phase in (1, 7, 6):
            if ws:
                return [(CONT, (phase, used, x + 1))] if x < MAX_WS else []
            if phase == 1 and b == 0x7D:
                return [(DONE,)] if self.req_mask == 0 else []
            if phase == 6:
                if b == 0x2C:
                    return [(CONT, (7, used, 0))] if used != self.all_mask or self.extra is not None else []
                if b == 0x7D and used & self.req_mask == self.req_mask:
                    return [(DONE,)]
                return []
            return self._open_key(used, b)
        if phase == 2:
            s = x + bytes((b,))
            acts = []
            for i, name in self.names:
                if used >> i & 1 or not name.startswith(s):
                    continue
                acts.append((CONT, (4, used, (i, 0))) if len(name) == len(s) else (CONT, (2, used, s)))
            return _dedup(acts)
        if phase == 3:
            if x == 1 and b == 0x22:
                return [(CONT, (4, used, (-1, 0)))]
            return [(CONT, (3, used, a[1])) for a in self._key.step(x, b) if a[0] == CONT]
        key, n = x
        if ws:
            return [(CONT, (phase, used, (key, n + 1)))] if n < MAX_WS else []
        if phase == 4:
            return [(CONT, (5, used, (key, 0)))] if b == 0x3A else []
        # phase 5: the value reads b
        node = self.values[key] if key >= 0 else self.extra
        return [(CALL, (6, used | (1 << key if key >= 0 else 0), 0), node)]

    def ws_run(self, local):
        phase, used, x = local
        if phase in (1, 6, 7):
            return (x, MAX_WS, (phase, used, 0))
        if phase in (4, 5):
            return (x[1], MAX_WS, (phase, used, (x[0], 0)))
        return None

    def first(self, local):
        phase, used, x = local
        if phase == 0:
            return _OBJ_OPEN
        if phase in (1, 6, 7):  # (a superset: whitespace past MAX_WS and the bounds are step()'s)
            return _OBJ_AFTER[phase]
        if phase == 2:
            return _next_bytes(x, [n for i, n in self.names if not used >> i & 1])
        if phase == 3:
            return self._key.first(x)
        if phase == 4:
            return _OBJ_COLON
        key = x[0]
        return WS | (self.values[key] if key >= 0 else self.extra).first0()


class Arr(Node):
    """A JSON array of `item` with min_items..max_items (None: unbounded).
    local = (phase, count, ws run): 0 before '['; 1 after '['; 2 after an item; 3 after ','."""

    def __init__(self, item, min_items=0, max_items=None):
        self.item = item
        self.min = int(min_items or 0)
        self.max = max_items
        if self.max is not None and self.max < self.min:
            raise GrammarError("maxItems < minItems")
        self.init = (0, 0, 0)

    def ws_run(self, local):
        phase, n, w = local
        return (w, MAX_WS, (phase, n, 0)) if phase in (1, 2, 3) else None

    def _cap(self, n):
        # Counts past what the bounds can tell apart are one state (keeps states recurring).
        limit = max(self.min, self.max or 0)
        return min(n, limit + 1) if limit else min(n, 1)

    def step(self, local, b):
        phase, n, w = local
        if phase == 0:
            return [(CONT, (1, 0, 0))] if b == 0x5B else []
        if b in WS and phase in (1, 2, 3):
            return [(CONT, (phase, n, w + 1))] if w < MAX_WS else []
        if b == 0x5D and phase in (1, 2) and n >= self.min:
            return [(DONE,)]
        if phase == 2:
            if b == 0x2C and (self.max is None or n < self.max):
                return [(CONT, (3, n, 0))]
            return []
        if phase in (1, 3):
            if self.max is not None and n >= self.max:
                return []
            return [(CALL, (2, self._cap(n + 1), 0), self.item)]
        return []

    def first(self, local):
        phase = local[0]
        if phase == 0:
            return frozenset(b"[")
        if phase == 2:
            return WS | frozenset(b",]")
        return WS | frozenset(b"]") | self.item.first0()


# ---------------------------------------------------------------------------
# Raw text (XML parameter values)


class RawText(Leaf):
    """Text up to and including `closer`, never containing any of `forbidden`
    (the closer counts as one of them: its first occurrence ends the text).
    local: the longest tail of the text so far that begins one of the patterns."""

    def __init__(self, closer: bytes, forbidden=()):
        self.closer = closer
        self.patterns = (closer,) + tuple(forbidden)
        self.init = b""
        self._prefixes = {p[:i] for p in self.patterns for i in range(1, len(p))}
        self._loop = frozenset(range(256)) - {p[0] for p in self.patterns}

    def signature(self):
        return ("RawText", self.patterns)

    def loop_bytes(self, tail):
        # With no pattern begun, a byte that begins none of them leaves the tail empty.
        return self._loop if tail == b"" else None

    def first(self, tail):
        # Every byte is text except the one that would complete a forbidden pattern.
        return ALL_BYTES - {p[-1] for p in self.patterns[1:] if p[:-1] == tail}

    def step(self, tail, b):
        s = tail + bytes((b,))
        if s == self.closer:
            return [(DONE,)]
        if s in self.patterns:
            return []
        # Longest suffix of s that is a proper prefix of some pattern.
        for i in range(len(s)):
            if s[i:] in self._prefixes:
                return [(CONT, s[i:])]
        return [(CONT, b"")]


# ---------------------------------------------------------------------------
# JSON Schema -> nodes


class SchemaCompiler:
    def __init__(self, root_schema: Any):
        self.root_schema = root_schema
        self.refs: dict[str, Ref] = {}
        self._ws = Ws()

    def value(self, schema: Any, path: str = "#", depth: int = 0) -> Node:
        if schema is True or schema is None or schema == {}:
            return any_value(depth)
        if schema is False:
            raise GrammarError(f"{path}: schema false admits no value")
        if not isinstance(schema, Mapping):
            raise GrammarError(f"{path}: a schema must be an object")
        if "$ref" in schema:
            return self._ref(schema["$ref"], path)
        if "const" in schema:
            return LitSet(_spellings(schema["const"]))
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise GrammarError(f"{path}.enum: expected a non-empty array")
            return LitSet([sp for v in values for sp in _spellings(v)])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                branches = schema[key]
                if not isinstance(branches, list) or not branches:
                    raise GrammarError(f"{path}.{key}: expected a non-empty array")
                base = {k: v for k, v in schema.items() if k != key}
                return Union([self.value(_merge(base, br), f"{path}.{key}[{i}]", depth)
                              for i, br in enumerate(branches)])
        if "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for sub in schema["allOf"] or []:
                if isinstance(sub, Mapping) and "$ref" in sub:
                    sub = self._resolve(sub["$ref"], path)
                merged = _merge(merged, sub)
            return self.value(merged, path, depth)
        t = schema.get("type")
        if isinstance(t, list):
            if not t:
                raise GrammarError(f"{path}.type: empty type list")
            nodes = [self.typed(x, schema, path, depth) for x in t]
            return nodes[0] if len(nodes) == 1 else Union(nodes)
        if t is None:
            if "properties" in schema or "required" in schema or "additionalProperties" in schema:
                t = "object"
            elif "items" in schema or "prefixItems" in schema:
                t = "array"
            else:
                return any_value(depth)
        return self.typed(t, schema, path, depth)

    def typed(self, t: Any, schema: Mapping, path: str, depth: int) -> Node:
        if t == "string":
            return Str()
        if t == "integer":
            return Num(integer=True)
        if t == "number":
            return Num(integer=False)
        if t == "boolean":
            return LitSet([b"true", b"false"])
        if t == "null":
            return Lit(b"null")
        if t == "array":
            items = schema.get("items", True)
            if isinstance(items, list):  # draft-4 tuple form: take any of them
                items = {"anyOf": items} if items else True
            return Arr(self.value(items, path + ".items", depth + 1), schema.get("minItems", 0),
                       schema.get("maxItems"))
        if t == "object":
            return self.object(schema, path, depth)
        raise GrammarError(f"{path}.type: unknown type {t!r}")

    def object(self, schema: Mapping, path: str, depth: int) -> Node:
        props = schema.get("properties") or {}
        if not isinstance(props, Mapping):
            raise GrammarError(f"{path}.properties: expected an object")
        required = schema.get("required") or []
        if not isinstance(required, list):
            raise GrammarError(f"{path}.required: expected an array")
        required = [r for r in required if r in props or not props]
        extra_schema = schema.get("additionalProperties", None)
        pairs = [(str(name), self.value(sub, f"{path}.properties.{name}", depth + 1)) for name, sub in props.items()]
        extra = None
        if not props and extra_schema is not False:
            # No declared keys: any keys (the "any JSON object" case).
            extra = self.value(extra_schema if isinstance(extra_schema, Mapping) else True, path + ".*", depth + 1)
        elif isinstance(extra_schema, Mapping) and extra_schema:
            extra = self.value(extra_schema, path + ".*", depth + 1)
        if len(pairs) > 60:
            raise GrammarError(f"{path}: more than 60 properties")
        return ObjectNode(pairs, [r for r in required if r in props], extra)

    def _resolve(self, ref: Any, path: str) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise GrammarError(f"{path}.$ref: only local references (#/...) are supported")
        target: Any = self.root_schema
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, Mapping) or part not in target:
                raise GrammarError(f"{path}.$ref: {ref} does not resolve")
            target = target[part]
        return target

    def _ref(self, ref: Any, path: str) -> Node:
        if ref in self.refs:
            return self.refs[ref]
        node = Ref()
        self.refs[ref] = node
        node.target = self.value(self._resolve(ref, path), ref)
        return node


def _merge(base: Mapping, extra: Any) -> Any:
    if not isinstance(extra, Mapping):
        return extra
    out = dict(base)
    for k, v in extra.items():
        if k == "properties" and isinstance(out.get(k), Mapping):
            out[k] = {**out[k], **v}
        elif k == "required" and isinstance(out.get(k), list):
            out[k] = list(out[k]) + [r for r in v if r not in out[k]]
        else:
            out[k] = v
    return out


def _spellings(value: Any) -> list[bytes]:
    """The JSON texts admitted for a fixed value: compact-ish canonical form, UTF-8 and \\u-escaped."""
    return sorted({json.dumps(value, ensure_ascii=False).encode(), json.dumps(value).encode()})


_ANY: dict[int, Node] = {}


def any_value(depth: int = 0) -> Node:
    """Any JSON value; containers nest at most ANY_DEPTH deep."""
    depth = min(depth, ANY_DEPTH)
    if depth in _ANY:
        return _ANY[depth]
    scalars = [Str(), Num(integer=False), LitSet([b"true", b"false", b"null"])]
    if depth >= ANY_DEPTH:
        node = Union(scalars)
    else:
        ref = Ref()
        node = Union(scalars + [ObjectNode([], [], ref), Arr(ref)])
        _ANY[depth] = node
        ref.target = any_value(depth + 1)
        return node
    _ANY[depth] = node
    return node


def json_grammar(schema: Any = None) -> Grammar:
    """A JSON document: an object when schema is None (json_object mode), else one matching schema.
    Whitespace may surround it (bounded)."""
    if schema is None:
        body = ObjectNode([], [], any_value(1))
        key = "json_object"
    else:
        body = SchemaCompiler(schema).value(schema)
        key = "json_schema:" + json.dumps(schema, sort_keys=True)
    return Grammar(Seq([Ws(), body, Ws()]), key)


# ---------------------------------------------------------------------------
# Qwen XML tool calls

PARAM_CLOSE = b"</parameter>"
FUNC_CLOSE = b"</function>"


def xml_value(schema: Any, compiler: SchemaCompiler) -> Node:
    """What follows `<parameter=K>\\n`: raw text for strings (and anything that admits a
    string or says no type: the parser keeps such values raw), else typed JSON; then the closer."""
    raw = Seq([RawText(PARAM_CLOSE, (FUNC_CLOSE,)), Lit(b"\n")])
    if not isinstance(schema, Mapping):
        return raw
    if isinstance(schema.get("enum"), list) and schema["enum"] and all(isinstance(v, str) for v in schema["enum"]):
        texts = [v.encode() for v in schema["enum"] if v and PARAM_CLOSE not in v.encode()]
        if texts:
            return Seq([LitSet(texts), Ws(), Lit(PARAM_CLOSE + b"\n")])
    types = _json_types(schema)
    if types is None or "string" in types:
        return raw
    return Seq([compiler.value(schema), Ws(), Lit(PARAM_CLOSE + b"\n")])


def _json_types(schema: Any) -> set[str] | None:
    """The JSON types a property schema admits; None when it does not say. The same reading as
    the call parser's typing (chat/toolcall.py schema_types), which decides raw vs JSON values;
    the engine may not import chat/, so the rule is restated here and tested against it."""
    if not isinstance(schema, Mapping):
        return None
    found: set[str] = set()
    t = schema.get("type")
    if isinstance(t, str):
        found.add(t)
    elif isinstance(t, list):
        found.update(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            sub_types = _json_types(sub)
            if sub_types is None:
                return None
            found |= sub_types
    if not found and isinstance(schema.get("enum"), list):
        names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
        found.update("null" if v is None else names.get(type(v), "object") for v in schema["enum"])
    found &= {"string", "integer", "number", "boolean", "object", "array", "null"}
    return found or None


class XmlParams(Node):
    """The parameters of one function: `<parameter=K>\\nVALUE\\n</parameter>\\n` for declared keys,
    each once, any order, required ones before `</function>`. local = (phase, used, prefix/key):
    0 expecting `<parameter=` or `</function>`; 1 matching one of those literals (prefix);
    2 in the key name (prefix); 3 value done (key) -> back to 0."""

    def __init__(self, names, values, required):
        self.keys = [n.encode() + b">\n" for n in names]
        self.values = values
        idx = {n: i for i, n in enumerate(names)}
        self.req_mask = 0
        for r in required:
            if r in idx:
                self.req_mask |= 1 << idx[r]
        self.init = (0, 0, b"")
        self.OPEN = b"<parameter="
        self.CLOSE = FUNC_CLOSE + b"\n"

    def step(self, local, b):
        phase, used, x = local
        if phase == 0:
            x = b""
            phase = 1
        if phase == 1:
            s = x + bytes((b,))
            acts = []
            if self.OPEN.startswith(s) and any(not used >> i & 1 for i in range(len(self.keys))):
                acts.append((CONT, (2, used, b"")) if s == self.OPEN else (CONT, (1, used, s)))
            if self.CLOSE.startswith(s) and used & self.req_mask == self.req_mask:
                acts.append((DONE,) if s == self.CLOSE else (CONT, (1, used, s)))
            # (the two literals share only "<", and "<p" vs "</" split them at once)
            return _dedup(acts)
        if phase == 2:
            s = x + bytes((b,))
            acts = []
            for i, key in enumerate(self.keys):
                if used >> i & 1 or not key.startswith(s):
                    continue
                if len(key) == len(s):
                    acts.append((CONT, (3, used | 1 << i, i)))
                else:
                    acts.append((CONT, (2, used, s)))
            return _dedup(acts)
        if phase == 3:  # the value of key x reads b
            return [(CALL, (0, used, b""), self.values[x])]
        return []

    def expand(self, local):
        return self.step(local, 0) if local[0] == 3 else None

    def first(self, local):
        phase, used, x = local
        if phase in (0, 1):
            return _next_bytes(x if phase == 1 else b"", (self.OPEN, self.CLOSE))
        if phase == 2:
            return _next_bytes(x, [k for i, k in enumerate(self.keys) if not used >> i & 1])
        return self.values[x].first0()


def common_loop_classes() -> list[bytes]:
    """The loop classes of the common grammars' string states (a JSON string body; a raw XML
    parameter value), whose per-tokenizer tables VocabIndex.warm() builds ahead of a request."""
    raw = RawText(PARAM_CLOSE, (FUNC_CLOSE,))
    return [bytes(sorted(Str().loop_bytes(1))), bytes(sorted(raw.loop_bytes(b"")))]


def common_leaves() -> list[Node]:
    """Leaves every common grammar uses (JSON strings and numbers, raw XML values and their
    closer): VocabIndex.warm() builds their frame masks, all local states, at server start."""
    return [Str(), Num(integer=True), Num(integer=False), RawText(PARAM_CLOSE, (FUNC_CLOSE,)),
            Lit(PARAM_CLOSE + b"\n"), Lit(b"\n"), Lit(XmlCalls.TAIL), LitSet([b"true", b"false"]),
            LitSet([b"true", b"false", b"null"])]


def grammar_leaves(root: Node) -> list[Node]:
    """The leaf nodes with a signature reachable from root (one per signature), found through
    the nodes' attributes (every container keeps its children in attributes, lists or dicts)."""
    seen: set[int] = set()
    out: dict = {}
    todo = [root]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        sig = node.signature()
        if sig is not None:
            out.setdefault(sig, node)
        for value in vars(node).values():
            items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
            for it in items:
                if isinstance(it, tuple) and len(it) == 2 and isinstance(it[1], Node):
                    it = it[1]  # (name, node) pairs
                if isinstance(it, Node) and id(it) not in seen:
                    todo.append(it)
    return list(out.values())


_LOCALS: dict = {}


def leaf_locals(node: Node, limit: int = 256) -> list:
    """The local states a leaf reaches from init (CONT closure over all bytes), init first;
    memoized per signature (a raw-text leaf's closure steps 256 bytes from each of its tails)."""
    sig = node.signature()
    got = _LOCALS.get(sig) if sig is not None else None
    if got is None:
        got = _leaf_locals(node, limit)
        if sig is not None and len(_LOCALS) < 4096:
            _LOCALS[sig] = got
    return got


def _leaf_locals(node: Node, limit: int) -> list:
    order = [node.init]
    seen = {node.init}
    i = 0
    while i < len(order) and len(order) < limit:
        local = order[i]
        i += 1
        for b in node.first(local):
            for act in node.step(local, b):
                if act[0] == CONT and act[1] not in seen:
                    seen.add(act[1])
                    order.append(act[1])
    return order


def _dedup(acts):
    seen, out = set(), []
    for a in acts:
        k = (a[0], a[1], id(a[2])) if a[0] == CALL else a
        if k not in seen:
            seen.add(k)
            out.append(a)
    return out


class XmlCalls(Node):
    """One or more `<tool_call>\\n<function=NAME>\\n..params..</function>\\n</tool_call>`, separated
    by a newline; at most max_calls (None: unbounded). local = (phase, count, prefix):
    0 before `<tool_call>\\n<function=` (prefix matched); 1 in the name (prefix); 2 after a call
    (a newline starts the next one)."""

    HEAD = b"<tool_call>\n<function="
    TAIL = b"</tool_call>"

    def __init__(self, tools: dict[str, Node], max_calls: int | None = None):
        self.names = {n.encode() + b">\n": node for n, node in tools.items()}
        self.max_calls = max_calls
        self.init = (0, 0, b"")
        self._tail = Lit(self.TAIL)

    def step(self, local, b):
        phase, n, x = local
        s = x + bytes((b,))
        if phase == 0:
            if not self.HEAD.startswith(s):
                return []
            return [(CONT, (1, n, b"")) if s == self.HEAD else (CONT, (0, n, s))]
        if phase == 1:
            acts = []
            for name in self.names:
                if not name.startswith(s):
                    continue
                if len(name) == len(s):
                    acts.append((CONT, (4, n, name)))
                else:
                    acts.append((CONT, (1, n, s)))
            return _dedup(acts)
        if phase == 4:  # the parameters of function x read b
            return [(CALL, (3, n + 1, b""), self.names[x])]
        if phase == 3:  # params done: `</tool_call>`
            return [(CALL, (2, n, b""), self._tail)]
        if phase == 2:
            if b == 0x0A and (self.max_calls is None or n < self.max_calls):
                return [(CONT, (0, n, b""))]
            return []
        return []

    def expand(self, local):
        return self.step(local, 0) if local[0] in (3, 4) else None

    def first(self, local):
        phase, n, x = local
        if phase == 0:
            return _next_bytes(x, (self.HEAD,))
        if phase == 1:
            return _next_bytes(x, list(self.names))
        if phase == 4:
            return self.names[x].first0()
        if phase == 3:
            return self._tail.first0()
        return frozenset(b"\n")

    def can_end(self, local):
        return local[0] == 2


class CallList(Node):
    """One or more `call`s separated by a newline, at most max_calls. local = (phase, count)."""

    def __init__(self, call: Node, max_calls: int | None):
        self.call, self.max_calls = call, max_calls
        self.init = (0, 0)

    def step(self, local, b):
        phase, n = local
        if phase == 0:
            return [(CALL, (1, n + 1), self.call)]
        if b == 0x0A and (self.max_calls is None or n < self.max_calls):
            return [(CONT, (0, n))]
        return []

    def can_end(self, local):
        return local[0] == 1

    def expand(self, local):
        return self.step(local, 0) if local[0] == 0 else None

    def first(self, local):
        return self.call.first0() if local[0] == 0 else frozenset(b"\n")


def _json_dialect_call(name: str, schema: Any) -> Node:
    """`<tool_call>\n{"name": "NAME", "arguments": {..}}\n</tool_call>` (Qwen3's JSON dialect),
    whitespace allowed between the JSON tokens."""
    if not isinstance(schema, Mapping) or not schema:
        schema = {"type": "object"}
    elif "type" not in schema and "properties" not in schema:
        schema = {**schema, "type": "object"}
    args = SchemaCompiler(schema).value(schema, f"tools.{name}")
    parts = [Lit(b"<tool_call>"), Ws(), Lit(b"{"), Ws(), Lit(b'"name"'), Ws(), Lit(b":"), Ws(),
             LitSet(_spellings(name)), Ws(), Lit(b","), Ws(), Lit(b'"arguments"'), Ws(), Lit(b":"), Ws(),
             args, Ws(), Lit(b"}"), Ws(), Lit(b"</tool_call>")]
    return Seq(parts)


def tool_call_grammar(tools: Mapping[str, Any], names: list[str] | None = None,
                      max_calls: int | None = None, dialect: str = "xml") -> Grammar:
    """The Qwen call syntax for `tools` ({name: parameters schema}): "xml" (Qwen3.5/3.6/3.8,
    `<function=NAME>`) or "json" (`{"name", "arguments"}` inside `<tool_call>`); `names`
    restricts which may be called (a named tool_choice). At least one call; leading whitespace
    is allowed."""
    chosen = list(names) if names else list(tools)
    if not chosen:
        raise GrammarError("tool_choice needs at least one tool")
    for name in chosen:
        if name not in tools:
            raise GrammarError(f"tool {name!r} is not declared")
    if dialect == "json":
        calls = Union([_json_dialect_call(n, tools[n]) for n in chosen])
        key = "json_tools:" + json.dumps({"tools": {n: tools[n] for n in chosen}, "max": max_calls},
                                         sort_keys=True, default=str)
        return Grammar(Seq([Ws(), CallList(calls, max_calls)]), key,
                       specials=frozenset({"<tool_call>", "</tool_call>"}))
    if dialect != "xml":
        raise GrammarError(f"unknown tool dialect {dialect!r} (xml | json)")
    funcs = {}
    for name in chosen:
        schema = tools[name] if isinstance(tools[name], Mapping) else {}
        compiler = SchemaCompiler(schema)
        props = schema.get("properties") if isinstance(schema.get("properties"), Mapping) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        pnames = [str(k) for k in props]
        values = [xml_value(props[k], compiler) for k in props]
        funcs[name] = XmlParams(pnames, values, required)
    key = "xml_tools:" + json.dumps({"tools": {n: tools[n] for n in chosen}, "max": max_calls}, sort_keys=True,
                                   default=str)
    return Grammar(Seq([Ws(), XmlCalls(funcs, max_calls)]), key,
                   specials=frozenset({"<tool_call>", "</tool_call>"}))
