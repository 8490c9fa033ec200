"""Streaming splitter for Qwen3.x output: visible text, reasoning and tool calls.

Feed the detokenized output in chunks of any size; each ``feed`` returns the events
that are certain so far, ``finish`` the rest::

    splitter = StreamSplitter(tools, in_reasoning=True)   # tools: {name: parameters schema}
    for chunk in chunks:
        handle(splitter.feed(chunk))
    handle(splitter.finish())

Events: ``TextDelta``, ``ReasoningDelta``, ``ToolCallStart(index, id, name)``,
``ToolCallArgsDelta(index, json_fragment)``, ``ToolCallEnd(index, arguments_json)``. A
call's fragments concatenate to exactly its ``arguments_json``, which is valid JSON.
The events do not depend on how the output was chunked (up to how deltas are split).

What counts as structure (and why):

* Reasoning. ``in_reasoning`` says whether the prompt already opened the think block
  (the generation prompt ends with ``<think>\\n``) or closed it (``<think>\\n\\n</think>
  \\n\\n``); derive it from the rendered prompt, not from a request flag. ``</think>``
  ends reasoning wherever it appears. ``<think>`` opens reasoning only at the very start
  of the visible text (a model that re-opens the block); anywhere else it is text.
* Tool-call markers count only at the start of a line (after optional spaces/tabs),
  outside Markdown code fences (``` or ~~~). Prose that mentions ``<tool_call>``
  mid-sentence, a JSON string holding one (JSON strings cannot contain a raw newline)
  and examples inside code fences therefore stay text. One exception, because losing a
  call ends an agent's session: ``<tool_call>`` directly followed by a newline and
  ``<function`` is a call even mid-line, unless it is inside inline code.
* A line-start ``<tool_call>`` is only a call when what follows looks like a call body
  (``<...``, ``{`` or ``NAME"``), else it is text; so is one directly followed by
  another ``<tool_call>``. An empty wrapper, or one that ends the output (a call cut
  by the token limit), is dropped as markup rather than shown as the answer. Calls
  inside reasoning are calls; after them reasoning continues.
* The canonical XML form streams: ``ToolCallStart`` when ``<function=NAME>`` is read,
  then the arguments object piece by piece. A string-typed parameter (per the tool's
  schema) streams as JSON-string fragments as its characters arrive; other values are
  emitted when complete, converted to their schema type (see ``toolcall``, which also
  says where a value ends when it contains ``</parameter>``). Several ``<function>``
  blocks in one ``<tool_call>`` are several calls. If the output ends inside a call,
  the call is closed with what arrived (its JSON stays valid).
* Every other form (JSON bodies, the drift modes of q27-design.md 7.7) is buffered to
  the end of its region and parsed by ``drift.parse_region``, which emits whole calls
  (start, the whole arguments, end) or refuses; a refused region is text, byte for
  byte. A wrapped region ends at the first ``</tool_call>`` where its body parses
  without truncation repairs, so a closer inside a JSON string does not cut it. Bare drift forms without a
  ``<tool_call>`` wrapper are only looked for when tools are registered, and bare JSON
  (``{"name": ...``) only in visible text, not in reasoning.
* Whitespace: a text (or reasoning) stream never starts with whitespace and whitespace
  right before a boundary (a call, ``</think>``, the end) is dropped; so is whitespace
  only text between calls. Whitespace that separates two pieces of the same stream
  across a call is kept once (what follows the call).

Byte accounting (``record_spans=True``): every input character is attributed, in
order, to exactly one span of kind ``text``, ``reasoning`` (emitted verbatim), ``space``
(dropped whitespace), ``marker`` (``<think>``, ``</think>``, an empty or truncated
``<tool_call>`` wrapper) or ``call`` (the raw text of calls, markup included). The
property tests check that the spans rebuild the input and that the deltas are exactly
the text and reasoning spans.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Union

from q27py.chat.drift import CALL_KEYS, parse_region
from q27py.chat.toolcall import (
    Match,
    ToolSet,
    convert_value,
    dumps,
    encode_string_fragment,
    is_string_only,
    log_recovery,
    log_refusal,
    match_any,
    match_literal,
    match_value_end,
    parse_opener,
)

TEXT = "text"
REASONING = "reasoning"


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    index: int
    json_fragment: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    arguments_json: str


Event = Union[TextDelta, ReasoningDelta, ToolCallStart, ToolCallArgsDelta, ToolCallEnd]


def random_call_id(index: int) -> str:
    return "call_" + secrets.token_hex(12)


_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_CALL_OPEN = "<tool_call>"
_CALL_CLOSE = "</tool_call>"
_INLINE_CALL = "<tool_call>\n<function"
_FENCES = ("```", "~~~")
_XML_OPENERS = {"<tool_call>": "tool_call", "<function": "function", "<tool_name>": "tool_name",
                "<name>": "name", "<parameter": "parameter"}
_PROSE_STOPS = re.compile(r"[\n<`]")
_VALUE_STOPS = re.compile(r"[\n<]")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_SPACE = " \t\r\n"
_MAX_TAG_WAIT = 300  # a bare <tool_name>NAME</tool_name> tag longer than this is prose


def _skip_space(buf: str, i: int) -> int:
    n = len(buf)
    while i < n and buf[i] in _SPACE:
        i += 1
    return i


@dataclass
class _OpenCall:
    index: int
    name: str
    fragments: list[str] = field(default_factory=list)
    params: int = 0
    prop: Mapping | None = None  # schema of the parameter being read
    streaming: bool = False  # the current value streams as a JSON string
    raw: list[str] = field(default_factory=list)  # the current value, when not streaming


@dataclass
class _Region:
    form: str  # "wrapped" | "bare_xml" | "function_json" | "bare_json"
    body_start: int  # where the body begins in the buffer (after `<tool_call>` when wrapped)
    scan: int  # where to resume looking for the region's end
    depth: int = 0  # bare_json: brace depth, string state
    in_string: bool = False
    escaped: bool = False
    closers: list[int] = field(default_factory=list)  # wrapped: `</tool_call>` positions tried


class StreamSplitter:
    """Incremental router for one generation's output (see the module docstring)."""

    def __init__(
        self,
        tools: Mapping[str, Mapping] | None = None,
        *,
        in_reasoning: bool = False,
        make_id: Callable[[int], str] = random_call_id,
        record_spans: bool = False,
    ):
        self._tools = ToolSet(tools)
        self._make_id = make_id
        self._buf = ""
        self._events: list[Event] = []
        self._kind = REASONING if in_reasoning else TEXT
        self._mode = "prose"
        self._line_start = True
        self._fence: str | None = None  # the fence that opened the code block we are in
        self._inline_code = False
        self._think_allowed = not in_reasoning
        self._emitted = {TEXT: False, REASONING: False}
        self._pending_space = ""
        self._opener = ""
        self._region: _Region | None = None
        self._call: _OpenCall | None = None
        self._wrapped = False
        self._value_leading = False
        self._next_index = 0
        self._finished = False
        self.spans: list[tuple[str, str]] | None = [] if record_spans else None
        self._steps = {
            "prose": self._step_prose,
            "opener": self._step_opener,
            "region": self._step_region,
            "body": self._step_body,
            "value": self._step_value,
            "after_function": self._step_after_function,
        }

    # --- public ----------------------------------------------------------------------

    @property
    def in_reasoning(self) -> bool:
        """Still inside the think block (the text stage's reasoning budget reads this)."""
        return self._kind == REASONING

    def feed(self, text: str) -> list[Event]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if text:
            self._buf += text
            self._run(eof=False)
        return self._take()

    def finish(self) -> list[Event]:
        if not self._finished:
            self._finished = True
            self._run(eof=True)
            self._boundary()
        return self._take()

    # --- plumbing --------------------------------------------------------------------

    def _run(self, eof: bool) -> None:
        while self._steps[self._mode](eof):
            pass

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _span(self, kind: str, raw: str) -> None:
        if self.spans is None or not raw:
            return
        if self.spans and self.spans[-1][0] == kind:
            self.spans[-1] = (kind, self.spans[-1][1] + raw)
        else:
            self.spans.append((kind, raw))

    def _consume(self, kind: str, count: int) -> None:
        self._span(kind, self._buf[:count])
        self._buf = self._buf[count:]

    def _emit_prose(self, s: str) -> None:
        """Text or reasoning, trimmed at the edges of its stream (module docstring)."""
        if not s:
            return
        kind = self._kind
        if not self._emitted[kind]:
            body = s.lstrip()
            self._span("space", s[: len(s) - len(body)])
            s = body
        body = s.rstrip()
        if body:
            out = self._pending_space + body
            self._pending_space = ""
            self._span(kind, out)
            self._events.append(TextDelta(out) if kind == TEXT else ReasoningDelta(out))
            self._emitted[kind] = True
            if kind == TEXT:
                self._think_allowed = False
        self._pending_space += s[len(body) :]

    def _boundary(self) -> None:
        """A call, a think marker or the end: whitespace before it is dropped."""
        self._span("space", self._pending_space)
        self._pending_space = ""
        self._fence = None
        self._inline_code = False

    def _to_prose(self) -> None:
        self._mode = "prose"
        self._region = None
        self._line_start = True
        self._inline_code = False

    def _reject(self) -> bool:
        """The candidate at the buffer's start is prose: emit its first character and
        scan on (mid-line now, so the same opener cannot match again)."""
        self._mode = "prose"
        self._region = None
        self._line_start = False
        first, self._buf = self._buf[0], self._buf[1:]
        self._emit_prose(first)
        return True

    # --- prose -----------------------------------------------------------------------

    def _line_start_opener(self, buf: str, i: int, eof: bool, think_ok: bool) -> tuple[Match, str | None]:
        if self._fence is not None:
            return Match.NO, None
        openers = {}
        if self._kind == TEXT and think_ok:
            openers[_THINK_OPEN] = "think"
        if self._tools:
            openers.update(_XML_OPENERS)
            if self._kind == TEXT:
                openers["{"] = "json"
        else:
            openers[_CALL_OPEN] = "tool_call"
        m, literal = match_any(buf, i, openers, eof)
        return m, (openers[literal] if literal else None)

    def _step_prose(self, eof: bool) -> bool:
        buf = self._buf
        n = len(buf)
        i = 0
        content_seen = False  # in this step; earlier steps' content cleared _think_allowed
        while i < n:
            if self._line_start:
                if buf[i] in " \t":
                    i += 1
                    continue
                m, opener = self._line_start_opener(buf, i, eof, self._think_allowed and not content_seen)
                if m is Match.MORE:
                    break
                if m is Match.YES:
                    return self._start_opener(i, opener)
                m, fence = match_any(buf, i, _FENCES, eof)
                if m is Match.MORE:
                    break
                self._line_start = False
                content_seen = True
                if m is Match.YES:
                    if self._fence is None:
                        self._fence = fence
                    elif self._fence == fence:
                        self._fence = None
                    i += len(fence)
                    continue
            c = buf[i]
            if c == "\n":
                self._line_start = True
                self._inline_code = False
                i += 1
                continue
            if c == "`":
                if self._fence is None:
                    self._inline_code = not self._inline_code
                i += 1
                continue
            if c == "<":
                if self._kind == REASONING:
                    m = match_literal(buf, i, _THINK_CLOSE, eof)
                    if m is Match.MORE:
                        break
                    if m is Match.YES:
                        self._emit_prose(buf[:i])
                        self._buf = buf[i:]
                        self._close_think()
                        return True
                if self._fence is None and not self._inline_code:
                    m = match_literal(buf, i, _INLINE_CALL, eof)
                    if m is Match.MORE:
                        break
                    if m is Match.YES:
                        return self._start_opener(i, "tool_call")
                i += 1
                continue
            stop = _PROSE_STOPS.search(buf, i + 1)
            i = stop.start() if stop else n
        self._emit_prose(buf[:i])
        self._buf = buf[i:]
        return False

    def _start_opener(self, i: int, opener: str) -> bool:
        self._emit_prose(self._buf[:i])
        self._buf = self._buf[i:]
        self._mode = "opener"
        self._opener = opener
        return True

    def _close_think(self) -> None:
        self._boundary()
        self._consume("marker", len(_THINK_CLOSE))
        self._kind = TEXT
        self._think_allowed = False
        self._to_prose()

    # --- openers: decide whether a line-start marker begins a call -------------------

    def _step_opener(self, eof: bool) -> bool:
        return getattr(self, "_open_" + self._opener)(eof)

    def _open_think(self, eof: bool) -> bool:
        self._boundary()
        self._consume("marker", len(_THINK_OPEN))
        self._kind = REASONING
        self._think_allowed = False
        self._to_prose()
        return True

    def _open_tool_call(self, eof: bool) -> bool:
        buf = self._buf
        n = len(buf)
        k = _skip_space(buf, len(_CALL_OPEN))
        if k == n:
            if not eof:
                return False
            log_recovery("empty_call", "output ended right after <tool_call>")
            return self._markup_only(n)
        m = match_literal(buf, k, _CALL_CLOSE, eof)
        if m is Match.MORE:
            return False
        if m is Match.YES:
            log_recovery("empty_call")
            return self._markup_only(k + len(_CALL_CLOSE))
        m, literal = match_any(buf, k, (_CALL_OPEN, "<function"), eof)
        if m is Match.MORE:
            return False
        if literal == _CALL_OPEN:
            return self._reject()  # an opener straight after an opener: the first one is text
        if m is Match.YES:
            m, op = parse_opener(buf, k, "function", eof)
            if m is Match.MORE:
                return False
            if m is Match.YES and op.name:
                self._begin_call(op.end, op.name, canonical=op.canonical, wrapped=True)
                return True
            return self._begin_region("wrapped", len(_CALL_OPEN))
        if buf[k] in "<{":
            return self._begin_region("wrapped", len(_CALL_OPEN))
        ident = _IDENT.match(buf, k)
        if ident and ident.end() == n and not eof:
            return False
        if ident and buf.startswith('"', ident.end()) and self._tools.resolve(ident.group(), quiet=True):
            return self._begin_region("wrapped", len(_CALL_OPEN))  # drift mode 10
        return self._reject()

    def _markup_only(self, count: int) -> bool:
        self._boundary()
        self._consume("marker", count)
        self._to_prose()
        return True

    def _open_function(self, eof: bool) -> bool:
        buf = self._buf
        m, op = parse_opener(buf, 0, "function", eof)
        if m is Match.MORE:
            return False
        if m is Match.NO:
            return self._reject()
        if op.name:
            if self._tools.resolve(op.name, quiet=True) is None:
                log_refusal(f"bare <function> names no registered tool: {op.name!r}")
                return self._reject()
            # without a wrapper, commit only once a parameter or the closer follows
            m, _ = match_any(buf, _skip_space(buf, op.end), ("<parameter", "</function>"), eof)
            if m is Match.MORE:
                return False
            if m is Match.NO:
                return self._reject()
            log_recovery("bare_function", op.name)
            self._begin_call(op.end, op.name, canonical=op.canonical, wrapped=False)
            return True
        k = _skip_space(buf, op.end)
        if k == len(buf) and not eof:
            return False
        if buf.startswith("{", k):
            return self._begin_region("function_json", 0)  # drift mode 16
        return self._reject()

    def _open_tool_name(self, eof: bool) -> bool:
        close = self._buf.find("</tool_name>")
        if close < 0:
            if eof or len(self._buf) > _MAX_TAG_WAIT:
                return self._reject()
            return False
        name = self._buf[len("<tool_name>") : close].strip()
        if name and not self._tools.resolve(name, quiet=True):
            return self._reject()
        return self._begin_region("bare_xml", 0)

    def _open_name(self, eof: bool) -> bool:
        ident = _IDENT.match(self._buf, len("<name>"))
        if (ident is None and len(self._buf) == len("<name>")) or (ident and ident.end() == len(self._buf)):
            if not eof:
                return False
        if ident and self._tools.resolve(ident.group(), quiet=True):
            return self._begin_region("bare_xml", 0)
        return self._reject()

    def _open_parameter(self, eof: bool) -> bool:
        m, op = parse_opener(self._buf, 0, "parameter", eof)
        if m is Match.MORE:
            return False
        if m is Match.YES and op.name:
            key = op.name.strip()
            if self._tools.is_param_key(key) or self._tools.resolve(key, quiet=True):
                return self._begin_region("bare_xml", 0)
        return self._reject()

    def _open_json(self, eof: bool) -> bool:
        buf = self._buf
        j = _skip_space(buf, 1)
        if j == len(buf):
            return False if not eof else self._reject()
        if buf[j] != '"':
            return self._reject()
        close = buf.find('"', j + 1)
        if close < 0:
            if eof or len(buf) - j > 32:
                return self._reject()
            return False
        if buf[j + 1 : close] in CALL_KEYS:
            return self._begin_region("bare_json", 0)
        return self._reject()

    # --- buffered regions ------------------------------------------------------------

    def _begin_region(self, form: str, body_start: int) -> bool:
        self._region = _Region(form, body_start, body_start)
        self._mode = "region"
        return True

    def _step_region(self, eof: bool) -> bool:
        region = self._region
        if region.form == "wrapped":
            return self._step_wrapped_region(region, eof)
        end = self._bare_region_end(region, eof)
        if end is None:
            return False
        result = parse_region(self._buf[:end], self._tools, wrapped=False)
        if result is None:
            return self._reject()
        return self._commit_region(result.calls, result.consumed)

    def _step_wrapped_region(self, region: _Region, eof: bool) -> bool:
        """The body ends at a `</tool_call>` where it parses without truncation repairs
        (an earlier closer may sit inside a JSON string value). At the end of the output
        the closers seen are retried allowing truncation, then the whole rest."""
        buf = self._buf
        start = region.body_start
        while True:
            p = buf.find(_CALL_CLOSE, region.scan)
            if p < 0:
                break
            region.scan = p + 1
            region.closers.append(p)
            result = parse_region(buf[start:p], self._tools, wrapped=True, final=False)
            if result is not None:
                return self._commit_region(result.calls, p + len(_CALL_CLOSE))
        if not eof:
            region.scan = max(region.scan, len(buf) - len(_CALL_CLOSE) + 1)
            return False
        for p in region.closers:
            result = parse_region(buf[start:p], self._tools, wrapped=True)
            if result is not None:
                return self._commit_region(result.calls, p + len(_CALL_CLOSE))
        result = parse_region(buf[start:], self._tools, wrapped=True)
        if result is None:
            return self._reject()
        return self._commit_region(result.calls, len(buf))

    def _commit_region(self, calls, consumed: int) -> bool:
        self._boundary()
        self._consume("call", consumed)
        for call in calls:
            index = self._new_call_index()
            arguments = dumps(call.arguments)
            self._events.append(ToolCallStart(index, self._make_id(index), call.name))
            self._events.append(ToolCallArgsDelta(index, arguments))
            self._events.append(ToolCallEnd(index, arguments))
        self._to_prose()
        return True

    def _bare_region_end(self, region: _Region, eof: bool) -> int | None:
        """Where a bare region ends once known, else None (wait)."""
        buf = self._buf
        n = len(buf)
        if region.form == "bare_json":
            return self._json_extent(region, eof)
        closers = ("</function>", _CALL_CLOSE) if region.form == "bare_xml" else ("</function>",)
        if self._kind == REASONING:
            closers += (_THINK_CLOSE,)  # a bare region never swallows the end of reasoning
        hits = [(p, c) for c in closers if (p := buf.find(c, region.scan)) >= 0]
        if not hits:
            if not eof:
                region.scan = max(region.body_start, n - max(map(len, closers)) + 1)
                return None
            return n
        p, closer = min(hits)
        if closer == _THINK_CLOSE:
            return p
        close_end = p + len(closer)
        if region.form == "bare_xml" and closer == "</function>":
            k = _skip_space(buf, close_end)  # a mismatched `</tool_call>` may follow
            m = match_literal(buf, k, _CALL_CLOSE, eof)
            if m is Match.MORE or (k == n and not eof):
                region.scan = p
                return None
            if m is Match.YES:
                close_end = k + len(_CALL_CLOSE)
        return close_end

    def _json_extent(self, region: _Region, eof: bool) -> int | None:
        buf = self._buf
        i = region.scan
        while i < len(buf):
            c = buf[i]
            if region.in_string:
                if region.escaped:
                    region.escaped = False
                elif c == "\\":
                    region.escaped = True
                elif c == '"':
                    region.in_string = False
            elif c == '"':
                region.in_string = True
            elif c in "{[":
                region.depth += 1
            elif c in "}]":
                region.depth -= 1
                if region.depth <= 0:
                    return i + 1
            i += 1
        region.scan = i
        return i if eof else None

    # --- streamed calls (canonical XML) ----------------------------------------------

    def _new_call_index(self) -> int:
        index = self._next_index
        self._next_index += 1
        self._think_allowed = False
        return index

    def _begin_call(self, opener_end: int, name: str, *, canonical: bool, wrapped: bool) -> None:
        name = name.strip()
        if not canonical:
            log_recovery("attribute_opener", name)
        resolved = self._tools.resolve(name) or name
        self._boundary()
        self._consume("call", opener_end)
        index = self._new_call_index()
        self._call = _OpenCall(index, resolved)
        self._events.append(ToolCallStart(index, self._make_id(index), resolved))
        self._args("{")
        self._wrapped = wrapped
        self._mode = "body"

    def _args(self, fragment: str) -> None:
        if fragment:
            self._call.fragments.append(fragment)
            self._events.append(ToolCallArgsDelta(self._call.index, fragment))

    def _close_call(self) -> None:
        self._args("}")
        self._events.append(ToolCallEnd(self._call.index, "".join(self._call.fragments)))
        self._call = None

    def _step_body(self, eof: bool) -> bool:
        self._consume("call", _skip_space(self._buf, 0))
        buf = self._buf
        if not buf:
            if not eof:
                return False
            log_recovery("truncated_call", self._call.name)
            self._close_call()
            self._to_prose()
            return True
        m, literal = match_any(buf, 0, ("<parameter", "<function", "</function>", _CALL_CLOSE, _CALL_OPEN), eof)
        if m is Match.MORE:
            return False
        if literal in ("<parameter", "<function"):
            tag = literal[1:]
            m, op = parse_opener(buf, 0, tag, eof)
            if m is Match.MORE:
                return False
            if m is Match.YES and op.name:
                if tag == "parameter":
                    self._begin_value(op)
                    return True
                self._close_call()  # a new function without closing this one
                if self._wrapped:
                    self._begin_call(op.end, op.name, canonical=op.canonical, wrapped=True)
                else:
                    self._to_prose()
                return True
        elif literal == "</function>":
            self._consume("call", len(literal))
            self._close_call()
            self._mode = "after_function"
            return True
        elif literal == _CALL_CLOSE:
            self._consume("call", len(literal))
            self._close_call()
            self._to_prose()
            return True
        elif literal == _CALL_OPEN:
            self._close_call()
            self._to_prose()
            return True
        return self._junk_after_call()

    def _junk_after_call(self) -> bool:
        """Something that is not the call grammar inside a streamed call: the call ends
        here; inside a wrapper the rest of it is one more buffered region."""
        if self._call is not None:
            self._close_call()
        if self._wrapped:
            return self._begin_region("wrapped", 0)
        self._to_prose()
        return True

    def _begin_value(self, op) -> None:
        call = self._call
        key = op.name.strip()
        if op.unclosed:
            log_recovery("param_opener_unclosed", key)
        elif not op.canonical:
            log_recovery("attribute_opener", key)
        call.prop = self._tools.property_schema(call.name, key)
        call.streaming = is_string_only(call.prop)
        call.raw = []
        prefix = (", " if call.params else "") + dumps(key) + ": " + ('"' if call.streaming else "")
        call.params += 1
        self._consume("call", op.end)
        self._args(prefix)
        self._value_leading = True
        self._mode = "value"

    def _value_text(self, text: str) -> None:
        if not text:
            return
        self._span("call", text)
        if self._call.streaming:
            self._args(encode_string_fragment(text))
        else:
            self._call.raw.append(text)

    def _close_value(self) -> None:
        call = self._call
        if call.streaming:
            self._args('"')
        else:
            self._args(dumps(convert_value("".join(call.raw), call.prop)))

    def _step_value(self, eof: bool) -> bool:
        if self._value_leading:
            if not self._buf and not eof:
                return False
            if self._buf.startswith("\n"):
                self._consume("call", 1)  # the template's newline after the opener
            self._value_leading = False
        buf = self._buf
        n = len(buf)
        i = 0
        while True:
            stop = _VALUE_STOPS.search(buf, i)
            if stop is None:
                i = n
                break
            i = stop.start()
            m, end = match_value_end(buf, i, eof)
            if m is Match.YES:
                self._value_text(buf[:i])
                self._close_value()
                self._buf = buf[i:]
                self._consume("call", end.close_end - i)
                if end.closes_function:
                    log_recovery("function_closes_value", self._call.name)
                    self._close_call()
                    self._mode = "after_function"
                else:
                    self._mode = "body"
                return True
            if m is Match.MORE:
                break
            i += 1
        if not eof:
            self._value_text(buf[:i])
            self._buf = buf[i:]
            return False
        trailing = 1 if buf.endswith("\n") else 0
        self._value_text(buf[: n - trailing])
        self._buf = buf[n - trailing :]
        self._consume("call", trailing)
        log_recovery("truncated_call", self._call.name)
        self._close_value()
        self._close_call()
        self._to_prose()
        return True

    def _step_after_function(self, eof: bool) -> bool:
        buf = self._buf
        k = _skip_space(buf, 0)
        if k == len(buf) and not eof:
            return False
        m, literal = match_any(buf, k, (_CALL_CLOSE, "<function", _CALL_OPEN), eof)
        if m is Match.MORE:
            return False
        if literal == _CALL_CLOSE:
            self._consume("call", k + len(literal))
            self._to_prose()
            return True
        if not self._wrapped:
            self._to_prose()  # what follows a bare call is prose again
            return True
        self._consume("call", k)
        if k == len(buf) or literal == _CALL_OPEN:
            self._to_prose()
            return True
        if literal == "<function":
            m, op = parse_opener(self._buf, 0, "function", eof)
            if m is Match.MORE:
                return False
            if m is Match.YES and op.name:
                self._begin_call(op.end, op.name, canonical=op.canonical, wrapped=True)
                return True
        return self._junk_after_call()


@dataclass
class ParsedOutput:
    text: str
    reasoning: str
    tool_calls: list[dict]  # {"id", "name", "arguments": dict}


def collect(events: list[Event]) -> ParsedOutput:
    """Fold a complete event list into the non-streaming result."""
    text, reasoning, calls = [], [], {}
    for event in events:
        if isinstance(event, TextDelta):
            text.append(event.text)
        elif isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        elif isinstance(event, ToolCallStart):
            calls[event.index] = {"id": event.id, "name": event.name, "arguments": {}}
        elif isinstance(event, ToolCallEnd):
            calls[event.index]["arguments"] = json.loads(event.arguments_json)
    return ParsedOutput("".join(text), "".join(reasoning), [calls[i] for i in sorted(calls)])


def parse_output(
    text: str,
    tools: Mapping[str, Mapping] | None = None,
    in_reasoning: bool = False,
    *,
    make_id: Callable[[int], str] = random_call_id,
) -> ParsedOutput:
    """The whole output at once, through the same splitter."""
    splitter = StreamSplitter(tools, in_reasoning=in_reasoning, make_id=make_id)
    return collect(splitter.feed(text) + splitter.finish())
