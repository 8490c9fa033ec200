"""The byte-level BPE tokenizer: golden encodings, the pre-tokenizer regex, BPE, special
tokens, decoding (one-shot and incremental), stop ids and load errors."""

from __future__ import annotations

import ast
import gzip
import json
import shutil
import time
import unicodedata
from pathlib import Path

import random
import sys

import pytest

from q27py.errors import ConfigError, TokenizerError
from q27py.tokenizer import IncrementalDecoder, Tokenizer, load_stop_ids
from q27py.tokenizer.bpe import BPE
from q27py.tokenizer.byte_level import BYTE_TO_CHAR, from_alphabet, to_alphabet
from q27py.tokenizer.regex_translate import compile_split_regex

REPO = Path(__file__).resolve().parents[1]
BUNDLED_MODEL = REPO / "q27py" / "data" / "models" / "q36-tiny-agent"
VOCABS = {
    "qwen36-first2048": "tokenizer.json",
    "qwen36-first16384": "tokenizer.json",
    "qwen36-full": "tokenizer.json.gz",
}
QWEN_SPLIT = json.loads((BUNDLED_MODEL / "tokenizer.json").read_text(encoding="utf-8"))["pre_tokenizer"][
    "pretokenizers"
][0]["pattern"]["Regex"]


# ----- fixtures -----


@pytest.fixture(scope="module")
def vocab_dirs(fixtures_dir) -> dict[str, Path]:
    return {name: fixtures_dir / "tokenizers" / name for name in VOCABS}


@pytest.fixture(scope="module")
def tokenizers(vocab_dirs) -> dict[str, Tokenizer]:
    return {name: Tokenizer.from_file(vocab_dirs[name] / VOCABS[name]) for name in VOCABS}


def _golden(vocab_dir: Path) -> list[dict]:
    with open(vocab_dir / "golden_encodings.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def bundled() -> Tokenizer:
    return Tokenizer.from_model_dir(BUNDLED_MODEL)


def _byte_level_spec(merges: list[list[str]], added: list[dict] | None = None, **model_extra) -> dict:
    """A minimal tokenizer.json: the 256 byte tokens, the given merges, Qwen's pre-tokenizer."""
    vocab = {BYTE_TO_CHAR[b]: b for b in range(256)}
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    return {
        "added_tokens": added or [],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN_SPLIT}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
            ],
        },
        "decoder": {"type": "ByteLevel"},
        "model": {"type": "BPE", "vocab": vocab, "merges": merges, "ignore_merges": True, **model_extra},
    }


def _added(token_id: int, content: str, special: bool = True, **flags) -> dict:
    return {"id": token_id, "content": content, "special": special, "normalized": False, **flags}


# ----- golden encodings (the reference tokenizers' answers) -----


@pytest.mark.parametrize("name", list(VOCABS))
def test_every_golden_text_encodes_exactly(name, tokenizers, vocab_dirs):
    tok = tokenizers[name]
    rows = _golden(vocab_dirs[name])
    assert len(rows) > 100
    mismatches = [(r["text"], tok.encode(r["text"]), r["ids"]) for r in rows if tok.encode(r["text"]) != r["ids"]]
    assert not mismatches, f"{len(mismatches)} of {len(rows)} differ; first: {mismatches[0]!r}"


@pytest.mark.parametrize("name", list(VOCABS))
def test_golden_ids_decode_to_the_normalized_text(name, tokenizers, vocab_dirs):
    tok = tokenizers[name]
    for row in _golden(vocab_dirs[name]):
        assert tok.decode(row["ids"]) == unicodedata.normalize("NFC", row["text"]), row["text"]


def test_bundled_model_tokenizer_matches_the_first16384_goldens(bundled, vocab_dirs):
    for row in _golden(vocab_dirs["qwen36-first16384"]):
        assert bundled.encode(row["text"]) == row["ids"], row["text"]


