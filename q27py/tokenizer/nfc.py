"""NFC from the package's own tables (q27py/tokenizer/unicode_tables.py), not `unicodedata`.

The reference tokenizer normalizes with its own Unicode data, which differs from every
Python's `unicodedata` somewhere (and Python's changes with the version), so encoding would
change with the interpreter. This is the UAX #15 algorithm over the committed tables:
full canonical decomposition, canonical ordering by combining class, canonical composition
(primary composites only, Hangul computed).

Speed: text without any character that NFC could touch is returned as is. A character is
untouchable ("inert") when its class is 0, NFC leaves it alone, and it is never the second
half of a composition; before such a character there is always a normalization boundary, so
only the runs of non-inert characters (with the one inert character before each, which they
may compose with) are normalized, each on its own.
"""

from __future__ import annotations

import functools
import re

S_BASE, L_BASE, V_BASE, T_BASE = 0xAC00, 0x1100, 0x1161, 0x11A7
L_COUNT, V_COUNT, T_COUNT = 19, 21, 28
N_COUNT = V_COUNT * T_COUNT
S_COUNT = L_COUNT * N_COUNT


def _escape(cp: int) -> str:
    return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"


class Nfc:
    """A normalizer over one set of tables (the module's, or a candidate's in the generator)."""

    def __init__(self, tables):
        self.ccc: dict[str, int] = {}
        for item in tables.CCC.split():
            span, value = item.split(":")
            lo, _, hi = span.partition("-")
            for cp in range(int(lo, 16), int(hi or lo, 16) + 1):
                self.ccc[chr(cp)] = int(value)
        self.decomp: dict[str, str] = {}
        for item in tables.DECOMPOSITION.split():
            cp, parts = item.split(":")
            self.decomp[chr(int(cp, 16))] = "".join(chr(int(p, 16)) for p in parts.split("."))
        self.compose: dict[str, str] = {}
        for item in tables.COMPOSITION.split():
            pair, composite = item.split(":")
            a, b = pair.split(".")
            self.compose[chr(int(a, 16)) + chr(int(b, 16))] = chr(int(composite, 16))
        seconds = {pair[1] for pair in self.compose}
        touchy = set(self.ccc) | seconds
        touchy |= {chr(cp) for cp in range(V_BASE, V_BASE + V_COUNT)} | {chr(cp) for cp in range(T_BASE + 1, T_BASE + T_COUNT)}
        # decomposable characters that NFC does not give back unchanged (singletons, exclusions)
        touchy |= {c for c in self.decomp if self._segment(c) != c}
        cps = sorted(ord(c) for c in touchy)
        ranges: list[list[int]] = []
        for cp in cps:
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1][1] = cp
            else:
                ranges.append([cp, cp])
        body = "".join(_escape(lo) if lo == hi else f"{_escape(lo)}-{_escape(hi)}" for lo, hi in ranges)
        self._memo: dict[str, str] = {}
        self._touchy = re.compile(f"[{body}]")
        self._runs = re.compile(f"[^{body}]?[{body}]+")

    def __call__(self, text: str) -> str:
        if text.isascii() or self._touchy.search(text) is None:
            return text
        return self._runs.sub(self._run, text)

    def _run(self, m: re.Match) -> str:
        # natural text repeats the same few runs (a letter + its marks): memoize them
        run = m.group()
        out = self._memo.get(run)
        if out is None:
            out = self._segment(run)
            if len(self._memo) < 65536:
                self._memo[run] = out
        return out

    def _decompose(self, text: str) -> list[str]:
        out: list[str] = []
        for c in text:
            cp = ord(c)
            if S_BASE <= cp < S_BASE + S_COUNT:
                s = cp - S_BASE
                out.append(chr(L_BASE + s // N_COUNT))
                out.append(chr(V_BASE + (s % N_COUNT) // T_COUNT))
                if s % T_COUNT:
                    out.append(chr(T_BASE + s % T_COUNT))
            else:
                out.extend(self.decomp.get(c, c))
        return out

    def _segment(self, text: str) -> str:
        chars = self._decompose(text)
        ccc = self.ccc
        # canonical ordering: a stable sort of each run of non-starters by class
        i, n = 0, len(chars)
        while i < n:
            if ccc.get(chars[i], 0) == 0:
                i += 1
                continue
            j = i
            while j < n and ccc.get(chars[j], 0) != 0:
                j += 1
            if j - i > 1:
                chars[i:j] = sorted(chars[i:j], key=lambda c: ccc.get(c, 0))
            i = j
        # canonical composition
        out: list[str] = []
        starter = -1  # index in out of the last starter
        last_ccc = -1
        for c in chars:
            k = ccc.get(c, 0)
            if starter >= 0 and (last_ccc < k or (last_ccc == 0 and starter == len(out) - 1)):
                composite = self._pair(out[starter], c)
                if composite is not None:
                    out[starter] = composite
                    continue
            if k == 0:
                starter = len(out)
            last_ccc = k
            out.append(c)
        return "".join(out)

    def _pair(self, a: str, b: str) -> str | None:
        la, lb = ord(a), ord(b)
        if L_BASE <= la < L_BASE + L_COUNT and V_BASE <= lb < V_BASE + V_COUNT:
            return chr(S_BASE + ((la - L_BASE) * V_COUNT + (lb - V_BASE)) * T_COUNT)
        if S_BASE <= la < S_BASE + S_COUNT and (la - S_BASE) % T_COUNT == 0 and T_BASE < lb < T_BASE + T_COUNT:
            return chr(la + lb - T_BASE)
        return self.compose.get(a + b)


@functools.lru_cache(maxsize=1)
def default() -> Nfc:
    """The normalizer over the committed tables (built once: ~0.05 s)."""
    from q27py.tokenizer import unicode_tables

    return Nfc(unicode_tables)


def nfc(text: str) -> str:
    return default()(text)
