"""GPT-2's byte <-> unicode alphabet used by byte-level BPE vocabularies.

Every byte gets a printable stand-in character so that vocabulary entries are plain
strings: printable Latin-1 bytes map to themselves, the other 68 bytes (controls, space,
0x7F-0xA0, 0xAD) map to U+0100 onwards in byte order (so space becomes 'Ġ', '\\n' 'Ċ').
"""

from __future__ import annotations

import re

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _bytes_to_unicode() -> dict[int, str]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


BYTE_TO_CHAR: dict[int, str] = _bytes_to_unicode()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}

# bytes.translate cannot map to multi-byte output, so encoding goes through latin-1:
# every byte b becomes chr(b), then str.translate swaps in its stand-in character.
_LATIN1_TO_ALPHABET = {b: c for b, c in BYTE_TO_CHAR.items()}


def to_alphabet(text: str) -> str:
    """The byte-level form of text: one alphabet character per UTF-8 byte.

    A lone surrogate (possible in a Python str, e.g. from JSON "\\ud800") has no UTF-8
    form; it is encoded as U+FFFD, the character a UTF-8 decoder would have produced.
    """
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        data = _LONE_SURROGATE.sub("\ufffd", text).encode("utf-8")
    return data.decode("latin-1").translate(_LATIN1_TO_ALPHABET)


def from_alphabet(token: str) -> bytes:
    """The bytes a byte-level token stands for; KeyError if it holds a non-alphabet character."""
    return bytes([CHAR_TO_BYTE[c] for c in token])
