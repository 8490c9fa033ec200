"""`q27py make-tiny OUT_DIR`: a tiny random checkpoint in the exact Hugging Face layout."""

from __future__ import annotations

from pathlib import Path

from q27py.model.tiny import VOCABS, make_tiny


def add_arguments(p) -> None:
    p.add_argument("out_dir", type=Path)
    p.add_argument("--vocab", choices=sorted(VOCABS), default="first2048", help="tokenizer: a prefix of the real Qwen3.6 BPE, or the full 248K one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", choices=["text", "multimodal"], default="text", help="text-only names (model.*) or the released layout (model.language_model.*)")
    p.add_argument("--tied", action="store_true", help="tie lm_head to the embedding")


def run(args) -> int:
    cfg = make_tiny(args.out_dir, vocab=args.vocab, seed=args.seed, layout=args.layout, tie_word_embeddings=args.tied)
    print(f"wrote {args.out_dir}: vocab {cfg.vocab_size}, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, MTP head")
    return 0
