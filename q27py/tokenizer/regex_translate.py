"""Translate a tokenizer.json split regex (Oniguruma syntax) into an equivalent Python `re` pattern.

Python's `re` is, like Oniguruma, a backtracking engine with leftmost-first alternation and
the same lookaround / quantifier / scoped-flag syntax, so the translation only has to replace
the escapes whose meaning differs: \\p{X} / \\P{X} (absent from `re`) and \\s / \\S (`re`
follows str.isspace(), not Unicode White_Space). Escapes whose Unicode meaning is engine
dependent (\\d \\w \\b ...) are refused rather than guessed.
"""

from __future__ import annotations

import functools
import re

from q27py.errors import TokenizerError
from q27py.tokenizer.unicode_classes import WHITE_SPACE_RANGES, category_ranges, class_body

# Escapes that mean the same in Oniguruma and Python `re`.
_SAME_ESCAPES = set("rntfv0\\.^$|?*+()[]{}-/'\" #&~:!=<>,@%`;")


def _property_body(name: str, pattern: str) -> str:
    try:
        return class_body(category_ranges(name))
    except ValueError:
        raise TokenizerError(f"unsupported Unicode property \\p{{{name}}} in pre-tokenizer regex {pattern!r}")


def _read_property(pattern: str, i: int) -> tuple[str, int]:
    """Parse the `{Name}` (or single letter) after \\p at index i; return (name, next index)."""
    if i < len(pattern) and pattern[i] == "{":
        end = pattern.find("}", i)
        if end < 0:
            raise TokenizerError(f"unterminated \\p{{ in pre-tokenizer regex {pattern!r}")
        return pattern[i + 1 : end], end + 1
    if i < len(pattern):
        return pattern[i], i + 1
    raise TokenizerError(f"dangling \\p in pre-tokenizer regex {pattern!r}")


def translate(pattern: str) -> str:
    """Rewrite an Oniguruma tokenizer regex as Python `re` source with identical matches."""
    white = class_body(WHITE_SPACE_RANGES)
    out: list[str] = []
    in_class = False
    class_start = 0  # len(out) when the open class began: a `]` right there is a literal
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            if i + 1 >= len(pattern):
                raise TokenizerError(f"trailing backslash in pre-tokenizer regex {pattern!r}")
            esc = pattern[i + 1]
            i += 2
            if esc in "pP":
                name, i = _read_property(pattern, i)
                body = _property_body(name, pattern)
                if in_class and esc == "P":
                    raise TokenizerError(f"\\P{{..}} inside a character class is not supported: {pattern!r}")
                out.append(body if in_class else ("[" if esc == "p" else "[^") + body + "]")
            elif esc == "s":
                out.append(white if in_class else f"[{white}]")
            elif esc == "S":
                if in_class:
                    raise TokenizerError(f"\\S inside a character class is not supported: {pattern!r}")
                out.append(f"[^{white}]")
            elif esc in _SAME_ESCAPES:
                out.append("\\" + esc)
            else:
                raise TokenizerError(f"unsupported escape \\{esc} in pre-tokenizer regex {pattern!r}")
            continue
        if in_class:
            if ch == "]" and len(out) > class_start:
                in_class = False
            elif ch == "[":
                raise TokenizerError(f"nested character classes are not supported: {pattern!r}")
        elif ch == "[":
            in_class = True
            out.append("[^" if pattern.startswith("[^", i) else "[")
            i += 2 if pattern.startswith("[^", i) else 1
            class_start = len(out)
            continue
        out.append(ch)
        i += 1
    if in_class:
        raise TokenizerError(f"unterminated character class in pre-tokenizer regex {pattern!r}")
    return "".join(out)


@functools.lru_cache(maxsize=8)
def compile_split_regex(pattern: str) -> re.Pattern[str]:
    """Compile a tokenizer.json split regex for Python (cached: building classes costs ~0.1 s)."""
    source = translate(pattern)
    try:
        return re.compile(source)
    except re.error as exc:
        raise TokenizerError(f"pre-tokenizer regex {pattern!r} does not compile in Python: {exc}") from None
