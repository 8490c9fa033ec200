"""The tokenizer's Unicode tables are the reference's (fixtures/tokenizers/unicode16), not the running
Python's `unicodedata`: classes, NFC, and the 600 golden encodings over the code points where they differ."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from q27py.tokenizer import Tokenizer
from q27py.tokenizer import nfc as nfc_module
from q27py.tokenizer.regex_translate import compile_split_regex

REPO = Path(__file__).resolve().parents[1]
FULL_VOCAB = REPO / "q27py" / "data" / "tokenizers" / "qwen36-full.tokenizer.json.gz"


@pytest.fixture(scope="module")
def u16(fixtures_dir) -> Path:
    return fixtures_dir / "tokenizers" / "unicode16"


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def full() -> Tokenizer:
    return Tokenizer.from_file(FULL_VOCAB)


def test_the_600_unicode16_golden_encodings(full, u16):
    cases = _jsonl(u16 / "golden_encodings.jsonl")
    assert len(cases) == 600
    bad = [c["text"] for c in cases if full.encode(c["text"], allow_special=False) != c["ids"]]
    assert not bad, f"{len(bad)} of 600 differ, e.g. {bad[0]!r}"


def test_nfc_reproduces_every_reference_case(u16):
    cases = _jsonl(u16 / "nfc_cases.jsonl")
    assert [nfc_module.nfc(c["text"]) for c in cases] == [c["nfc"] for c in cases]


@pytest.mark.parametrize("key, prop", [("\\p{L}", "L"), ("\\p{M}", "M"), ("\\p{N}", "N"), ("\\s", "s")])
def test_split_classes_are_the_reference_membership(u16, key, prop):
    ranges = json.loads((u16 / "classes.json").read_text(encoding="utf-8"))["classes"][key]
    member = bytearray(0x110000)
    for lo, hi in ranges:
        member[lo : hi + 1] = b"\x01" * (hi - lo + 1)
    regex = compile_split_regex("\\s" if prop == "s" else f"\\p{{{prop}}}")
    wrong = [cp for cp in range(0x110000) if not 0xD800 <= cp < 0xE000 and bool(regex.fullmatch(chr(cp))) != member[cp]]
    assert not wrong, f"{len(wrong)} code points classify differently, first U+{wrong[0]:04X}"


def test_encoding_never_consults_unicodedata(full, u16, monkeypatch):
    """Same ids whatever this Python's Unicode is: the encode path must not call unicodedata at all."""
    texts = [c["text"] for c in _jsonl(u16 / "golden_encodings.jsonl")[:50]] + ["e\u0301\u0323 Ångström \uac00\u11a8"]
    want = [full.encode(t, allow_special=False) for t in texts]

    class Refuse:
        def __getattr__(self, name):
            raise AssertionError(f"the tokenizer asked unicodedata.{name}")

    for name, module in list(sys.modules.items()):
        if name.startswith("q27py.tokenizer") and getattr(module, "unicodedata", None) is unicodedata:
            monkeypatch.setattr(module, "unicodedata", Refuse())
    fresh = Tokenizer.from_file(FULL_VOCAB)
    assert [fresh.encode(t, allow_special=False) for t in texts] == want


@pytest.mark.skipif(unicodedata.unidata_version != "14.0.0", reason="compares with Unicode 14.0 (Python 3.11)")
def test_nfc_equals_unicodedata_where_the_reference_agrees(u16):
    """Seeded property test: away from the 98 marks the reference treats as starters, the tables'
    NFC is exactly Python 3.11's (decomposition, reordering, composition, Hangul)."""
    starters = {ord(c) for case in _jsonl(u16 / "nfc_cases.jsonl") for c in case["text"]} - {0x61, 0x301, 0x334}
    assigned = [cp for cp in range(0x30000) if not 0xD800 <= cp < 0xE000 and unicodedata.category(chr(cp)) != "Cn"
                and cp not in starters]
    touchy = [cp for cp in assigned if unicodedata.combining(chr(cp)) or unicodedata.decomposition(chr(cp))]
    hangul = [*range(0x1100, 0x1200), *range(0xAC00, 0xAC60)]
    rng = random.Random(1234)
    for _ in range(20000):
        pool = rng.choice((assigned, touchy, touchy, hangul))
        s = "".join(chr(rng.choice(pool if rng.random() < 0.8 else assigned)) for _ in range(rng.randint(1, 10)))
        assert nfc_module.nfc(s) == unicodedata.normalize("NFC", s), [hex(ord(c)) for c in s]


@pytest.mark.skipif(unicodedata.unidata_version != "14.0.0", reason="the generator runs on Unicode 14.0 (Python 3.11)")
def test_committed_tables_are_what_the_generator_makes(u16):
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "gen_unicode_tables.py"), "--fixtures", str(u16),
                           "--check"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
