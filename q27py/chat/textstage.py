"""The text stage: token ids -> API-neutral events, the one place text is made.

The engine speaks token ids only (engine/api.py). Whoever shows its output (the
server's turns, `q27py generate`) runs the ids through one TextStage:

  ids -> incremental detokenizer (whole UTF-8 characters only)
      -> splitter (text / reasoning / tool calls: chat/stream.py; RawSplitter for raw text)
      -> stop strings on visible text (held back only while they could still match)

and gets TextDelta / ReasoningDelta / ToolCall* events. The stage also counts what
the model produced (completion tokens, of those reasoning tokens, EOS included) and
knows whether generation is still inside a think block: the splitter decides that,
nothing re-parses the text for `</think>`.
"""

from __future__ import annotations

from q27py.chat import stream as chat_stream

FORCED_THINK_CLOSE = "\n</think>\n\n"


class StopMatcher:
    """Client stop sequences over streamed text, holding back only what could still start a match."""

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


class RawSplitter:
    """Raw text (/v1/completions, `q27py generate`): every byte is text; no markup is interpreted."""

    in_reasoning = False

    def __init__(self, in_reasoning: bool = False):
        pass

    def feed(self, text: str) -> list:
        return [chat_stream.TextDelta(text)] if text else []

    def finish(self) -> list:
        return []


class TextStage:
    """One generation's ids -> events (see the module docstring).

    feed() consumes ids until the end, a stop string, the end of a tool call when
    `stop_after_tool_call`, or (with `reasoning_budget`) the budget spent inside the
    think block; `stopped` / `budget_hit` say which. EOS ids are counted, never shown.
    """

    def __init__(self, tokenizer, splitter=None, *, stop_ids=frozenset(), stops=(),
                 stop_after_tool_call: bool = False, reasoning_budget: int | None = None):
        self.tokenizer = tokenizer
        self.splitter = splitter if splitter is not None else RawSplitter()
        self.stop_ids = frozenset(stop_ids)
        self.stops = StopMatcher(list(stops))
        self.stop_after_tool_call = stop_after_tool_call
        self.reasoning_budget = reasoning_budget
        self.decoder = tokenizer.new_decoder()
        self.generated: list[int] = []  # ids shown to the model again on a continuation (no EOS)
        self.completion_tokens = 0
        self.reasoning_tokens = 0
        self.tool_calls_done = 0
        self.stopped = False  # a stop string matched, or a tool call ended the turn
        self.budget_hit = False

    @property
    def in_reasoning(self) -> bool:
        return bool(getattr(self.splitter, "in_reasoning", False))

    @property
    def matched_stop(self) -> str | None:
        return self.stops.matched

    def feed(self, token_ids) -> list:
        out: list = []
        for token in token_ids:
            if self.stopped or self.budget_hit:
                break
            if token in self.stop_ids:  # end of turn: counted (the model produced it), never shown
                self.completion_tokens += 1
                continue
            if (self.reasoning_budget is not None and self.in_reasoning
                    and self.reasoning_tokens >= self.reasoning_budget):
                self.budget_hit = True
                break
            thinking = self.in_reasoning
            self.generated.append(token)
            self.completion_tokens += 1
            if thinking:
                self.reasoning_tokens += 1
            out += self._route(self.splitter.feed(self.decoder.feed([token])))
        return out

    def close_think(self) -> list:
        """Close the think block ourselves (the reasoning budget is spent): the close is
        appended to what the model saw and counted as produced. A continuation then
        starts from prompt + self.generated, with a fresh detokenizer."""
        close_ids = self.tokenizer.encode(FORCED_THINK_CLOSE)
        text = self.decoder.flush() + FORCED_THINK_CLOSE
        self.generated.extend(close_ids)
        self.completion_tokens += len(close_ids)
        self.budget_hit = False
        self.reasoning_budget = None
        self.decoder = self.tokenizer.new_decoder()
        return self._route(self.splitter.feed(text))

    def finish(self) -> list:
        """The end of the generation: pending bytes, the splitter's tail, held stop text."""
        if self.stopped:
            return []
        out = self._route(self.splitter.feed(self.decoder.flush()) + self.splitter.finish())
        if not self.stopped and self.stops.stops:
            held = self.stops.flush()
            if held:
                out.append(chat_stream.TextDelta(held))
        return out

    def _route(self, events: list) -> list:
        """Apply stop sequences to visible text; end the turn after a call if asked to."""
        out = []
        stops = self.stops
        for ev in events:
            if self.stopped:
                break
            if isinstance(ev, chat_stream.TextDelta):
                if stops.stops:
                    text = stops.feed(ev.text)
                    if text:
                        out.append(chat_stream.TextDelta(text))
                    if stops.matched is not None:
                        self.stopped = True
                    continue
            elif stops.stops:
                held = stops.flush()  # text held as a possible stop prefix precedes this event
                if held:
                    out.append(chat_stream.TextDelta(held))
            out.append(ev)
            if isinstance(ev, chat_stream.ToolCallEnd):
                self.tool_calls_done += 1
                if self.stop_after_tool_call:
                    self.stopped = True
        return out


def text_of(events) -> str:
    """The visible text of a list of events."""
    return "".join(ev.text for ev in events if isinstance(ev, chat_stream.TextDelta))
