"""The CPU packer of .q27 files: which tensors a file holds, fused how, and packed into which bytes.

    write(path, checkpoint, tier)   # what `q27py repack` runs (no GPU, no cupy)

Matrix names are the fused ones the fast path runs (see `recipe`): e.g. layers.0.gdn.qkvz =
[in_proj_qkv; in_proj_z], layers.3.mlp.gate_up = gate/up interleaved per 8 rows. Each is
packed with q27py/gpu/layout.py, the numpy specification of the bytes the GPU packer makes,
and written with the container writer of q27py/io/q27file.py (which knows no layout).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from q27py.gpu import layout as L
from q27py.io.q27file import TIERS, Q27Writer, role_format
from q27py.model.config import FULL, ModelConfig

MODE_STORE, MODE_ADD, MODE_SWIGLU = 0, 1, 2  # q27py.gpu.kernels' epilogues (kept here so repack needs no cupy)


@dataclass(frozen=True)
class Item:
    """One tensor of the container: how to build it from checkpoint tensors."""

    name: str
    kind: str  # "matrix" | "table" | "vector" | "neg_a" | "conv"
    parts: tuple[str, ...]
    role: str = ""
    in_mtp: bool = False
    mode: int = MODE_STORE
    interleave: bool = False
    out_rows: int | None = None


def _layer_items(cfg: ModelConfig, src: str, dst: str, kind: str, in_mtp: bool) -> list[Item]:
    items = [
        Item(dst + "input_ln", "vector", (src + "input_layernorm.weight",)),
        Item(dst + "post_ln", "vector", (src + "post_attention_layernorm.weight",)),
        Item(dst + "mlp.gate_up", "matrix", (src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"), "mlp_gate_up",
             in_mtp, MODE_SWIGLU, True, cfg.intermediate_size),
        Item(dst + "mlp.down", "matrix", (src + "mlp.down_proj.weight",), "mlp_down", in_mtp, MODE_ADD),
    ]
    if kind == FULL:
        a = src + "self_attn."
        items += [
            Item(dst + "attn.q", "matrix", (a + "q_proj.weight",), "attn_q", in_mtp),
            Item(dst + "attn.kv", "matrix", (a + "k_proj.weight", a + "v_proj.weight"), "attn_kv", in_mtp),
            Item(dst + "attn.o", "matrix", (a + "o_proj.weight",), "attn_o", in_mtp, MODE_ADD),
            Item(dst + "attn.q_norm", "vector", (a + "q_norm.weight",)),
            Item(dst + "attn.k_norm", "vector", (a + "k_norm.weight",)),
        ]
    else:
        a = src + "linear_attn."
        items += [
            Item(dst + "gdn.qkvz", "matrix", (a + "in_proj_qkv.weight", a + "in_proj_z.weight"), "gdn_qkvz", in_mtp),
            Item(dst + "gdn.ab", "matrix", (a + "in_proj_b.weight", a + "in_proj_a.weight"), "gdn_ab", in_mtp),
            Item(dst + "gdn.out", "matrix", (a + "out_proj.weight",), "gdn_out", in_mtp, MODE_ADD),
            Item(dst + "gdn.conv_w", "conv", (a + "conv1d.weight",)),
            Item(dst + "gdn.neg_a", "neg_a", (a + "A_log",)),
            Item(dst + "gdn.dt_bias", "vector", (a + "dt_bias",)),
            Item(dst + "gdn.norm_w", "vector", (a + "norm.weight",)),
        ]
    return items


def recipe(cfg: ModelConfig, has_mtp: bool) -> list[Item]:
    """Every tensor of a .q27 file for this model, in file order."""
    lm = "embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    items = [Item("embed", "table", ("embed_tokens.weight",), "embed"), Item("final_norm", "vector", ("norm.weight",)),
             Item("lm_head", "matrix", (lm,), "lm_head")]
    for i, kind in enumerate(cfg.layer_types):
        items += _layer_items(cfg, f"layers.{i}.", f"layers.{i}.", kind, False)
    if has_mtp:
        items += [Item("mtp.fc", "matrix", ("mtp.fc.weight",), "mtp_fc", True),
                  Item("mtp.pre_e", "vector", ("mtp.pre_fc_norm_embedding.weight",)),
                  Item("mtp.pre_h", "vector", ("mtp.pre_fc_norm_hidden.weight",)),
                  Item("mtp.norm", "vector", ("mtp.norm.weight",))]
        items += _layer_items(cfg, "mtp.layers.0.", "mtp.layer.", FULL, True)
    return items


# ---------------------------------------------------------------- building blobs (numpy)
def _rows(ckpt, item: Item) -> np.ndarray:
    parts = [ckpt.get(n, np.float32).reshape(ckpt.shape(n)[0], -1) for n in item.parts]
    if item.interleave:
        return L.interleave_gate_up(*parts)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def build_blobs(ckpt, item: Item, tier: str) -> tuple[dict, list[np.ndarray]]:
    """(metadata, blobs) for one item, packed on the CPU with q27py.gpu.layout."""
    if item.kind == "matrix":
        w = _rows(ckpt, item)
        fmt = L.FMT_NAMES[role_format(tier, item.role, item.in_mtp)]
        pm = L.pack_matrix(w, fmt)
        meta = {"fmt": fmt, "rows": pm.shape.rows, "cols": pm.shape.cols, "group": pm.shape.group, "mode": item.mode,
                "out_rows": item.out_rows}
        return meta, [pm.codes, pm.scales.view(np.uint8)]
    if item.kind == "table":
        w = ckpt.get(item.parts[0], np.float32)
        if role_format(tier, "embed") == "bf16":
            return {"fmt": "bf16", "rows": w.shape[0], "cols": w.shape[1]}, [L.bf16_bits(w).view(np.uint8).reshape(-1)]
        codes, scales = L.quantize(w, L.FMT_Q8, 128)
        meta = {"fmt": "q8", "rows": w.shape[0], "cols": w.shape[1], "group": 128, "groups": scales.shape[1]}
        return meta, [codes.view(np.uint8).reshape(-1), scales.view(np.uint8).reshape(-1)]
    if item.kind == "neg_a":
        a = ckpt.get(item.parts[0], np.float64).reshape(-1)
        v = (-np.exp(a)).astype(np.float32)
    elif item.kind == "conv":
        w = ckpt.get(item.parts[0], np.float32)
        v = w.reshape(w.shape[0], -1)
    else:
        v = ckpt.get(item.parts[0], np.float32)
    v = np.ascontiguousarray(v, dtype=np.float32)
    return {"fmt": "f32", "shape": list(v.shape)}, [v.view(np.uint8).reshape(-1)]


def _blob_count(item: Item, tier: str) -> int:
    if item.kind == "matrix":
        return 2
    if item.kind == "table":
        return 1 if role_format(tier, "embed") == "bf16" else 2
    return 1


def write(path: str | Path, ckpt, tier: str, progress: bool = True) -> dict:
    """Quantize/pack a checkpoint into one .q27 file, tensor by tensor (the whole model is never in memory)."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; known: {sorted(TIERS)}")
    cfg: ModelConfig = ckpt.config
    items = recipe(cfg, ckpt.has_mtp)
    config = cfg.to_hf_dict()
    room = Q27Writer.room_for(config, {it.name: (it.kind, _blob_count(it, tier)) for it in items})
    out = Q27Writer(path, room)
    t0 = time.perf_counter()
    try:
        for k, it in enumerate(items):
            meta, data = build_blobs(ckpt, it, tier)
            out.add(it.name, it.kind, meta, data)
            if progress and sys.stderr.isatty():
                frac = (k + 1) / len(items)
                sys.stderr.write(f"\rrepack {tier} [{'#' * int(30 * frac):<30}] {100 * frac:5.1f}% "
                                 f"{time.perf_counter() - t0:6.1f}s")
    except BaseException:
        out.abort()
        raise
    header = out.finish(tier, config, ckpt.has_mtp)
    if progress and sys.stderr.isatty():
        sys.stderr.write("\n")
    return header
