"""Unicode character classes (\\p{..} and \\s) as Python `re` character-class text.

Python's `re` has no \\p{L}; and its \\s follows str.isspace(), which also matches
U+001C..U+001F. The tokenizer regexes were written for Oniguruma / Rust `regex`, where
\\p{X} is a Unicode general category and \\s is the Unicode White_Space property.
So both are spelled out here as explicit code-point ranges.

Categories come from this Python's `unicodedata` (its Unicode version is
`unicodedata.unidata_version`); code points assigned in a newer Unicode are
unassigned (Cn) here.
"""

from __future__ import annotations

import functools
import sys
import unicodedata

# The Unicode White_Space property (PropList.txt; unchanged since Unicode 6.3).
WHITE_SPACE_RANGES: tuple[tuple[int, int], ...] = (
    (0x0009, 0x000D),
    (0x0020, 0x0020),
    (0x0085, 0x0085),
    (0x00A0, 0x00A0),
    (0x1680, 0x1680),
    (0x2000, 0x200A),
    (0x2028, 0x2029),
    (0x202F, 0x202F),
    (0x205F, 0x205F),
    (0x3000, 0x3000),
)

GENERAL_CATEGORIES = frozenset(
    "Lu Ll Lt Lm Lo Mn Mc Me Nd Nl No Pc Pd Ps Pe Pi Pf Po Sm Sc Sk So "
    "Zs Zl Zp Cc Cf Cs Co Cn".split()
)
MAJOR_CATEGORIES = frozenset(c[0] for c in GENERAL_CATEGORIES)


@functools.lru_cache(maxsize=1)
def _ranges_by_category() -> dict[str, tuple[tuple[int, int], ...]]:
    """Every code point grouped into runs of equal general category (one pass, cached)."""
    category = unicodedata.category
    runs: dict[str, list[tuple[int, int]]] = {}
    start, current = 0, category("\x00")
    for cp in range(1, sys.maxunicode + 1):
        cat = category(chr(cp))
        if cat != current:
            runs.setdefault(current, []).append((start, cp - 1))
            start, current = cp, cat
    runs.setdefault(current, []).append((start, sys.maxunicode))
    return {cat: tuple(r) for cat, r in runs.items()}


def category_ranges(name: str) -> tuple[tuple[int, int], ...]:
    """Code-point ranges of a general category: major ("L") or minor ("Lu"), sorted, merged."""
    by_cat = _ranges_by_category()
    if name in GENERAL_CATEGORIES:
        return by_cat.get(name, ())
    if name in MAJOR_CATEGORIES:
        parts = [r for cat, rs in by_cat.items() if cat[0] == name for r in rs]
        return _merge(parts)
    raise ValueError(f"unknown Unicode general category {name!r}")


def _merge(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def _escape(cp: int) -> str:
    # \uXXXX / \UXXXXXXXX never collide with class syntax ( ] - ^ \ & ~ | ).
    return f"\\u{cp:04x}" if cp <= 0xFFFF else f"\\U{cp:08x}"


def class_body(ranges: tuple[tuple[int, int], ...]) -> str:
    """The inside of a `re` character class (no brackets) matching exactly these ranges."""
    return "".join(_escape(lo) if lo == hi else f"{_escape(lo)}-{_escape(hi)}" for lo, hi in ranges)
