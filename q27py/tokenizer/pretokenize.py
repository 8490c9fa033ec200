"""Normalizer and pre-tokenizer of a tokenizer.json, as plain functions of text.

Supported (what byte-level BPE tokenizers such as Qwen's and GPT-2's use):
  normalizer:    null, NFC / NFD / NFKC / NFKD, or a Sequence of those
  pre_tokenizer: Split(regex or string, behavior "Isolated") steps followed by ByteLevel,
                 or ByteLevel alone (with use_regex it splits with GPT-2's regex first)
Anything else raises TokenizerError naming the unsupported part.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable

from q27py.errors import TokenizerError
from q27py.tokenizer import nfc
from q27py.tokenizer.regex_translate import compile_split_regex

# The split regex ByteLevel applies when `use_regex` is true (GPT-2's).
GPT2_SPLIT_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

_UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")


def build_normalizer(spec: dict | None) -> Callable[[str], str]:
    if spec is None:
        return lambda text: text
    kind = spec.get("type")
    if kind == "NFC":
        # the reference's NFC from the package's tables: the same on every Python (tokenizer/nfc.py)
        return nfc.default()
    if kind in _UNICODE_FORMS:
        # NFD/NFKC/NFKD (no Qwen tokenizer uses them) follow this Python's unicodedata
        return lambda text: text if unicodedata.is_normalized(kind, text) else unicodedata.normalize(kind, text)
    if kind == "Sequence":
        steps = [build_normalizer(s) for s in spec.get("normalizers", [])]

        def normalize(text: str) -> str:
            for step in steps:
                text = step(text)
            return text

        return normalize
    supported = ", ".join(["null", *_UNICODE_FORMS, "Sequence"])
    raise TokenizerError(f"unsupported normalizer type {kind!r} (supported: {supported})")


class PreTokenizer:
    """Text -> pre-tokens, the units BPE works on (as text: the byte-level mapping comes after)."""

    def __init__(self, spec: dict | None):
        steps = _flatten(spec)
        if not steps or steps[-1].get("type") != "ByteLevel":
            raise TokenizerError(
                f"unsupported pre_tokenizer {spec!r}: byte-level BPE needs a ByteLevel pre-tokenizer as the last step"
            )
        byte_level = steps[-1]
        self._splits = [_split_regex(s) for s in steps[:-1]]
        if byte_level.get("use_regex", True):
            self._splits.append(compile_split_regex(GPT2_SPLIT_REGEX))
        self._add_prefix_space = bool(byte_level.get("add_prefix_space", False))
        if self._add_prefix_space and len(steps) > 1:
            raise TokenizerError("ByteLevel add_prefix_space after a Split step is not supported")

    def __call__(self, text: str) -> list[str]:
        if self._add_prefix_space and text and not text.startswith(" "):
            text = " " + text
        pieces = [text]
        for regex in self._splits:
            pieces = [p for piece in pieces for p in _split_isolated(regex, piece)]
        return [p for p in pieces if p]


def _flatten(spec: dict | None) -> list[dict]:
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        return [s for sub in spec.get("pretokenizers", []) for s in _flatten(sub)]
    return [spec]


def _split_regex(step: dict) -> re.Pattern[str]:
    if step.get("type") != "Split":
        raise TokenizerError(f"unsupported pre-tokenizer step {step.get('type')!r} (supported: Split, ByteLevel)")
    if step.get("behavior") != "Isolated" or step.get("invert", False):
        raise TokenizerError(
            f"unsupported Split behavior {step.get('behavior')!r} invert={step.get('invert')!r} "
            "(supported: Isolated, invert=false)"
        )
    pattern = step.get("pattern") or {}
    if "Regex" in pattern:
        return compile_split_regex(pattern["Regex"])
    if "String" in pattern:
        return re.compile(re.escape(pattern["String"]))
    raise TokenizerError(f"Split step without a Regex or String pattern: {step!r}")


def _split_isolated(regex: re.Pattern[str], text: str) -> list[str]:
    """Matches become pieces, and so does any unmatched text between them (empty ones dropped)."""
    if regex.groups == 0:
        pieces = regex.findall(text)
        # Matches come in order without overlap, so full coverage means there were no gaps.
        if sum(map(len, pieces)) == len(text):
            return pieces
    pieces = []
    pos = 0
    for m in regex.finditer(text):
        if m.start() > pos:
            pieces.append(text[pos : m.start()])
        pieces.append(m.group())
        pos = m.end()
    if pos < len(text):
        pieces.append(text[pos:])
    return pieces