def test_vocabulary_accessors_agree_with_tokenizer_json(tokenizers, vocab_dirs):
    spec = json.loads((vocab_dirs["qwen36-first16384"] / "tokenizer.json").read_text(encoding="utf-8"))
    tok = tokenizers["qwen36-first16384"]
    added = spec["added_tokens"]
    assert tok.special_ids == {a["content"]: a["id"] for a in added if a["special"]}
    assert tok.vocab_size == max([*spec["model"]["vocab"].values(), *(a["id"] for a in added)]) + 1
    for token, token_id in list(spec["model"]["vocab"].items())[::500]:
        assert tok.token_to_id(token) == token_id
        assert tok.id_to_token(token_id) == token
    for a in added:
        assert tok.token_to_id(a["content"]) == a["id"]
        assert tok.id_to_token(a["id"]) == a["content"]
    assert tok.token_to_id("no such token \x00") is None
    assert tok.id_to_token(tok.vocab_size) is None


# ----- the pre-tokenizer regex -----


@pytest.fixture(scope="module")
def qwen_split():
    return compile_split_regex(QWEN_SPLIT)


@pytest.mark.parametrize(
    "text, pieces",
    [
        # contractions, case-insensitively, and only those seven
        ("I'm I'LL we've X'S", ["I", "'m", " I", "'LL", " we", "'ve", " X", "'S"]),
        ("don't you'd", ["don", "'t", " you", "'d"]),
        ("it'z", ["it", "'z"]),
        # numbers split into single digits, a leading space stays alone
        ("x 2024", ["x", " ", "2", "0", "2", "4"]),
        ("Ⅻ½", ["Ⅻ", "½"]),  # \p{N} includes letter-numbers and fractions
        # whitespace: the last space of a run joins the next word; trailing runs stay whole
        ("a   b", ["a", "  ", " b"]),
        ("a \t b  ", ["a", " \t", " b", "  "]),
        # newline runs take the whitespace before them; punctuation takes trailing newlines
        ("a  \n\n  b", ["a", "  \n\n", " ", " b"]),
        ("x):\n\ty", ["x", "):\n", "\ty"]),
        ("\r\n\r\n", ["\r\n\r\n"]),
        # a non-letter, non-newline char may prefix a word; letters carry their combining marks
        ("$var @x", ["$var", " @", "x"]),
        ("e\u0301e\u0308", ["e\u0301e\u0308"]),
        ("\u0301x", ["\u0301x"]),
        ("中文，字", ["中文", "，字"]),
        ("😀😀 ok", ["😀😀", " ok"]),
        # U+001C..U+001F are not Unicode White_Space (str.isspace() says they are)
        ("a\x1c\x1fb", ["a", "\x1c\x1f", "b"]),
        ("a\x1c b", ["a", "\x1c", " b"]),
        ("a\u3000b\u00a0c", ["a", "\u3000b", "\u00a0c"]),
    ],
)
def test_split_regex_pieces(qwen_split, text, pieces):
    assert qwen_split.findall(text) == pieces


def test_split_regex_covers_every_character(qwen_split):
    text = "".join(chr(c) for c in range(0x20000) if not 0xD800 <= c < 0xE000)
    assert "".join(qwen_split.findall(text)) == text


# \p{L}, \p{M}, \p{N} and \s are the reference's own tables (tests/test_tokenizer_unicode16.py);
# categories no Qwen tokenizer uses still follow this Python's unicodedata.
@pytest.mark.parametrize("prop, categories", [("Lu", "Lu"), ("Nd", "Nd")])
def test_other_unicode_categories_follow_unicodedata(prop, categories):
    regex = compile_split_regex(rf"\p{{{prop}}}")
    for cp in range(0, 0x32000):
        c = chr(cp)
        assert bool(regex.fullmatch(c)) == unicodedata.category(c).startswith(categories), hex(cp)


def test_whitespace_class_is_unicode_white_space():
    regex = compile_split_regex(r"\s")
    white = {chr(c) for c in range(0x3001) if regex.fullmatch(chr(c))}
    # The White_Space property (PropList.txt) -- not str.isspace(), which adds U+001C..U+001F.
    expected = {chr(c) for c in [*range(9, 14), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
                                 0x202F, 0x205F, 0x3000]}
    assert white == expected
    assert compile_split_regex(r"\S+").fullmatch("\x1c\x1d\x1e\x1f")


@pytest.mark.parametrize("pattern", [r"\d+", r"\w", r"\bx", r"[\S]", r"\p{Greek}", r"[\P{L}]", "[ab"])
def test_unsupported_regex_constructs_are_refused(pattern):
    with pytest.raises(TokenizerError):
        compile_split_regex(pattern)


