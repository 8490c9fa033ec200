"""The Tokenizer: a Hugging Face byte-level BPE tokenizer.json, encode and decode.

Encoding follows the `tokenizers` pipeline: cut out added tokens (special ones only when
allowed), NFC-normalize the text between them, split it with the pre-tokenizer regex, map
each piece's UTF-8 bytes to the byte-level alphabet, and run BPE on each piece.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from q27py.errors import TokenizerError
from q27py.tokenizer.added_tokens import AddedToken, AddedTokenSplitter
from q27py.tokenizer.bpe import BPE
from q27py.tokenizer.byte_level import from_alphabet, to_alphabet
from q27py.tokenizer.detokenize import IncrementalDecoder
from q27py.tokenizer.model_files import config_eos_token, find_tokenizer_file, gc_paused, load_stop_ids, read_json
from q27py.tokenizer.pretokenize import PreTokenizer, build_normalizer

# Pre-tokens repeat heavily (identifiers, keywords, indentation), so their ids are cached.
# Past this many distinct ones the cache is dropped and refilled, bounding memory on huge inputs.
_WORD_CACHE_LIMIT = 200_000


class Tokenizer:
    def __init__(self, spec: dict, *, source: str = "tokenizer.json"):
        """Build from the parsed tokenizer.json object; `source` names it in error messages."""
        model = spec.get("model")
        if not isinstance(model, dict):
            raise TokenizerError(f"{source}: no 'model' section")
        if model.get("type", "BPE") != "BPE":
            raise TokenizerError(
                f"{source}: unsupported tokenizer model type {model.get('type')!r}; only byte-level BPE is supported"
            )
        for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
            if model.get(key):
                raise TokenizerError(f"{source}: BPE option {key}={model[key]!r} is not supported")
        vocab = model.get("vocab")
        if not isinstance(vocab, dict) or not vocab:
            raise TokenizerError(f"{source}: model.vocab must be a non-empty object")
        decoder = spec.get("decoder")
        if decoder is not None and decoder.get("type") != "ByteLevel":
            raise TokenizerError(f"{source}: unsupported decoder type {decoder.get('type')!r} (supported: ByteLevel)")

        self._normalize = build_normalizer(spec.get("normalizer"))
        self._pre_tokenize = PreTokenizer(spec.get("pre_tokenizer"))
        with gc_paused():
            merges = _merge_ranks(model.get("merges", []), source)
        self._bpe = BPE(vocab, merges, ignore_merges=bool(model.get("ignore_merges", False)))

        added = [AddedToken.from_json(e) for e in spec.get("added_tokens") or []]
        self.special_ids: dict[str, int] = {t.content: t.id for t in added if t.special}
        self._special_id_set = frozenset(self.special_ids.values())
        self._added_by_id = {t.id: t for t in added}
        self._added_by_content = {t.content: t.id for t in added}
        self._vocab = vocab
        self._id_to_token: dict[int, str] | None = None  # built on first use (248K entries)
        self._bytes_cache: dict[int, bytes] = {}
        self._word_cache: dict[str, list[int]] = {}
        self.vocab_size: int = max(max(vocab.values()), max(self._added_by_id, default=-1)) + 1

        # Tokens with normalized=false are matched in the raw text, the others after
        # normalization; special tokens take part only when the caller allows them.
        raw = [t for t in added if not t.normalized]
        normed = [AddedToken(t.id, self._normalize(t.content), t.special, True, t.lstrip, t.rstrip)
                  for t in added if t.normalized]
        self._raw_splitters = {
            True: AddedTokenSplitter(raw),
            False: AddedTokenSplitter([t for t in raw if not t.special]),
        }
        self._normalized_splitters = {
            True: AddedTokenSplitter(normed),
            False: AddedTokenSplitter([t for t in normed if not t.special]),
        }
        self.eos_ids: list[int] = []

    # ----- loading -----

    @classmethod
    def from_file(cls, path: str | Path) -> "Tokenizer":
        """Load tokenizer.json or tokenizer.json.gz; eos_ids from tokenizer_config.json beside it."""
        path = Path(path)
        tok = cls(read_json(path), source=str(path))
        eos = config_eos_token(path)
        eos_id = tok.token_to_id(eos) if eos is not None else None
        tok.eos_ids = [eos_id] if eos_id is not None else []
        return tok

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Load a model directory's tokenizer; eos_ids from generation_config.json when it has them."""
        tok = cls.from_file(find_tokenizer_file(model_dir))
        stop_ids = load_stop_ids(model_dir)
        if stop_ids:
            tok.eos_ids = stop_ids
        return tok

    # ----- encoding -----

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Token ids for text. With allow_special=False, special-token strings in the text are
        encoded as ordinary text (use for untrusted input); non-special added tokens still match."""
        ids: list[int] = []
        cache = self._word_cache
        for part in self._raw_splitters[allow_special].split(text):
            if isinstance(part, int):
                ids.append(part)
                continue
            for piece in self._normalized_splitters[allow_special].split(self._normalize(part)):
                if isinstance(piece, int):
                    ids.append(piece)
                    continue
                for word in self._pre_tokenize(piece):
                    word_ids = cache.get(word)
                    if word_ids is None:
                        word_ids = self._encode_word(word)
                    ids.extend(word_ids)
        return ids

    def _encode_word(self, word: str) -> list[int]:
        word_ids = self._bpe.encode_word(to_alphabet(word))
        if len(self._word_cache) >= _WORD_CACHE_LIMIT:
            self._word_cache.clear()
        self._word_cache[word] = word_ids
        return word_ids

    # ----- decoding -----

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (b"" for an id outside the vocabulary, as HF skips those)."""
        data = self._bytes_cache.get(token_id)
        if data is None:
            added = self._added_by_id.get(token_id)
            if added is not None:
                data = added.content.encode("utf-8")
            else:
                token = self.id_to_token(token_id)
                if token is None:
                    data = b""
                else:
                    try:
                        data = from_alphabet(token)
                    except KeyError:  # not a byte-level string: HF's decoder keeps such a token as is
                        data = token.encode("utf-8")
            self._bytes_cache[token_id] = data
        return data

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        if skip_special:
            ids = [i for i in ids if i not in self._special_id_set]
        return b"".join(self.token_bytes(i) for i in ids).decode("utf-8", errors="replace")

    def new_decoder(self, skip_special: bool = False) -> IncrementalDecoder:
        """A streaming decoder whose pieces never split a UTF-8 character."""
        if not skip_special:
            return IncrementalDecoder(self.token_bytes)
        specials = self._special_id_set
        return IncrementalDecoder(lambda i: b"" if i in specials else self.token_bytes(i))

    # ----- vocabulary -----

    def token_to_id(self, token: str) -> int | None:
        added = self._added_by_content.get(token)
        return added if added is not None else self._vocab.get(token)

    def id_to_token(self, token_id: int) -> str | None:
        added = self._added_by_id.get(token_id)
        if added is not None:
            return added.content
        if self._id_to_token is None:
            self._id_to_token = {i: t for t, i in self._vocab.items()}
        return self._id_to_token.get(token_id)


def _merge_ranks(merges: list, source: str) -> dict[tuple[str, str], int]:
    """{(left, right): rank}; merges come as [left, right] pairs or "left right" strings."""
    if not isinstance(merges, list):
        raise TokenizerError(f"{source}: model.merges must be a list")
    try:
        if merges and isinstance(merges[0], str):
            # Legacy form; byte-level symbols never contain a space, so the split is unambiguous.
            return {tuple(m.split(" ", 1)): rank for rank, m in enumerate(merges)}
        if merges and not all(isinstance(m, list) and len(m) == 2 for m in (merges[0], merges[-1])):
            raise ValueError("each merge must be a [left, right] pair or a 'left right' string")
        return dict(zip(map(tuple, merges), range(len(merges))))
    except (TypeError, ValueError) as exc:
        raise TokenizerError(f"{source}: malformed model.merges: {exc}") from None
