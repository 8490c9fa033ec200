"""The bytes of one disk prefix-cache entry (`<key>.q27p`): a blobfile (q27py/io/blobfile.py).

Header: {"version": 2, "compat": <hash of model, tier, state format>, "n_tokens": L,
"arrays": {name: {"dtype": "<f4", "shape": [...], "blob": i}}}; one blob per array, "tokens"
(int32 [L]) among them. The cache policy (which entries exist, LRU, when to write) lives in
q27py/engine/prefix_cache.py; this module only turns arrays into bytes and bytes back into
arrays, verifying everything (header checksum, every blob's digest, dtypes, shapes, the token
count) before anything is returned. Version 1 entries (magic Q27PREFX, header outside the
checksum) are refused as foreign.
"""

from __future__ import annotations

import numpy as np

from q27py.io import blobfile
from q27py.io.blobfile import BlobFileError

MAGIC = b"Q27PRFX2"
FORMAT_VERSION = 2
MAX_HEADER = 16 << 20
_KINDS = "biuf"  # plain numbers only: no object or structured dtypes from a file


class ForeignEntry(BlobFileError):
    """A valid entry written for another model, tier, state format or format version."""


def encode(compat: str, arrays: dict[str, np.ndarray]) -> bytes:
    """The file bytes for an entry; `arrays` must hold "tokens" (int32, the prefix)."""
    tokens = arrays["tokens"]
    table, blobs = {}, []
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        table[name] = {"dtype": a.dtype.str, "shape": list(a.shape), "blob": len(blobs)}
        blobs.append(a.reshape(-1).view(np.uint8))
    header = {"version": FORMAT_VERSION, "compat": compat, "n_tokens": int(tokens.shape[0]), "arrays": table}
    return blobfile.pack(MAGIC, header, blobs)


def check_identity(header: dict, compat: str, what: str) -> int:
    """The entry's token count, or ForeignEntry if it belongs to another model or format."""
    if header.get("version") != FORMAT_VERSION or header.get("compat") != compat:
        raise ForeignEntry(f"{what}: written for another model or format")
    n = header.get("n_tokens")
    if type(n) is not int or n <= 0:
        raise BlobFileError(f"{what}: bad n_tokens {n!r}")
    return n


def read_header(path, compat: str) -> int:
    """Token count of the entry at path, reading only its header (startup scan).

    Raises ForeignEntry, BlobFileError (damaged, not a regular file) or OSError."""
    f, size = blobfile.open_regular(path, what=path.name)
    with f:
        head = blobfile.read_header_from_file(f, MAGIC, size, path.name, MAX_HEADER)
    return check_identity(head.header, compat, path.name)


def decode(data: bytes, compat: str, what: str) -> dict[str, np.ndarray]:
    """Arrays of a whole entry, verified whole (header, digests, dtypes, shapes, token count)."""
    head, blobs = blobfile.unpack(data, MAGIC, what, MAX_HEADER)
    n = check_identity(head.header, compat, what)
    table = head.header.get("arrays")
    if not isinstance(table, dict) or "tokens" not in table:
        raise BlobFileError(f"{what}: no array table")
    arrays = {}
    for name, spec in table.items():
        try:
            dtype = np.dtype(spec["dtype"])
            shape = tuple(spec["shape"])
            blob = blobs[spec["blob"]]
        except (TypeError, KeyError, IndexError, ValueError) as exc:
            raise BlobFileError(f"{what}: array {name!r} is badly described ({exc})") from None
        if dtype.kind not in _KINDS or not all(type(d) is int and d >= 0 for d in shape):
            raise BlobFileError(f"{what}: array {name!r} has dtype {dtype} / shape {shape}")
        if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != blob.nbytes:
            raise BlobFileError(f"{what}: array {name!r} of shape {shape} does not fill its {blob.nbytes} bytes")
        arrays[name] = np.frombuffer(blob, dtype=dtype).reshape(shape).copy()
    tokens = arrays["tokens"]
    if tokens.dtype != np.int32 or tokens.shape != (n,):
        raise BlobFileError(f"{what}: token vector {tokens.dtype}{list(tokens.shape)} does not match n_tokens {n}")
    return arrays
