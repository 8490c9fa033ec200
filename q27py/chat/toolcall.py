"""The Qwen tool-call grammar, shared by the streaming splitter and the drift parser.

Two call dialects reach us:

* XML (what Qwen3.5/3.6/3.8 are trained on)::

      <tool_call>
      <function=NAME>
      <parameter=KEY>
      VALUE
      </parameter>
      </function>
      </tool_call>

* JSON (Qwen3's form): ``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``.

This module holds the pieces both parsers must agree on, so that a streamed call and
a buffered one give the same result:

Openers. ``<function ...>`` and ``<parameter ...>`` accept ``=NAME``, ``="NAME"``,
``name="NAME"`` and ``name=NAME`` with whitespace (newlines included) around the name;
anything but ``=NAME>`` is drift mode 19 (HTML-attribute opener). A parameter opener
whose ``>`` is missing but whose name is followed by a newline is accepted too (the
value starts at that newline): small models drop the ``>`` and the alternative is a
key like ``"echo ...\\n</parameter"``. Names are at most 256 characters, which bounds
how much the splitter ever holds back for an opener.

Where a value ends. A value is everything between its opener and a closer; one
newline right after the opener and one right before the closer belong to the markup
(the template writes ``<parameter=K>\\nV\\n</parameter>``). Because a value may contain
a literal ``</parameter>`` (someone writing an XML file), a closer only counts where
the structure visibly continues: ``</parameter>``, optional whitespace, then another
opener or closer (``<parameter``, ``</function>``, ``</tool_call>``, ``<function``,
``<tool_call>``, ``<tool_name>``) or the end of the output. ``</function>`` directly
after a value (the ``</parameter>`` forgotten) also closes it when followed by
``</tool_call>``, ``<tool_call>``, ``<function`` or the end.

Typing. Values are converted to the type the tool's JSON schema gives the parameter:
strings stay raw; integer/number/boolean/null/object/array go through ``json.loads``
(never ``eval``), plus the literals Qwen3.5's template writes for Python values
(``True``/``False``/``None``). A value that does not fit its declared type is kept as
the raw string, for the client to reject. For a union that includes string, a value
that parses as one of the other types takes it (``["string", "null"]``: ``null`` is
None). A parameter the schema does not describe, or whose schema states no type, is
parsed as JSON when it is JSON, else kept as a string.
A parameter given twice appears twice in the streamed JSON object (still valid JSON;
decoders keep the last, as ``parse_output`` does).

Names. A call's name resolves to a registered tool exactly, else case-insensitively
when that is unique. Drift recovery only ever produces registered names; a name may
be inferred from argument keys when exactly one tool fits (see ``ToolSet.infer``).

Every recovery is logged on the ``q27py.toolcall`` logger with its mode name.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any, NamedTuple

log = logging.getLogger("q27py.toolcall")

# The drift modes catalogued from the anchor engine (q27-design.md section 7.7), by number.
DRIFT_MODES: dict[int, str] = {
    1: "wrapper_dropped",
    2: "truncated_json",
    3: "content_tags",
    4: "tool_call_key",
    5: "raw_control_chars",
    6: "name_holds_arguments",
    7: "nested_shell_key",
    8: "alias_key",
    9: "arguments_quote_dropped",
    10: "name_opener_dropped",
    11: "raw_code_string",
    12: "unquoted_name",
    13: "truncated_escape",
    14: "tool_name_tag",
    15: "name_tag_json",
    16: "json_in_function",
    17: "bare_function",
    18: "name_tag",
    19: "attribute_opener",
    20: "empty_tool_name_batch",
    21: "openerless_parameters",
    22: "name_as_parameter",
}
MODE_NUMBERS = {name: number for number, name in DRIFT_MODES.items()}

# Recoveries outside the numbered catalogue (also logged).
EXTRA_RECOVERIES = (
    "name_case",  # tool name differs only in case from a registered one
    "param_opener_unclosed",  # `<parameter=K` + newline, no `>`
    "function_closes_value",  # `</function>` directly after a value
    "truncated_call",  # output ended inside a call
    "empty_call",  # `<tool_call>` with nothing (or only whitespace) inside
    "json_xml_closers",  # a JSON body closed with `</parameter></function>` and the like
    "flat_arguments",  # arguments given next to the name instead of under "arguments"
    "arguments_as_string",  # "arguments" holds a JSON string of the object
    "invalid_escape",  # a backslash that starts no JSON escape, kept literally
    "trailing_comma",
)


def mode_label(mode: str) -> str:
    number = MODE_NUMBERS.get(mode)
    return f"mode {number} {mode}" if number else mode


def log_recovery(mode: str, detail: str = "") -> None:
    log.info("tool-call drift recovered: %s%s", mode_label(mode), f" ({detail})" if detail else "")


def log_refusal(reason: str) -> None:
    log.info("tool-call candidate refused, kept as text: %s", reason)


class Match(Enum):
    """Result of matching a pattern at a position of a buffer that may still grow."""

    NO = 0
    MORE = 1  # the buffer ends while the pattern could still match: wait for more text
    YES = 2


def match_literal(buf: str, i: int, literal: str, eof: bool) -> Match:
    if buf.startswith(literal, i):
        return Match.YES
    rest = buf[i : i + len(literal)]
    if not eof and len(rest) < len(literal) and literal.startswith(rest):
        return Match.MORE
    return Match.NO


def match_any(buf: str, i: int, literals: Iterable[str], eof: bool) -> tuple[Match, str | None]:
    """YES with the literal that matches, else MORE if any still could, else NO."""
    pending = False
    for literal in literals:
        m = match_literal(buf, i, literal, eof)
        if m is Match.YES:
            return Match.YES, literal
        pending = pending or m is Match.MORE
    return (Match.MORE if pending else Match.NO), None


# --- openers -------------------------------------------------------------------------

MAX_NAME_LEN = 256
_SPACE = " \t\r\n"
_NAME_STOP = set(_SPACE + "<>\"'=/")


class Opener(NamedTuple):
    end: int  # index just past the opener
    name: str | None  # None for a bare `<function>`
    canonical: bool  # exactly `<tag=NAME>`; anything else is drift mode 19 (or unclosed)
    unclosed: bool = False  # `<parameter=K` ended by a newline instead of `>`


def _skip_space(buf: str, j: int) -> int:
    n = len(buf)
    while j < n and buf[j] in _SPACE:
        j += 1
    return j


def parse_opener(buf: str, i: int, tag: str, eof: bool) -> tuple[Match, Opener | None]:
    """Parse `<TAG=NAME>` and its attribute spellings at buf[i]. Names never contain
    whitespace or markup characters, so a missing closer is detected quickly."""
    lead = "<" + tag
    m = match_literal(buf, i, lead, eof)
    if m is not Match.YES:
        return m, None
    n = len(buf)
    more = (Match.NO if eof else Match.MORE), None
    j = i + len(lead)
    if j == n:
        return more
    canonical = True
    if buf[j] == ">":
        return Match.YES, Opener(j + 1, None, False)
    if buf[j] == "=":
        j += 1
    elif buf[j] in _SPACE:
        canonical = False
        j = _skip_space(buf, j)
        if j == n:
            return more
        if buf[j] == ">":
            return Match.YES, Opener(j + 1, None, False)
        if buf[j] != "=":
            m = match_literal(buf, j, "name", eof)
            if m is not Match.YES:
                return m, None
            j = _skip_space(buf, j + 4)
            if j == n:
                return more
            if buf[j] != "=":
                return Match.NO, None
        j += 1
    else:
        return Match.NO, None  # `<functions`, `<parameter_list`: not our tag
    k = _skip_space(buf, j)
    if k != j:
        canonical = False
    j = k
    if j == n:
        return more
    if buf[j] in "\"'":
        quote = buf[j]
        canonical = False
        k = j + 1
        while k < n and buf[k] != quote:
            if buf[k] in "<>\n" or k - j > MAX_NAME_LEN:
                return Match.NO, None
            k += 1
        if k == n:
            return more
        name = buf[j + 1 : k]
        j = k + 1
    else:
        k = j
        while k < n and buf[k] not in _NAME_STOP:
            if k - j > MAX_NAME_LEN:
                return Match.NO, None
            k += 1
        if k == n:
            return more
        name = buf[j:k]
        j = k
    if not name.strip():
        return Match.NO, None
    after_name = j
    k = _skip_space(buf, j)
    if k == n:
        return more
    if buf[k] == ">":
        return Match.YES, Opener(k + 1, name, canonical and k == after_name)
    if tag == "parameter" and "\n" in buf[after_name:k]:
        return Match.YES, Opener(after_name, name, False, unclosed=True)
    return Match.NO, None


# --- where a value ends --------------------------------------------------------------

PARAM_CLOSER = "</parameter>"
FUNCTION_CLOSER = "</function>"
AFTER_PARAM_CLOSER = ("<parameter", "</function>", "</tool_call>", "<function", "<tool_call>", "<tool_name>")
AFTER_FUNCTION_CLOSER = ("</tool_call>", "<tool_call>", "<function")


class ValueEnd(NamedTuple):
    close_end: int  # index just past the closer (the optional newline before it included)
    closes_function: bool  # the closer was `</function>` (the function ends with the value)


def match_value_end(buf: str, i: int, eof: bool) -> tuple[Match, ValueEnd | None]:
    """Does a value end at buf[i] (a newline or `<`)? See the module docstring."""
    n = len(buf)
    j = i + 1 if buf[i] == "\n" else i
    if j == n:
        return (Match.NO if eof else Match.MORE), None
    pending = False
    for closer, follows in ((PARAM_CLOSER, AFTER_PARAM_CLOSER), (FUNCTION_CLOSER, AFTER_FUNCTION_CLOSER)):
        m = match_literal(buf, j, closer, eof)
        if m is Match.MORE:
            pending = True
            continue
        if m is Match.NO:
            continue
        end = j + len(closer)
        k = _skip_space(buf, end)
        found = ValueEnd(end, closer == FUNCTION_CLOSER)
        if k == n:
            if eof:
                return Match.YES, found
            pending = True
            continue
        m, _ = match_any(buf, k, follows, eof)
        if m is Match.YES:
            return Match.YES, found
        pending = pending or m is Match.MORE
    return (Match.MORE if pending else Match.NO), None


def strip_value_newlines(raw: str) -> str:
    """Drop the one newline on each side that the template puts around a value."""
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    return raw


# --- schema typing -------------------------------------------------------------------

_JSON_TYPES = {"string", "integer", "number", "boolean", "object", "array", "null"}
_LITERALS = {"true": True, "false": False, "null": None}
_PY_LITERALS = {"True": True, "False": False, "None": None}


def schema_types(prop: Mapping | None) -> frozenset[str] | None:
    """The JSON types a property schema allows; None when it does not say."""
    if not isinstance(prop, Mapping):
        return None
    found: set[str] = set()
    t = prop.get("type")
    if isinstance(t, str):
        found.add(t)
    elif isinstance(t, list):
        found.update(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf"):
        for sub in prop.get(key) or ():
            sub_types = schema_types(sub)
            if sub_types is None:
                return None  # one branch accepts anything
            found |= sub_types
    if not found and isinstance(prop.get("enum"), list):
        found.update(_json_type_of(v) for v in prop["enum"])
    found &= _JSON_TYPES
    return frozenset(found) or None


def _json_type_of(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def is_string_only(prop: Mapping | None) -> bool:
    """Values of this property stream as JSON-string fragments while they arrive."""
    return schema_types(prop) == frozenset({"string"})


def _reject_constant(name: str) -> Any:
    raise ValueError(name)  # NaN / Infinity are not JSON


def safe_json_loads(text: str) -> tuple[bool, Any]:
    """json.loads that never raises, never yields NaN/Infinity and never yields lone
    surrogates (a `\\ud800` escape), which could not be encoded as UTF-8 later."""
    try:
        return True, clean_surrogates(json.loads(text, parse_constant=_reject_constant, strict=False))
    except (ValueError, RecursionError):
        return False, None


def clean_surrogates(value: Any) -> Any:
    """Every string of a JSON value made encodable: surrogate pairs combined, lone
    surrogates replaced with U+FFFD."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            # pairs written as two escapes combine; lone halves become U+FFFD
            return value.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    if isinstance(value, dict):
        return {clean_surrogates(k): clean_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean_surrogates(v) for v in value]
    return value