# ----- BPE -----


def _naive_bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """The textbook loop: merge the lowest-ranked adjacent pair (leftmost on ties) until none is left."""
    symbols = list(symbols)
    while True:
        candidates = [(ranks[p], i) for i, p in enumerate(zip(symbols, symbols[1:])) if p in ranks]
        if not candidates:
            return symbols
        _, i = min(candidates)
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]


@pytest.fixture(scope="module")
def small_bpe(vocab_dirs) -> BPE:
    spec = json.loads((vocab_dirs["qwen36-first2048"] / "tokenizer.json").read_text(encoding="utf-8"))
    ranks = {tuple(m): r for r, m in enumerate(spec["model"]["merges"])}
    return BPE(spec["model"]["vocab"], ranks, ignore_merges=False)


def _random_text(rng: random.Random, max_size: int) -> str:
    """Any code point but surrogates, biased towards ASCII, combining marks, CJK and emoji."""
    out = []
    for _ in range(rng.randint(0, max_size)):
        pick = rng.random()
        if pick < 0.5:
            c = chr(rng.randint(0x20, 0x7E))
        elif pick < 0.6:
            c = rng.choice("\n\t\r \u00a0\u3000")
        elif pick < 0.7:
            c = chr(rng.randint(0x300, 0x36F))
        elif pick < 0.8:
            c = chr(rng.randint(0x4E00, 0x9FFF))
        elif pick < 0.9:
            c = chr(rng.randint(0x1F300, 0x1FAFF))
        else:
            c = chr(rng.randint(0, sys.maxunicode))
            if 0xD800 <= ord(c) <= 0xDFFF:
                c = "x"
        out.append(c)
    return "".join(out)


def test_heap_bpe_equals_the_textbook_loop(small_bpe):
    rng = random.Random(0)
    for _ in range(300):
        text = "".join(rng.choice(" \nabcdeinorst_=(") for _ in range(rng.randint(0, 60)))
        word = to_alphabet(text)
        assert small_bpe.merge(list(word)) == _naive_bpe(list(word), small_bpe.merge_ranks), text


def test_bpe_merges_by_rank_not_by_position():
    # "abc": (b, c) has the lower rank, so it wins although (a, b) comes first.
    tok = Tokenizer(_byte_level_spec([["b", "c"], ["a", "b"], ["a", "bc"]], ignore_merges=False))
    assert tok.encode("abc") == [tok.token_to_id("abc")]
    assert tok.encode("abd") == [tok.token_to_id("ab"), tok.token_to_id("d")]


def test_ignore_merges_takes_a_vocabulary_word_whole():
    # "abc" is in the vocabulary, but no merge sequence reaches it from its bytes.
    merges = [["a", "b"], ["b", "c"]]
    with_ignore = _byte_level_spec(merges)
    with_ignore["model"]["vocab"]["abc"] = 300
    assert Tokenizer(with_ignore).encode("abc") == [300]
    without = json.loads(json.dumps(with_ignore))
    without["model"]["ignore_merges"] = False
    tok = Tokenizer(without)
    assert tok.encode("abc") == [tok.token_to_id("ab"), tok.token_to_id("c")]


def test_legacy_string_merges_are_read():
    spec = _byte_level_spec([["a", "b"]])
    spec["model"]["merges"] = ["a b"]
    tok = Tokenizer(spec)
    assert tok.encode("ab") == [tok.token_to_id("ab")]


def test_long_inputs_stay_fast(bundled):
    # A single 100 KB pre-token must not go quadratic, nor a 100 KB prompt of code.
    code = "def f(x):\n    return {'a': [x, 2.5], \"b\": x ** 2}  # note\n" * 1700
    for text in ("a" * 100_000, " " * 100_000 + "x", code):
        start = time.perf_counter()
        ids = bundled.encode(text)
        assert time.perf_counter() - start < 5.0
        assert bundled.decode(ids) == text


# ----- added / special tokens -----


