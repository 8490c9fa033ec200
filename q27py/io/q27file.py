"""The repacked model container (.q27): one mmap-able file of already-packed tensors.

Layout (docs/FORMAT.md): a blobfile (q27py/io/blobfile.py) with magic b"Q27PACK2" and blobs
aligned to 4096 bytes: preamble, checksummed JSON header, blobs. The header holds
{"format": 2, "tier", "config" (text config.json), "has_mtp", "tensors": {name: entry}} plus
the blob table; an entry is {"kind", "blobs": [blob indices], "meta"}: a packed matrix (GEMV
layout of q27py/gpu/layout.py: codes blob + scale-pair blob), a row table (embeddings: bf16
bits, or int8 codes + fp16 scales), or an fp32 vector. Loading is one host-to-device copy
per blob, straight from the mapping.

This module is the container only: what goes in it and how each tensor is packed is the
GPU layout's business (q27py/gpu/q27pack.py writes the files), so io imports nothing above
it. The tier tables stay here: both the packer and the loaders read them.
"""

from __future__ import annotations

import json
import mmap
from pathlib import Path

import numpy as np

from q27py.errors import CheckpointError
from q27py.io import blobfile
from q27py.model.config import ModelConfig

MAGIC = b"Q27PACK2"
OLD_MAGICS = {b"Q27PACK1": 1}  # layouts before the checksummed header: refused with a plain message
ALIGN = 4096
FORMAT_VERSION = 2

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


class Q27Writer:
    """Writes a .q27 file tensor by tensor (the whole model is never in memory).

    header_room bounds the final header (config + tensor entries + blob table); `room_for`
    estimates it from the tensor names and blob counts before anything is packed.
    """

    def __init__(self, path: str | Path, header_room: int):
        self.path = Path(path)
        self._f = open(self.path, "wb")
        self._w = blobfile.Writer(self._f, MAGIC, header_room, ALIGN)
        self.tensors: dict[str, dict] = {}

    @staticmethod
    def room_for(config: dict, tensors: dict[str, tuple[str, int]]) -> int:
        """Upper bound of the header for these tensors ({name: (kind, number of blobs)})."""
        probe = {"format": FORMAT_VERSION, "tier": "x" * 16, "config": config, "has_mtp": True,
                 "tensors": {name: {"kind": kind, "blobs": [10 ** 7] * k, "meta": {"pad": " " * 160}}
                             for name, (kind, k) in tensors.items()}}
        blobs = sum(k for _, k in tensors.values())
        return len(json.dumps(probe)) + blobs * (2 * 20 + 64 + 10) + 65536

    def add(self, name: str, kind: str, meta: dict, blobs: list[np.ndarray]) -> None:
        index = [self._w.add(np.ascontiguousarray(a).reshape(-1).view(np.uint8)) for a in blobs]
        self.tensors[name] = {"kind": kind, "blobs": index, "meta": meta}

    def finish(self, tier: str, config: dict, has_mtp: bool) -> dict:
        header = {"format": FORMAT_VERSION, "tier": tier, "config": config, "has_mtp": has_mtp,
                  "tensors": self.tensors}
        try:
            self._w.finish(header)
        except ValueError as exc:
            raise CheckpointError(f"{self.path}: {exc} (report this)") from None
        finally:
            self._f.close()
        return header

    def abort(self) -> None:
        self._f.close()


class Q27File:
    """A .q27 file opened read-only: header + zero-copy numpy views of its blobs."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._f = open(self.path, "rb")
        try:
            self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            self._f.close()
            raise CheckpointError(f"{self.path}: not a .q27 file (empty)") from None
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        magic = bytes(self._mm[:8])
        if magic in OLD_MAGICS:
            raise CheckpointError(f"{self.path}: a format {OLD_MAGICS[magic]} .q27 file (this version reads format "
                                  f"{FORMAT_VERSION}, whose header is checksummed): repack it with `q27py repack`")
        try:
            head = blobfile.parse_header(self._mm, MAGIC, len(self._mm), str(self.path))
        except blobfile.BlobFileError as exc:
            raise CheckpointError(f"not a valid .q27 file: {exc}") from None
        if not isinstance(head, blobfile.Header):
            raise CheckpointError(f"{self.path}: not a valid .q27 file (truncated header)")
        self.header, self._blobs, self._data_start = head.header, head.blobs, head.data_start
        if self.header.get("format") != FORMAT_VERSION:
            raise CheckpointError(f"{self.path}: format {self.header.get('format')} (expected {FORMAT_VERSION})")
        try:
            self.tier = self.header["tier"]
            self.has_mtp = bool(self.header["has_mtp"])
            tensors = self.header["tensors"]
            for name, entry in tensors.items():
                if not all(type(i) is int and 0 <= i < len(self._blobs) for i in entry["blobs"]):
                    raise ValueError(f"tensor {name!r} names a blob that is not in the table")
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: bad .q27 header ({exc})") from None
        self.config = ModelConfig.from_dict(self.header["config"], source=str(self.path))

    def names(self) -> list[str]:
        return list(self.header["tensors"])

    def entry(self, name: str) -> dict:
        try:
            return self.header["tensors"][name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor '{name}'") from None

    def blob_ranges(self, name: str) -> list[tuple[int, int]]:
        """(absolute offset, nbytes) of each of the tensor's blobs."""
        return [(self._data_start + self._blobs[i].offset, self._blobs[i].nbytes) for i in self.entry(name)["blobs"]]

    def blobs(self, name: str) -> list[np.ndarray]:
        """Zero-copy views of the tensor's blobs (not digest-checked: see verify)."""
        return [np.frombuffer(self._mm, dtype=np.uint8, count=n, offset=off) for off, n in self.blob_ranges(name)]

    def verify(self) -> None:
        """Check every blob's SHA-256 against the (checksummed) header: CheckpointError names the first bad one.

        Not done on open: it reads the whole file (seconds for a 27B model); the header itself
        is always verified."""
        for name in self.names():
            for i, (off, n) in zip(self.entry(name)["blobs"], self.blob_ranges(name)):
                try:
                    blobfile.check_blob(self._mm[off : off + n], self._blobs[i], str(self.path), i)
                except blobfile.BlobFileError as exc:
                    raise CheckpointError(f"{exc} (tensor {name})") from None

    def close(self) -> None:
        self._mm.close()
        self._f.close()
