"""Tolerant parsing of tool-call regions that are not the canonical streamed XML form.

The splitter streams the canonical ``<tool_call><function=NAME>...`` form itself. Every
other candidate region (a JSON body, a bare JSON call, ``<tool_name>``/``<name>`` tags,
an openerless parameter list, ...) is buffered whole and handed to ``parse_region``,
which recovers the drift modes catalogued in q27-design.md section 7.7 (numbers and
names in ``toolcall.DRIFT_MODES``) or refuses.

Safety rules, so that recovery never invents a call from prose:

* Everything recovered here must name a registered tool, or have its name inferred
  from the argument keys when exactly one tool fits (``ToolSet.infer``). The only
  exception is the strict canonical JSON form inside a ``<tool_call>`` wrapper
  (``{"name": ..., "arguments": {...}}`` that ``json.loads`` accepts unchanged), which
  is a call whatever its name, like the canonical XML form.
* A wrapped region must be used up entirely (whitespace and stray closers aside);
  anything left over means we would be guessing, so the whole region stays text.
* Repairs are only logged when the region is accepted; a refusal logs one line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from q27py.chat.toolcall import (
    FUNCTION_CLOSER,
    PARAM_CLOSER,
    Match,
    ToolSet,
    clean_surrogates,
    convert_value,
    is_json_safe,
    log_recovery,
    log_refusal,
    match_value_end,
    parse_opener,
    strip_value_newlines,
)

# Keys that may open a JSON call; a `{` line whose first key is another one is prose.
CALL_KEYS = ("name", "arguments", "tool_call", "function", "tool", "tool_name")
_NAME_ALIASES = ("function", "tool", "tool_name")
_ARGUMENT_ALIASES = ("parameters", "args", "input")
_IGNORED_KEYS = {"type", "id"}
_TRAILING_CLOSERS = (PARAM_CLOSER, FUNCTION_CLOSER, "</tool_call>", "</name>", "</tool_name>")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_MAX_RAW_CODE_ATTEMPTS = 64


@dataclass
class RecoveredCall:
    name: str
    arguments: dict


@dataclass
class RegionResult:
    calls: list[RecoveredCall]
    consumed: int  # characters of the region that the calls used (the rest is prose)
    modes: list[str] = field(default_factory=list)


TRUNCATION_MODES = {"truncated_json", "truncated_escape", "truncated_call"}


def parse_region(body: str, tools: ToolSet, *, wrapped: bool, final: bool = True) -> RegionResult | None:
    """Recover the calls in one buffered region, or None to keep it as text.

    `body` is what lies between `<tool_call>` and `</tool_call>` when `wrapped`, else
    the bare region starting at its opener. With `final=False` the caller may still
    find a longer body (the closer seen may sit inside a value), so a body that only
    parses by repairing truncation is declined quietly. Repairs are logged on success."""
    modes: list[str] = []
    try:
        result = _parse(body, tools, wrapped, modes)
    except RecursionError:
        result = None
    if result is not None and not final and TRUNCATION_MODES & set(modes):
        return None
    if result is not None and not wrapped and "truncated_call" in modes:
        result = None  # bare tags with a value that never closes: too likely to be prose
    if result is None or not result.calls:
        if final:
            log_refusal(f"{'wrapped' if wrapped else 'bare'} region {body[:60]!r}")
        return None
    if not wrapped and body.lstrip().startswith("{"):
        modes.insert(0, "wrapper_dropped")
    seen = set()
    for mode in modes:
        if mode not in seen:
            seen.add(mode)
            log_recovery(mode, ", ".join(c.name for c in result.calls))
    result.modes = list(dict.fromkeys(modes))
    return result


def _parse(body: str, tools: ToolSet, wrapped: bool, modes: list[str]) -> RegionResult | None:
    lead = len(body) - len(body.lstrip())
    s = body[lead:]
    if not s:
        return None
    if s.startswith("<function"):
        m, op = parse_opener(s, 0, "function", eof=True)
        if m is Match.YES and op.name is None and s[op.end :].lstrip().startswith("{"):
            modes.append("json_in_function")
            call = _json_call(s[op.end :], tools, modes, explicit=False)
            return RegionResult([call], len(body)) if call else None
    if s.startswith("{"):
        call = _json_call(s, tools, modes, explicit=wrapped)
        if call is None and "<parameter" in s:
            calls = _chimera(s, tools, modes)
            return RegionResult(calls, len(body)) if calls else None
        return RegionResult([call], len(body)) if call else None
    if s.startswith("<name>") and not re.match(r"<name>[^<>\n]*</name>", s):
        spliced = _splice_name(s[len("<name>") :], tools)
        if spliced is None:
            return None
        modes.append("name_tag_json")
        call = _json_call(spliced, tools, modes, explicit=False)
        return RegionResult([call], len(body)) if call else None
    if s.startswith("<"):
        calls, stop = _xml_calls(s, tools, modes)
        if not calls:
            return None
        if wrapped and s[stop:].strip():
            return None
        return RegionResult(calls, lead + stop)
    spliced = _splice_name(s, tools)
    if spliced is None:
        return None
    modes.append("name_opener_dropped")
    call = _json_call(spliced, tools, modes, explicit=False)
    return RegionResult([call], len(body)) if call else None


def _splice_name(s: str, tools: ToolSet) -> str | None:
    """`NAME", "arguments": ...}` or `NAME, "arguments": ...` -> a JSON object text,
    when NAME is a registered tool (modes 10 and 15: the `{"name": "` opener lost)."""
    m = _IDENT.match(s)
    if not m or not tools.resolve(m.group(), quiet=True):
        return None
    rest = s[m.end() :]
    rest = rest[1:] if rest.startswith('"') else rest
    if not rest.lstrip().startswith((",", "}")):
        return None
    return '{"name": ' + json.dumps(m.group()) + rest


# --- JSON calls ----------------------------------------------------------------------


def _strip_closers(s: str, modes: list[str]) -> str:
    s = s.rstrip()
    stripped = True
    while stripped:
        stripped = False
        for closer in _TRAILING_CLOSERS:
            if s.endswith(closer):
                s = s[: -len(closer)].rstrip()
                stripped = True
                if closer != FUNCTION_CLOSER or "json_in_function" not in modes:
                    modes.append("json_xml_closers")
    return s


def _json_call(s: str, tools: ToolSet, modes: list[str], *, explicit: bool) -> RecoveredCall | None:
    """A JSON call; `modes` is extended only when the call is accepted."""
    found = list(modes)
    call = _json_call_into(s, tools, found, explicit=explicit)
    if call is not None:
        modes[:] = found
    return call


def _json_call_into(s: str, tools: ToolSet, modes: list[str], *, explicit: bool) -> RecoveredCall | None:
    text = _strip_closers(s, modes)
    if explicit and not modes:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            obj = None
        if isinstance(obj, dict) and set(obj) <= {"name", "arguments"} and isinstance(obj.get("name"), str):
            args = obj.get("arguments", {})
            if isinstance(args, dict) and obj["name"].strip() and is_json_safe(args):
                name = tools.resolve(obj["name"]) or obj["name"].strip()
                return RecoveredCall(name, clean_surrogates(args))

    def accept(value: Any, repairs: list[str]) -> RecoveredCall | None:
        trial = modes + repairs
        call = _normalize(value, tools, trial)
        if call is not None:
            modes[:] = trial
        return call

    return _loads_lenient(text, accept)


def _normalize(obj: Any, tools: ToolSet, modes: list[str]) -> RecoveredCall | None:
    """A parsed JSON object as a call to a registered tool, or None."""
    if not isinstance(obj, dict):
        return None
    if len(obj) == 1 and isinstance(obj.get("tool_call"), dict):
        obj = obj["tool_call"]
        modes.append("tool_call_key")
    elif isinstance(obj.get("function"), dict) and "name" in obj["function"]:
        obj = obj["function"]  # the OpenAI shape {"type": "function", "function": {...}}
        modes.append("tool_call_key")
    name_key = "name" if "name" in obj else next((k for k in _NAME_ALIASES if isinstance(obj.get(k), str)), None)
    if name_key and name_key != "name":
        modes.append("alias_key")
    args_key = "arguments" if "arguments" in obj else next((k for k in _ARGUMENT_ALIASES if k in obj), None)
    if args_key and args_key != "arguments":
        modes.append("alias_key")
    name_value = obj.get(name_key) if name_key else None
    args = obj.get(args_key) if args_key else None
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
        modes.append("arguments_as_string")

    if isinstance(name_value, dict) and args is None:
        name, args = _name_from_arguments(name_value, tools, modes)
    elif name_value is None:
        if not isinstance(args, dict):
            return None
        name = tools.infer(args)
        modes.append("name_holds_arguments")
    elif isinstance(name_value, str):
        name = tools.resolve(name_value, quiet=True)
        if isinstance(name_value, Bareword):
            modes.append("unquoted_name")
        if name and name != name_value.strip():
            modes.append("name_case")
    else:
        return None
    if name is None:
        return None
    if args is None:
        args = {k: v for k, v in obj.items() if k not in _IGNORED_KEYS and k not in (name_key, "name")}
        # Arguments beside the name only count when they fit the tool exactly: a bare
        # {"name": ...} or a tool description is not evidence of a call.
        if not args or not (tools.required(name) <= set(args) <= set(tools.properties(name))):
            return None
        modes.append("flat_arguments")
    if not isinstance(args, dict) or _has_bareword(args) or not is_json_safe(args):
        return None
    return RecoveredCall(name, clean_surrogates(args))


def _name_from_arguments(inner: dict, tools: ToolSet, modes: list[str]) -> tuple[str | None, dict]:
    """Modes 6 and 7: {"name": {ARGS}} (tool inferred from the keys), or the arguments
    nested one level deeper under a lone key (a tool name, or a shell to peel)."""
    name = tools.infer(inner)
    if name is not None:
        modes.append("name_holds_arguments")
        return name, inner
    if len(inner) == 1:
        (key, nested), = inner.items()
        if isinstance(nested, dict):
            name = tools.resolve(key, quiet=True) or tools.infer(nested)
            if name is not None:
                modes.append("nested_shell_key")
                return name, nested
    return None, inner


def _has_bareword(value: Any) -> bool:
    if isinstance(value, Bareword):
        return True
    if isinstance(value, dict):
        return any(_has_bareword(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_bareword(v) for v in value)
    return False


def _loads_lenient(text: str, accept) -> Any:
    """Parse with the lenient parser; if that fails, try drift mode 11 (a raw code
    string with unescaped quotes). Positional recovery: the broken value is the last
    string value that began before the parse failed, and it runs to the last quote
    before the closing braces; earlier string values are tried next."""
    repairs: list[str] = []
    parser = _LenientJSON(text, repairs)
    try:
        value = parser.parse()
    except _Fail:
        pass
    else:
        return accept(value, repairs)
    closing = re.search(r'"\s*(?:\}\s*)+$', text)
    if not closing:
        return None
    last_quote = closing.start()
    starts = [p for p in parser.value_starts if p < last_quote]
    for open_quote in reversed(starts[-_MAX_RAW_CODE_ATTEMPTS:]):
        raw = text[open_quote + 1 : last_quote]
        fixed = text[:open_quote] + json.dumps(_min_unescape(raw), ensure_ascii=False) + text[last_quote + 1 :]
        repairs = ["raw_code_string"]
        try:
            value = _LenientJSON(fixed, repairs).parse()
        except _Fail:
            continue
        call = accept(value, repairs)
        if call is not None:
            return call
    return None


_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _min_unescape(raw: str) -> str:
    """Decode the JSON escapes that are valid; keep everything else (raw quotes, raw
    newlines, stray backslashes) as written."""
    out = []
    i, n = 0, len(raw)
    while i < n:
        c = raw[i]
        if c == "\\" and i + 1 < n:
            e = raw[i + 1]
            if e in _ESCAPES:
                out.append(_ESCAPES[e])
                i += 2
                continue
            if e == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", raw[i + 2 : i + 6]):
                out.append(chr(int(raw[i + 2 : i + 6], 16)))
                i += 6
                continue
        out.append(c)
        i += 1
    return "".join(out)


class _Fail(Exception):
    """The text is not a JSON value even leniently."""


class _Truncated(Exception):
    """The text ended before a value started (the pending key is dropped)."""


class Bareword(str):
    """An unquoted word where a string belongs; only a tool name may be one (mode 12)."""


_PLAIN_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


class _LenientJSON:
    """A JSON parser that records, rather than rejects, the drift it can repair:
    truncation (2) and cut escapes (13), `<content>` raw values (3), raw control
    characters in strings (5), a key missing its opening quote (9), unquoted words (12,
    judged by the caller) and trailing commas."""

    def __init__(self, text: str, repairs: list[str]):
        self.s = text
        self.i = 0
        self.repairs = repairs
        self.value_starts: list[int] = []  # opening quotes of string values, for mode 11

    def note(self, mode: str) -> None:
        if mode not in self.repairs:
            self.repairs.append(mode)

    def parse(self) -> Any:
        try:
            value = self.value()
        except _Truncated:
            raise _Fail from None
        self.ws()
        if self.i != len(self.s):
            raise _Fail
        return value

    def ws(self) -> None:
        s, i, n = self.s, self.i, len(self.s)
        while i < n and s[i] in " \t\r\n":
            i += 1
        self.i = i

    def at_end(self) -> bool:
        return self.i >= len(self.s)

    def value(self) -> Any:
        self.ws()
        if self.at_end():
            raise _Truncated
        c = self.s[self.i]
        if c == "{":
            return self.container("}", keyed=True)
        if c == "[":
            return self.container("]", keyed=False)
        if c == '"':
            self.value_starts.append(self.i)
            return self.string()
        if self.s.startswith("<content>", self.i):
            return self.content_tag()
        if c == "-" or c.isdigit():
            return self.number()
        m = _WORD.match(self.s, self.i)
        if m:
            word = m.group()
            self.i = m.end()
            if word in ("true", "false", "null"):
                return {"true": True, "false": False, "null": None}[word]
            if self.at_end() and any(lit.startswith(word) for lit in ("true", "false", "null")):
                raise _Truncated
            return Bareword(word)
        raise _Fail

    def container(self, close: str, *, keyed: bool) -> Any:
        self.i += 1
        out: Any = {} if keyed else []
        first = True
        while True:
            self.ws()
            if self.at_end():
                self.note("truncated_json")
                return out
            c = self.s[self.i]
            if c == close:
                self.i += 1
                return out
            if not first:
                if c != ",":
                    raise _Fail
                self.i += 1
                self.ws()
                if self.at_end():
                    self.note("truncated_json")
                    return out
                if self.s[self.i] == close:
                    self.note("trailing_comma")
                    self.i += 1
                    return out
            first = False
            try:
                if keyed:
                    key = self.key()
                    self.ws()
                    if self.at_end():
                        raise _Truncated
                    if self.s[self.i] != ":":
                        raise _Fail
                    self.i += 1
                    out[key] = self.value()
                else:
                    out.append(self.value())
            except _Truncated:
                self.note("truncated_json")
                return out

    def key(self) -> str:
        if self.s[self.i] == '"':
            start = self.i
            key = self.string()
            if self.at_end() and not self.s.endswith('"', start + 1):
                raise _Truncated  # the key itself was cut
            return key
        m = _WORD.match(self.s, self.i)
        if not m:
            raise _Fail
        self.i = m.end()
        if self.at_end():
            raise _Truncated
        if self.s[self.i] == '"':
            self.i += 1
        elif self.s[self.i] not in " \t:":
            raise _Fail
        self.note("arguments_quote_dropped")
        return m.group()

    def string(self) -> str:
        s, n = self.s, len(self.s)
        self.i += 1
        out: list[str] = []
        while True:
            m = _PLAIN_RUN.match(s, self.i)
            if m:
                out.append(m.group())
                self.i = m.end()
            if self.i >= n:
                self.note("truncated_json")
                return "".join(out)
            c = s[self.i]
            if c == '"':
                self.i += 1
                return "".join(out)
            if c != "\\":
                self.note("raw_control_chars")
                out.append(c)
                self.i += 1
                continue
            if self.i + 1 >= n:
                self.note("truncated_escape")
                self.note("truncated_json")
                self.i = n
                return "".join(out)
            e = s[self.i + 1]
            if e in _ESCAPES:
                out.append(_ESCAPES[e])
                self.i += 2
            elif e == "u":
                digits = s[self.i + 2 : self.i + 6]
                if re.fullmatch(r"[0-9a-fA-F]{4}", digits):
                    out.append(chr(int(digits, 16)))
                    self.i += 6
                elif self.i + 2 + len(digits) >= n and re.fullmatch(r"[0-9a-fA-F]*", digits):
                    self.note("truncated_escape")
                    self.note("truncated_json")
                    self.i = n
                    return "".join(out)
                else:
                    self.note("invalid_escape")
                    out.append("\\")
                    self.i += 1
            else:
                self.note("invalid_escape")
                out.append("\\")
                self.i += 1

    def content_tag(self) -> str:
        """Mode 3: `<content>RAW</content>` as a string value. The closer is the first
        one followed by `,`, `}`, `]` or the end; else the last one."""
        start = self.i + len("<content>")
        closers = [m.start() for m in re.finditer(re.escape("</content>"), self.s[start:])]
        end = None
        for c in closers:
            after = self.s[start + c + len("</content>") :].lstrip()
            if not after or after[0] in ",}]":
                end = c
                break
        if end is None and closers:
            end = closers[-1]
        self.note("content_tags")
        if end is None:
            self.note("truncated_json")
            raw = self.s[start:]
            self.i = len(self.s)
        else:
            raw = self.s[start : start + end]
            self.i = start + end + len("</content>")
        return strip_value_newlines(raw)

    def number(self) -> Any:
        m = _NUMBER.match(self.s, self.i)
        if not m:
            if self.s[self.i :] == "-":
                raise _Truncated
            raise _Fail
        end = m.end()
        tail = self.s[end:]
        if tail and (tail[0] in ".eE" or tail[0].isalnum()):
            if not re.fullmatch(r"\.|[eE][+\-]?", tail):
                raise _Fail
            self.note("truncated_json")  # cut mid-number at the very end: keep what parses
            end = len(self.s)
        self.i = end
        try:
            return json.loads(m.group())
        except ValueError:
            raise _Fail from None


# --- XML-ish calls -------------------------------------------------------------------


@dataclass
class _Draft:
    name: str | None
    how: str  # "function", "function_attr", "tool_name", "name_tag", "param_name", "none"
    params: list[tuple[str, str]] = field(default_factory=list)


def _xml_calls(s: str, tools: ToolSet, modes: list[str]) -> tuple[list[RecoveredCall], int]:
    """Scan tags (function openers/closers, parameters, <tool_name>, <name>, wrapper
    markers) from s[0]; group them into calls. Returns the calls and where the scan
    stopped (the first thing that is not one of these tags)."""
    drafts: list[_Draft] = []
    current: _Draft | None = None
    i, n = 0, len(s)
    stop = 0
    while True:
        i = _skip_ws(s, i)
        if i >= n:
            break
        if s.startswith("<parameter", i):
            m, op = parse_opener(s, i, "parameter", eof=True)
            if m is not Match.YES or op.name is None:
                break
            after = _skip_ws(s, op.end)
            named_tool = tools.resolve(op.name, quiet=True)
            if named_tool and not tools.is_param_key(op.name) and s.startswith("<parameter", after):
                current = _Draft(named_tool, "param_name")  # mode 22
                drafts.append(current)
                i = op.end
                stop = i
                continue
            if op.unclosed:
                modes.append("param_opener_unclosed")
            elif not op.canonical:
                modes.append("attribute_opener")
            value, i = _buffered_value(s, op.end, modes)
            if current is None:
                current = _Draft(None, "none")
                drafts.append(current)
            current.params.append((op.name.strip(), value))
        elif s.startswith("<function", i):
            m, op = parse_opener(s, i, "function", eof=True)
            if m is not Match.YES:
                break
            current = _Draft(op.name, "function" if op.canonical else "function_attr")
            drafts.append(current)
            i = op.end
        elif s.startswith("<tool_name>", i) or s.startswith("<name>", i):
            tag = "tool_name" if s.startswith("<tool_name>", i) else "name"
            close = s.find(f"</{tag}>", i)
            start = i + len(tag) + 2
            if close < 0 or "\n" in s[start:close].strip() or "<" in s[start:close]:
                break
            current = _Draft(s[start:close].strip(), "tool_name" if tag == "tool_name" else "name_tag")
            drafts.append(current)
            i = close + len(tag) + 3
        elif s.startswith(FUNCTION_CLOSER, i) or s.startswith("</tool_call>", i) or s.startswith("<tool_call>", i):
            current = None
            i = s.index(">", i) + 1
        else:
            break
        stop = i
    calls = []
    for draft in drafts:
        call = _finish_draft(draft, tools, modes)
        if call is None:
            return [], 0
        calls.append(call)
    return calls, stop


def _skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in " \t\r\n":
        i += 1
    return i


def _buffered_value(s: str, start: int, modes: list[str]) -> tuple[str, int]:
    """The value starting at s[start] and the index past its closer. The closer is the
    first one where the structure continues; failing that the last `</parameter>`
    (values may contain the closer); failing that the value runs to the end."""
    for m in re.finditer(r"\n?</(?:parameter|function)>", s[start:]):
        at = start + m.start()
        found, end = match_value_end(s, at, eof=True)
        if found is Match.YES:
            if end.closes_function:
                modes.append("function_closes_value")
                return strip_value_newlines(s[start:at]), at + (1 if s[at] == "\n" else 0)
            return strip_value_newlines(s[start:at]), end.close_end
    last = s.rfind(PARAM_CLOSER, start)
    if last >= 0:
        return strip_value_newlines(s[start:last]), last + len(PARAM_CLOSER)
    modes.append("truncated_call")
    return strip_value_newlines(s[start:]), len(s)


_HOW_MODES = {
    "function_attr": "attribute_opener",
    "tool_name": "tool_name_tag",
    "name_tag": "name_tag",
    "param_name": "name_as_parameter",
}


def _finish_draft(draft: _Draft, tools: ToolSet, modes: list[str]) -> RecoveredCall | None:
    keys = [k for k, _ in draft.params]
    if draft.name:
        name = tools.resolve(draft.name, quiet=True)
        if name and name != draft.name:
            modes.append("name_case")
        if draft.how in _HOW_MODES:
            modes.append(_HOW_MODES[draft.how])
    else:
        name = tools.infer(keys)
        if draft.how == "tool_name":
            modes.append("empty_tool_name_batch")
        elif draft.how == "none":
            modes.append("openerless_parameters")
        elif draft.how.startswith("function"):
            modes.append("openerless_parameters")
    if name is None:
        return None
    args = {key: convert_value(raw, tools.property_schema(name, key)) for key, raw in draft.params}
    return RecoveredCall(name, args)


def _chimera(s: str, tools: ToolSet, modes: list[str]) -> list[RecoveredCall] | None:
    """Mode 17's chimera: a JSON head naming the tool, then XML parameters."""
    cut = s.index("<parameter")
    head = s[:cut]
    m = re.search(r'"name"\s*:\s*"?([^",}\s]+)', head)
    if not m:
        return None
    name = tools.resolve(m.group(1), quiet=True)
    if name is None:
        return None
    draft = _Draft(name, "chimera")
    i = cut
    while True:
        i = _skip_ws(s, i)
        if not s.startswith("<parameter", i):
            break
        mm, op = parse_opener(s, i, "parameter", eof=True)
        if mm is not Match.YES or op.name is None:
            return None
        value, i = _buffered_value(s, op.end, modes)
        draft.params.append((op.name.strip(), value))
    tail = s[i:]
    for closer in _TRAILING_CLOSERS:
        tail = tail.replace(closer, "")
    if tail.strip(" \t\r\n}]"):
        return None
    modes.append("bare_function")
    return [RecoveredCall(name, {k: convert_value(v, tools.property_schema(name, k)) for k, v in draft.params})]