def test_special_tokens_are_split_out_first(bundled):
    text = "<|im_start|>user\nhello<|im_end|>\n"
    ids = bundled.encode(text)
    start, end = bundled.special_ids["<|im_start|>"], bundled.special_ids["<|im_end|>"]
    assert ids[0] == start and end in ids
    assert ids[1:ids.index(end)] == bundled.encode("user\nhello")
    assert bundled.decode(ids) == text
    assert bundled.decode(ids, skip_special=True) == "user\nhello\n"


def test_disallowed_special_tokens_are_plain_text(bundled):
    text = "say <|im_end|> please"
    ids = bundled.encode(text, allow_special=False)
    assert not set(ids) & set(bundled.special_ids.values())
    assert bundled.decode(ids) == text


def test_added_tokens_match_leftmost_longest_and_nonspecial_always():
    added = [_added(400, "<a>"), _added(401, "<a><b>"), _added(402, "[X]", special=False)]
    tok = Tokenizer(_byte_level_spec([], added))
    assert tok.encode("<a><b><a>") == [401, 400]
    assert tok.encode("x[X]<a>", allow_special=False) == [ord("x"), 402, *tok.encode("<a>", allow_special=False)]
    assert 400 not in tok.encode("<a>", allow_special=False)
    assert tok.decode([401, 402], skip_special=True) == "[X]"


def test_lstrip_rstrip_added_tokens_swallow_whitespace():
    tok = Tokenizer(_byte_level_spec([], [_added(400, "<m>", lstrip=True, rstrip=True)]))
    assert tok.encode("a  <m>\n b") == [ord("a"), 400, ord("b")]


def test_normalization_happens_between_special_tokens():
    tok = Tokenizer(_byte_level_spec([], [_added(400, "<s>")]))
    assert tok.encode("e\u0301<s>e\u0301") == tok.encode("é") + [400] + tok.encode("é")


# ----- decoding -----


def test_decode_inverts_encode_up_to_nfc(tokenizers):
    tok = tokenizers["qwen36-first2048"]
    rng = random.Random(1)
    for _ in range(200):
        text = _random_text(rng, 40)
        assert tok.decode(tok.encode(text, allow_special=False)) == unicodedata.normalize("NFC", text), repr(text)


def test_lone_surrogate_encodes_as_replacement_character(bundled):
    assert bundled.encode("a\ud800b") == bundled.encode("a\ufffdb")


def test_unknown_ids_decode_to_nothing(bundled):
    assert bundled.decode([bundled.token_to_id("a"), bundled.vocab_size + 5]) == "a"


def test_byte_alphabet_round_trips_all_bytes():
    data = bytes(range(256))
    alphabet = "".join(BYTE_TO_CHAR[b] for b in data)
    assert len(set(alphabet)) == 256 and all(c.isprintable() and not c.isspace() for c in alphabet)
    assert from_alphabet(alphabet) == data
    assert from_alphabet(to_alphabet("é 😀\n")) == "é 😀\n".encode()
    assert to_alphabet(" \n") == "ĠĊ"


def test_incremental_decoder_holds_back_split_characters(tokenizers):
    tok = tokenizers["qwen36-first2048"]
    text = "ok 😀 中文 👍🏽 é!"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # the small vocabulary splits these characters across tokens
    dec = tok.new_decoder()
    pieces = [dec.feed([i]) for i in ids]
    assert "" in pieces  # some token ended mid-character and was held back
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + dec.flush() == tok.decode(ids) == text


def test_incremental_output_equals_one_shot_decode(tokenizers):
    tok = tokenizers["qwen36-first2048"]
    rng = random.Random(2)
    for _ in range(300):
        # Arbitrary ids: byte tokens (0..255 are single bytes, often invalid UTF-8), merges, specials.
        ids = [rng.randint(0, tok.vocab_size + 2) for _ in range(rng.randint(0, 30))]
        cuts = sorted(rng.randint(0, len(ids)) for _ in range(rng.randint(0, 6)))
        skip = rng.random() < 0.5
        dec = tok.new_decoder(skip_special=skip)
        out, prev = [], 0
        for cut in [*cuts, len(ids)]:
            out.append(dec.feed(ids[prev:cut]))
            prev = cut
        out.append(dec.flush())
        assert "".join(out) == tok.decode(ids, skip_special=skip), ids


