"""Tiny random checkpoints in the exact Hugging Face layout, made with numpy.

Used by tests and by `q27py make-tiny`. The tokenizer comes from the real
Qwen3.6 vocabulary shipped in q27py/data/tokenizers: a prefix of a BPE ranking
is itself a complete byte-level BPE, so `first2048` / `first16384` keep the first
N ranks, the merges among them, and the 33 special tokens renumbered from N
(exactly how the fixture tokenizers were made; a test checks it).
"""

from __future__ import annotations

import functools
import gzip
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from q27py import PACKAGE_DIR
from q27py.model.checkpoint import expected_shapes
from q27py.io.safetensors import write_safetensors
from q27py.model.config import FULL, LINEAR, ModelConfig

FULL_TOKENIZER = PACKAGE_DIR / "data" / "tokenizers" / "qwen36-full.tokenizer.json.gz"
VOCABS = {"first2048": 2048, "first16384": 16384, "full": None}
TOKENIZER_CONFIG = {
    "tokenizer_class": "Qwen2Tokenizer",
    "model_max_length": 262144,
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "bos_token": None,
    "unk_token": None,
    "add_bos_token": False,
    "errors": "replace",
    "split_special_tokens": False,
}


@functools.lru_cache(maxsize=1)
def load_full_tokenizer_json() -> dict:
    """The real 248K-rank tokenizer.json (cached: treat the result as read-only)."""
    with gzip.open(FULL_TOKENIZER, "rt", encoding="utf-8") as f:
        return json.load(f)


def prefix_tokenizer_json(full: dict, n_ranks: int | None) -> dict:
    """The tokenizer.json of the first n_ranks BPE ranks (+ specials renumbered from n_ranks)."""
    if n_ranks is None:
        return full
    model = full["model"]
    vocab = {tok: i for tok, i in model["vocab"].items() if i < n_ranks}
    merges = [m for m in model["merges"] if m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]
    base = len(model["vocab"])
    added = [dict(t, id=t["id"] - base + n_ranks) for t in full["added_tokens"]]
    return dict(full, model=dict(model, vocab=vocab, merges=merges), added_tokens=added)


def tiny_config(vocab_size: int, eos_ids: tuple[int, ...], **overrides) -> ModelConfig:
    """A 4-layer (3 GDN + 1 attention) model with GQA, GVA and dk != dv: every code path in miniature."""
    base = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        layer_types=(LINEAR, LINEAR, LINEAR, FULL),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
        mtp_num_hidden_layers=1,
        eos_token_ids=eos_ids,
    )
    return replace(base, **overrides)


def random_weights(cfg: ModelConfig, seed: int, with_mtp: bool = True) -> dict[str, np.ndarray]:
    """Seeded random weights with the statistics of a real checkpoint's conventions.

    Zero-centred norms get N(0, 0.1) so the (1 + w) convention is exercised; the GDN
    output norm is a plain weight around 1; A_log and dt_bias give decays in a sane range.
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_shapes(cfg, with_mtp=with_mtp).items():
        if name.endswith("linear_attn.norm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith("norm.weight") or "norm_embedding" in name or "norm_hidden" in name:
            w = 0.1 * rng.standard_normal(shape)
        elif name.endswith("A_log"):
            w = np.log(rng.uniform(1.0, 16.0, shape))
        elif name.endswith("dt_bias"):
            w = rng.uniform(-1.0, 1.0, shape)
        elif name.endswith("conv1d.weight"):
            w = rng.standard_normal(shape) / np.sqrt(shape[-1])
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = w.astype(np.float32)
    return out


def write_checkpoint(out_dir: Path, cfg: ModelConfig, weights: dict[str, np.ndarray], tokenizer_json: dict | None,
                     layout: str = "text", shards: int = 2) -> None:
    """bf16 safetensors in `shards` files + index, config.json, generation_config.json, tokenizer files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = "model.language_model." if layout == "multimodal" else "model."

    def stored(name: str) -> str:
        return name if name.startswith(("lm_head.", "mtp.")) else prefix + name

    names = sorted(weights)
    per = -(-len(names) // shards)
    weight_map = {}
    total = 0
    for s in range(shards):
        fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {stored(n): weights[n] for n in names[s * per : (s + 1) * per]}
        write_safetensors(out_dir / fn, part, dtype="BF16", metadata={"format": "pt"})
        weight_map.update({n: fn for n in part})
        total += sum(a.size * 2 for a in part.values())
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    hf = cfg.to_hf_dict()
    if layout == "multimodal":
        hf = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": hf, "tie_word_embeddings": cfg.tie_word_embeddings}
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": list(cfg.eos_token_ids), "pad_token_id": cfg.eos_token_ids[-1] if cfg.eos_token_ids else None, "do_sample": False}, indent=2))
    if tokenizer_json is not None:
        (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False))
        (out_dir / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))


def make_tiny(out_dir: Path, vocab: str = "first2048", seed: int = 0, layout: str = "text", **overrides) -> ModelConfig:
    if vocab not in VOCABS:
        raise ValueError(f"vocab must be one of {sorted(VOCABS)}")
    tok = prefix_tokenizer_json(load_full_tokenizer_json(), VOCABS[vocab])
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    n_ids = max(max(tok["model"]["vocab"].values()), max(specials.values())) + 1
    vocab_size = -(-n_ids // 64) * 64  # pad like the real config does
    cfg = tiny_config(vocab_size, (specials["<|im_end|>"], specials["<|endoftext|>"]), **overrides)
    write_checkpoint(out_dir, cfg, random_weights(cfg, seed), tok, layout=layout)
    return cfg
