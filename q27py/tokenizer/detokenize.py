"""Incremental detokenization for streaming.

A byte-level token can end in the middle of a UTF-8 character (an emoji is often split over
two or three tokens). The decoder keeps those trailing bytes until the character completes,
so every piece it returns is whole text, and the concatenation of all pieces equals a
one-shot decode of the same ids (invalid bytes become U+FFFD exactly as bytes.decode would).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable


class IncrementalDecoder:
    def __init__(self, token_bytes: Callable[[int], bytes]):
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Iterable[int] | int) -> str:
        """Decode more ids; returns only complete characters (possibly "")."""
        if isinstance(ids, int):
            ids = (ids,)
        data = b"".join(self._token_bytes(i) for i in ids)
        return self._utf8.decode(data, final=False)

    def flush(self) -> str:
        """End of stream: bytes still pending (an unfinished character) become U+FFFD."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    @property
    def pending_bytes(self) -> int:
        """How many bytes are held back waiting for the rest of a character."""
        return len(self._utf8.getstate()[0])