def test_incremental_decoder_flush_reports_an_unfinished_character():
    dec = IncrementalDecoder(lambda i: bytes([i]))
    assert dec.feed([0xF0, 0x9F]) == ""
    assert dec.pending_bytes == 2
    assert dec.flush() == "\ufffd"
    assert dec.feed(0x41) == "A"


# ----- stop ids and model directories -----


def test_eos_ids_come_from_generation_config_in_a_model_dir(bundled):
    gen = json.loads((BUNDLED_MODEL / "generation_config.json").read_text())
    expected = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    assert bundled.eos_ids == expected == load_stop_ids(BUNDLED_MODEL)


def test_eos_ids_fall_back_to_tokenizer_config(tokenizers, vocab_dirs):
    for name, tok in tokenizers.items():
        eos = json.loads((vocab_dirs[name] / "tokenizer_config.json").read_text())["eos_token"]
        assert tok.eos_ids == [tok.special_ids[eos]]


def test_model_dir_with_gzipped_tokenizer(tmp_path, vocab_dirs):
    src = vocab_dirs["qwen36-first2048"]
    (tmp_path / "tokenizer.json.gz").write_bytes(gzip.compress((src / "tokenizer.json").read_bytes()))
    shutil.copy(src / "tokenizer_config.json", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2049}))
    tok = Tokenizer.from_model_dir(tmp_path)
    assert tok.eos_ids == [2049]
    row = _golden(src)[5]
    assert tok.encode(row["text"]) == row["ids"]


@pytest.mark.parametrize("value, expected", [(7, [7]), ([3, 1, 3], [3, 1]), (None, [])])
def test_load_stop_ids(tmp_path, value, expected):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    assert load_stop_ids(tmp_path) == expected


def test_load_stop_ids_without_a_generation_config(tmp_path):
    assert load_stop_ids(tmp_path) == []


def test_load_stop_ids_rejects_a_bad_value(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "<|im_end|>"}))
    with pytest.raises(ConfigError, match="eos_token_id"):
        load_stop_ids(tmp_path)


# ----- bad input -----


def _write(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return path


def test_unsupported_model_type_is_a_clear_error(tmp_path):
    spec = _byte_level_spec([])
    spec["model"] = {"type": "WordPiece", "vocab": {"a": 0}}
    with pytest.raises(TokenizerError, match="unsupported tokenizer model type 'WordPiece'"):
        Tokenizer.from_file(_write(tmp_path, spec))


@pytest.mark.parametrize(
    "section, value, message",
    [
        ("normalizer", {"type": "Lowercase"}, "normalizer type 'Lowercase'"),
        ("pre_tokenizer", {"type": "Whitespace"}, "ByteLevel"),
        ("pre_tokenizer", {"type": "Sequence", "pretokenizers": [{"type": "Digits"}, {"type": "ByteLevel"}]}, "Digits"),
        ("decoder", {"type": "WordPiece"}, "decoder type 'WordPiece'"),
        ("model", {"type": "BPE", "vocab": {"a": 0}, "merges": [], "dropout": 0.1}, "dropout"),
        ("model", {"type": "BPE", "vocab": {}, "merges": []}, "vocab"),
        ("model", {"type": "BPE", "vocab": {"a": 0}, "merges": [["a"]]}, "merges"),
        ("added_tokens", [{"id": 5, "content": "x", "single_word": True}], "single_word"),
    ],
)
def test_unsupported_sections_are_clear_errors(tmp_path, section, value, message):
    spec = _byte_level_spec([])
    spec[section] = value
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_file(_write(tmp_path, spec))


def test_unreadable_files_are_clear_errors(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.from_file(tmp_path / "missing.json")
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        Tokenizer.from_file(tmp_path / "tokenizer.json")
    (tmp_path / "broken.json.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(TokenizerError, match="cannot read"):
        Tokenizer.from_file(tmp_path / "broken.json.gz")


def test_no_forbidden_imports():
    # The design card bans these (and any framework); Python's `re` + unicodedata must do.
    banned = {"regex", "tokenizers", "transformers", "torch", "jinja2", "tiktoken"}
    files = [*(REPO / "q27py" / "tokenizer").glob("*.py"), REPO / "tools" / "tokenizer_speed.py", Path(__file__)]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not {n.split(".")[0] for n in names} & banned, f"{path.name} imports {names}"
