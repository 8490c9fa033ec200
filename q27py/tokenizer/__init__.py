"""Byte-level BPE tokenizer read from a Hugging Face tokenizer.json (pure Python).

    tok = Tokenizer.from_model_dir(model_dir)   # tokenizer.json or tokenizer.json.gz
    ids = tok.encode(text)                       # allow_special=False for untrusted text
    text = tok.decode(ids)
    dec = tok.new_decoder(); dec.feed(ids) ... dec.flush()   # streaming, whole characters only

Modules: unicode_classes / regex_translate (the pre-tokenizer regex in Python `re`),
pretokenize (normalizer + split + byte-level), bpe (merges), added_tokens (special-token
splitting), detokenize (incremental UTF-8), model_files (tokenizer / generation config files).
"""

from q27py.tokenizer.bpe_tokenizer import Tokenizer
from q27py.tokenizer.detokenize import IncrementalDecoder
from q27py.tokenizer.model_files import load_stop_ids

__all__ = ["Tokenizer", "IncrementalDecoder", "load_stop_ids"]