def _fits(value: Any, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t == "boolean":
        return isinstance(value, bool)
    if t == "null":
        return value is None
    if t == "object":
        return isinstance(value, dict)
    if t == "array":
        return isinstance(value, list)
    return isinstance(value, str)


def convert_value(raw: str, prop: Mapping | None) -> Any:
    """A parameter's raw XML text as the JSON value its schema asks for."""
    types = schema_types(prop)
    if types == frozenset({"string"}):
        return raw
    text = raw.strip()
    if types is None:
        ok, value = safe_json_loads(text)
        return value if ok and is_json_safe(value) else raw
    if text in _PY_LITERALS and any(_fits(_PY_LITERALS[text], t) for t in types):
        return _PY_LITERALS[text]
    ok, value = safe_json_loads(text)
    if ok and is_json_safe(value):
        if "integer" in types and isinstance(value, float) and value.is_integer() and "number" not in types:
            value = int(value)
        if any(_fits(value, t) for t in types - {"string"}):
            return value
    return raw


def is_json_safe(value: Any) -> bool:
    """json.dumps(value) will succeed and give valid JSON (no NaN, no huge ints)."""
    try:
        dumps(value)
        return True
    except (ValueError, TypeError, RecursionError):
        return False


def dumps(value: Any) -> str:
    """The one JSON encoding used for emitted arguments (fragments and whole)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def encode_string_fragment(text: str) -> str:
    """The JSON-string body of `text`: concatenating fragments equals encoding the whole,
    because json escapes each character on its own."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


# --- the registered tools ------------------------------------------------------------


class ToolSet:
    """Tools as {name: JSON schema of the parameters}; names resolve and infer here."""

    def __init__(self, tools: Mapping[str, Mapping] | None):
        self.schemas: dict[str, Mapping] = {}
        for name, schema in (tools or {}).items():
            self.schemas[str(name)] = schema if isinstance(schema, Mapping) else {}
        self._by_folded: dict[str, list[str]] = {}
        for name in self.schemas:
            self._by_folded.setdefault(name.casefold(), []).append(name)
        self._param_keys = {k for name in self.schemas for k in self.properties(name)}

    def __bool__(self) -> bool:
        return bool(self.schemas)

    def resolve(self, name: str | None, *, quiet: bool = False) -> str | None:
        """The registered tool this name means, or None."""
        if not name:
            return None
        name = name.strip()
        if name in self.schemas:
            return name
        folded = self._by_folded.get(name.casefold(), [])
        if len(folded) == 1:
            if not quiet:
                log_recovery("name_case", f"{name!r} -> {folded[0]!r}")
            return folded[0]
        return None

    def properties(self, tool: str | None) -> Mapping:
        props = self.schemas.get(tool or "", {}).get("properties")
        return props if isinstance(props, Mapping) else {}

    def required(self, tool: str) -> set[str]:
        req = self.schemas.get(tool, {}).get("required")
        return {str(k) for k in req} if isinstance(req, list) else set()

    def property_schema(self, tool: str | None, key: str) -> Mapping | None:
        prop = self.properties(tool).get(key)
        return prop if isinstance(prop, Mapping) else None

    def is_param_key(self, key: str) -> bool:
        return key in self._param_keys

    def infer(self, keys: Iterable[str]) -> str | None:
        """The one tool these argument keys call, or None when none or several fit.

        First the tools whose required set is exactly the keys; then the best score
        (keys the tool knows minus keys it does not) among tools whose required keys
        are all present. Ties are refused."""
        given = set(keys)
        if not given:
            return None
        exact = [t for t in self.schemas if self.required(t) == given and given <= set(self.properties(t))]
        if len(exact) == 1:
            return exact[0]
        if len(exact) > 1:
            return None
        scores = {}
        for t in self.schemas:
            props = set(self.properties(t))
            if self.required(t) <= given and given & props:
                scores[t] = len(given & props) - len(given - props)
        if not scores:
            return None
        best = max(scores.values())
        winners = [t for t, s in scores.items() if s == best]
        return winners[0] if best > 0 and len(winners) == 1 else None
