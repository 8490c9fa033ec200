"""The repacked model container (.q27): one mmap-able file of already-packed tensors.

Layout (docs/FORMAT.md):
    bytes 0..7     magic b"Q27PACK1"
    bytes 8..15    header length N (little-endian u64)
    bytes 16..     header: UTF-8 JSON, N bytes
    then blobs, each starting at a multiple of 4096 (offsets in the header are absolute)

The header holds {"format": 1, "tier", "config" (text config.json), "has_mtp", "tensors":
{name: entry}}. An entry is a packed matrix (GEMV layout of q27py/gpu/layout.py: codes blob +
scale-pair blob), a row table (embeddings: bf16 bits, or int8 codes + fp16 scales), or an
fp32 vector. Loading is one host-to-device copy per blob, straight from the mapping.

Matrix names are the fused ones the fast path runs (see `recipe`): e.g. layers.0.gdn.qkvz =
[in_proj_qkv; in_proj_z], layers.3.mlp.gate_up = gate/up interleaved per 8 rows.
"""

from __future__ import annotations

import json
import mmap
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from q27py.errors import CheckpointError
from q27py.gpu import layout as L
from q27py.model.config import FULL, ModelConfig

MAGIC = b"Q27PACK1"
ALIGN = 4096
FORMAT_VERSION = 1
MODE_STORE, MODE_ADD, MODE_SWIGLU = 0, 1, 2  # q27py.gpu.kernels (kept here so repack needs no cupy)

# role -> format per tier (docs/QUANT.md). Roles not listed use the tier's "bulk" entry.
TIERS: dict[str, dict[str, str]] = {
    "bf16": {"bulk": "bf16", "embed": "bf16", "gdn_ab": "bf16"},
    "q8": {"bulk": "q8", "embed": "q8", "gdn_ab": "bf16"},
    "q4s": {"bulk": "q4", "embed": "q8", "attn_kv": "q8", "mtp": "q8", "gdn_ab": "bf16"},
    "q5f": {"bulk": "q4", "embed": "q8", "attn_kv": "q8", "mtp": "q8", "gdn_ab": "bf16", "mlp_down": "q8"},
}


def role_format(tier: str, role: str, in_mtp: bool = False) -> str:
    recipe = TIERS[tier]
    if in_mtp and "mtp" in recipe and role != "gdn_ab":
        return recipe["mtp"]
    return recipe.get(role, recipe["bulk"])


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


def _planned_sizes(cfg: ModelConfig, ckpt, item: Item, tier: str) -> list[int]:
    if item.kind == "matrix":
        rows = sum(ckpt.shape(n)[0] for n in item.parts)
        if item.interleave:
            rows = 2 * L.round_up(ckpt.shape(item.parts[0])[0], 8)
        cols = int(np.prod(ckpt.shape(item.parts[0])[1:]))
        shape = L.matrix_shape(rows, cols, L.FMT_NAMES[role_format(tier, item.role, item.in_mtp)])
        return [shape.code_bytes, shape.scale_bytes]
    if item.kind == "table":
        v, h = ckpt.shape(item.parts[0])
        if role_format(tier, "embed") == "bf16":
            return [v * h * 2]
        return [v * h, v * (-(-h // 128)) * 2]
    return [int(np.prod(ckpt.shape(item.parts[0]))) * 4]


def write(path: str | Path, ckpt, tier: str, progress: bool = True) -> dict:
    """Quantize/pack a checkpoint into one .q27 file, tensor by tensor (the whole model is never in memory)."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; known: {sorted(TIERS)}")
    cfg: ModelConfig = ckpt.config
    items = recipe(cfg, ckpt.has_mtp)
    tensors = {}
    plan = []
    # offsets are computed up front, so the header can be written before any blob
    sizes = [_planned_sizes(cfg, ckpt, it, tier) for it in items]
    header_probe = {"format": FORMAT_VERSION, "tier": tier, "config": cfg.to_hf_dict(), "has_mtp": ckpt.has_mtp,
                    "tensors": {it.name: {"blobs": [[0, n] for n in sz], "kind": it.kind, "meta": {"pad": " " * 96}}
                                for it, sz in zip(items, sizes)}}
    header_room = L.round_up(len(json.dumps(header_probe)) + 16 + 65536, ALIGN)
    offset = header_room
    for it, sz in zip(items, sizes):
        blobs = []
        for n in sz:
            blobs.append([offset, n])
            offset = L.round_up(offset + n, ALIGN)
        plan.append((it, blobs))
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.truncate(offset)
        for k, (it, blobs) in enumerate(plan):
            meta, data = build_blobs(ckpt, it, tier)
            for (off, n), arr in zip(blobs, data):
                if arr.nbytes != n:
                    raise CheckpointError(f"{it.name}: packed {arr.nbytes} bytes, planned {n}")
                f.seek(off)
                f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))
            tensors[it.name] = {"kind": it.kind, "blobs": blobs, "meta": meta}
            if progress and sys.stderr.isatty():
                frac = (k + 1) / len(plan)
                sys.stderr.write(f"\rrepack {tier} [{'#' * int(30 * frac):<30}] {100 * frac:5.1f}% "
                                 f"{time.perf_counter() - t0:6.1f}s")
        header = {"format": FORMAT_VERSION, "tier": tier, "config": cfg.to_hf_dict(), "has_mtp": ckpt.has_mtp,
                  "tensors": tensors}
        raw = json.dumps(header).encode()
        if 16 + len(raw) > header_room:
            raise CheckpointError("header larger than its reserved room (report this)")
        f.seek(0)
        f.write(MAGIC + struct.pack("<Q", len(raw)) + raw)
    if progress and sys.stderr.isatty():
        sys.stderr.write("\n")
    return header


class Q27File:
    """A .q27 file opened read-only: header + zero-copy numpy views of its blobs."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._f = open(self.path, "rb")
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ)
        if self._mm[:8] != MAGIC:
            raise CheckpointError(f"{self.path}: not a .q27 file (bad magic)")
        (n,) = struct.unpack("<Q", self._mm[8:16])
        self.header = json.loads(self._mm[16 : 16 + n].decode())
        if self.header.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"{self.path}: format {self.header.get('format')} (expected {FORMAT_VERSION})")
        self.config = ModelConfig.from_dict(self.header["config"], source=str(self.path))
        self.tier = self.header["tier"]
        self.has_mtp = bool(self.header["has_mtp"])

    def names(self) -> list[str]:
        return list(self.header["tensors"])

    def entry(self, name: str) -> dict:
        try:
            return self.header["tensors"][name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor '{name}'") from None

    def blobs(self, name: str) -> list[np.ndarray]:
        return [np.frombuffer(self._mm, dtype=np.uint8, count=n, offset=off) for off, n in self.entry(name)["blobs"]]

    def close(self) -> None:
        self._mm.close()
        self._f.close()
