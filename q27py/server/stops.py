"""Client stop sequences over streamed text, holding back only what could still start a match."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str] | tuple[str, ...]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Text safe to emit now. After a match, returns the text before it and sets `matched`."""
        if not self.stops or self.matched is not None:
            return "" if self.matched is not None else text
        buf = self._held + text
        first, which = -1, None
        for stop in self.stops:
            pos = buf.find(stop)
            if pos != -1 and (first == -1 or pos < first):
                first, which = pos, stop
        if which is not None:
            self.matched = which
            self._held = ""
            return buf[:first]
        keep = self._partial_tail(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        out, self._held = self._held, ""
        return "" if self.matched is not None else out

    def _partial_tail(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best
