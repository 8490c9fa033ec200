"""A Hugging Face checkpoint directory: config + (sharded) safetensors, under canonical names.

Canonical names drop the text-model prefix of either layout:
  model.language_model.layers.0.mlp.up_proj.weight  (released multimodal layout)
  model.layers.0.mlp.up_proj.weight                 (text-only layout)
both become `layers.0.mlp.up_proj.weight`. `lm_head.weight` and `mtp.*` keep
their names; `model.visual.*` is ignored. Before anything is used, the whole
manifest is checked against the shapes the config implies: a missing,
unexpected or misshaped tensor is an error naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from q27py.errors import CheckpointError
from q27py.io.safetensors import SafetensorsFile
from q27py.model.config import FULL, ModelConfig

TEXT_PREFIXES = ("model.language_model.", "model.")
IGNORED_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")


def canonical_name(stored: str) -> str | None:
    """Stored tensor name -> canonical name, or None for tensors we ignore."""
    if stored.startswith(IGNORED_PREFIXES):
        return None
    for prefix in TEXT_PREFIXES:
        if stored.startswith(prefix):
            return stored[len(prefix):]
    return stored


def _attention_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    h, hd, nq, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    return {
        f"{prefix}self_attn.q_proj.weight": (2 * nq * hd, h),  # per head: [q rows | gate rows]
        f"{prefix}self_attn.k_proj.weight": (nkv * hd, h),
        f"{prefix}self_attn.v_proj.weight": (nkv * hd, h),
        f"{prefix}self_attn.o_proj.weight": (h, nq * hd),
        f"{prefix}self_attn.q_norm.weight": (hd,),
        f"{prefix}self_attn.k_norm.weight": (hd,),
    }


def _block_common_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    h, f = cfg.hidden_size, cfg.intermediate_size
    return {
        f"{prefix}input_layernorm.weight": (h,),
        f"{prefix}post_attention_layernorm.weight": (h,),
        f"{prefix}mlp.gate_proj.weight": (f, h),
        f"{prefix}mlp.up_proj.weight": (f, h),
        f"{prefix}mlp.down_proj.weight": (h, f),
    }


def expected_shapes(cfg: ModelConfig, with_mtp: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor the config implies, canonical name -> shape."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, h), "norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        shapes.update(_block_common_shapes(cfg, p))
        if kind == FULL:
            shapes.update(_attention_shapes(cfg, p))
        else:
            a = p + "linear_attn."
            shapes.update({
                a + "in_proj_qkv.weight": (cfg.gdn_conv_dim, h),
                a + "in_proj_z.weight": (hv * dv, h),
                a + "in_proj_b.weight": (hv, h),
                a + "in_proj_a.weight": (hv, h),
                a + "conv1d.weight": (cfg.gdn_conv_dim, 1, cfg.linear_conv_kernel_dim),
                a + "A_log": (hv,),
                a + "dt_bias": (hv,),
                a + "norm.weight": (dv,),
                a + "out_proj.weight": (h, hv * dv),
            })
    if with_mtp:
        shapes.update({
            "mtp.fc.weight": (h, 2 * h),
            "mtp.pre_fc_norm_embedding.weight": (h,),
            "mtp.pre_fc_norm_hidden.weight": (h,),
            "mtp.norm.weight": (h,),
        })
        shapes.update(_block_common_shapes(cfg, "mtp.layers.0."))
        shapes.update(_attention_shapes(cfg, "mtp.layers.0."))
    return shapes


def _is_q27(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(7) == b"Q27PACK"  # every .q27 layout generation (q27py/io/q27file.py)
    except OSError:
        return False


class Checkpoint:
    """Tensors of one model, by canonical name, memory-mapped and converted one at a time."""

    def __init__(self, model_dir: Path, config: ModelConfig, files: dict[str, SafetensorsFile], where: dict[str, tuple[str, str]]):
        self.model_dir = model_dir
        self.config = config
        self._files = files
        self._where = where  # canonical name -> (file name, stored name)

    @classmethod
    def open(cls, model_dir: str | Path, config: ModelConfig | None = None) -> "Checkpoint":
        model_dir = Path(model_dir)
        if model_dir.is_file() and _is_q27(model_dir):
            # the CPU path reads Hugging Face checkpoints only; say so rather than "not a directory"
            raise CheckpointError(f"{model_dir} is a repacked .q27 file: .q27 files need --device cuda "
                                  "(on the CPU, pass the checkpoint directory it was repacked from)")
        if not model_dir.is_dir():
            raise CheckpointError(f"{model_dir}: not a directory")
        config = config or ModelConfig.from_model_dir(model_dir)
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: unreadable index ({exc})") from None
            file_names = sorted(set(weight_map.values()))
        else:
            file_names = sorted(p.name for p in model_dir.glob("*.safetensors"))
            if not file_names:
                raise CheckpointError(f"{model_dir}: no model.safetensors.index.json and no *.safetensors files")
            weight_map = None
        files = {}
        for fn in file_names:
            if not (model_dir / fn).exists():
                raise CheckpointError(f"{model_dir / fn}: shard named in the index is missing")
            files[fn] = SafetensorsFile(model_dir / fn)
        where: dict[str, tuple[str, str]] = {}
        for fn, f in files.items():
            for stored in f.tensors:
                if weight_map is not None and weight_map.get(stored) != fn:
                    if stored in weight_map:
                        continue  # the index points elsewhere; trust the index
                    raise CheckpointError(f"{model_dir / fn}: tensor '{stored}' is not listed in the index")
                canon = canonical_name(stored)
                if canon is None:
                    continue
                if canon in where:
                    raise CheckpointError(f"{model_dir}: tensor '{canon}' appears twice ({where[canon][1]} and {stored})")
                where[canon] = (fn, stored)
        if weight_map is not None:
            for stored, fn in weight_map.items():
                canon = canonical_name(stored)
                if canon is not None and stored not in files[fn].tensors:
                    raise CheckpointError(f"{model_dir / fn}: tensor '{stored}' listed in the index is missing from the shard")
        ckpt = cls(model_dir, config, files, where)
        ckpt.validate()
        return ckpt

    @property
    def has_mtp(self) -> bool:
        return self.config.mtp_num_hidden_layers > 0 and any(n.startswith("mtp.") for n in self._where)

    def validate(self) -> None:
        """The manifest must be exactly what the config implies (MTP optional, lm_head absent when tied)."""
        has_mtp = any(n.startswith("mtp.") for n in self._where)
        expected = expected_shapes(self.config, with_mtp=has_mtp)
        for name, shape in expected.items():
            if name not in self._where:
                raise CheckpointError(f"{self.model_dir}: missing tensor '{name}' (expected shape {list(shape)})")
            fn, stored = self._where[name]
            got = self._files[fn].tensors[stored].shape
            if tuple(got) != shape:
                raise CheckpointError(f"{self.model_dir}: tensor '{stored}' has shape {list(got)}, expected {list(shape)}")
            dtype = self._files[fn].tensors[stored].dtype
            if dtype not in ("BF16", "F16", "F32", "F64"):
                raise CheckpointError(f"{self.model_dir}: tensor '{stored}' has dtype {dtype}, expected a float type")
        extra = sorted(set(self._where) - set(expected))
        if extra:
            # A tied model that still ships lm_head.weight is fine only if it equals the embedding; we refuse instead of guessing.
            raise CheckpointError(f"{self.model_dir}: unexpected tensor '{self._where[extra[0]][1]}'" + (f" (+{len(extra) - 1} more)" if len(extra) > 1 else ""))

    def names(self) -> list[str]:
        return sorted(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        fn, stored = self._where[name]
        return self._files[fn].tensors[stored].shape

    def stored_dtype(self, name: str) -> str:
        fn, stored = self._where[name]
        return self._files[fn].tensors[stored].dtype

    def raw(self, name: str) -> np.ndarray:
        """The stored bits (bf16 as uint16), a view into the mapped file."""
        fn, stored = self._where[name]
        return self._files[fn].raw(stored)

    def get(self, name: str, dtype=np.float32) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"{self.model_dir}: no tensor '{name}'")
        fn, stored = self._where[name]
        return self._files[fn].get(stored, dtype)

    def lm_head_name(self) -> str:
        return "embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"

    def close(self) -> None:
        for f in self._files.values():
            f.close()
