"""safetensors, read and written here (no dependency).

The format: 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the raw little-endian tensor bytes (offsets relative to the end of the header).

Reading memory-maps the file and hands out numpy views, one tensor at a time, so
a 54 GB checkpoint is never materialized: only the tensor being converted is
touched. bf16 has no numpy dtype; it is read as uint16 and widened by shifting
into the high half of a float32 (exact).
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from q27py.errors import CheckpointError

# safetensors dtype name -> (numpy storage dtype, bytes per element)
DTYPES = {
    "BF16": (np.dtype("<u2"), 2),
    "F16": (np.dtype("<f2"), 2),
    "F32": (np.dtype("<f4"), 4),
    "F64": (np.dtype("<f8"), 8),
    "I8": (np.dtype("i1"), 1),
    "U8": (np.dtype("u1"), 1),
    "I16": (np.dtype("<i2"), 2),
    "I32": (np.dtype("<i4"), 4),
    "I64": (np.dtype("<i8"), 8),
}
FLOAT_DTYPES = {"BF16", "F16", "F32", "F64"}
MAX_HEADER_BYTES = 100 << 20


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (exact)."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> uint16 bf16 bit patterns, round to nearest even (NaN kept a NaN)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(x)
    out = rounded.astype(np.uint16)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bf16, returned as float32."""
    return bf16_to_f32(f32_to_bf16(x))


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


class SafetensorsFile:
    """One .safetensors file, memory-mapped; tensors come out as read-only numpy views."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._fh = open(self.path, "rb")
        except OSError as exc:
            raise CheckpointError(f"{self.path}: cannot open ({exc.strerror})") from None
        size = self.path.stat().st_size
        head = self._fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{self.path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{self.path}: corrupt safetensors header length {n}")
        try:
            header = json.loads(self._fh.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: corrupt safetensors header ({exc})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupt safetensors header (not an object)")
        self.metadata = header.pop("__metadata__", None) or {}
        data_start = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        for name, meta in header.items():
            try:
                dtype, shape, (b, e) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{self.path}: tensor '{name}' has a malformed header entry") from None
            if dtype not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor '{name}' has unsupported dtype {dtype}")
            expected = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype][1]
            if e - b != expected or b < 0 or data_start + e > size:
                raise CheckpointError(
                    f"{self.path}: tensor '{name}' byte range {b}..{e} does not fit shape {list(shape)} {dtype}"
                    + (" (file truncated?)" if data_start + e > size else "")
                )
            self.tensors[name] = TensorInfo(name, dtype, shape, data_start + b, data_start + e)
        self._mmap = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None

    def raw(self, name: str) -> np.ndarray:
        """The stored array (bf16 as uint16), a view into the mapped file."""
        info = self.tensors[name]
        np_dtype, _ = DTYPES[info.dtype]
        count = int(np.prod(info.shape, dtype=np.int64))
        arr = np.frombuffer(self._mmap, dtype=np_dtype, count=count, offset=info.begin)
        return arr.reshape(info.shape)

    def get(self, name: str, dtype=np.float32) -> np.ndarray:
        """The tensor converted to a numpy float dtype (a fresh array)."""
        info = self.tensors[name]
        raw = self.raw(name)
        if info.dtype == "BF16":
            return bf16_to_f32(raw).astype(dtype, copy=False)
        return raw.astype(dtype)

    def close(self) -> None:
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None
        self._fh.close()


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], dtype: str = "BF16", metadata: dict | None = None) -> None:
    """Write tensors (float arrays) to one file, converted to `dtype` (BF16, F16 or F32).

    Integer arrays are written as their own dtype. Tensors are laid out in name
    order, back to back (the header is padded to 8 bytes).
    """
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        if arr.dtype.kind == "f":
            if dtype == "BF16":
                data, st = f32_to_bf16(arr.astype(np.float32)), "BF16"
            elif dtype == "F16":
                data, st = arr.astype("<f2"), "F16"
            elif dtype == "F32":
                data, st = arr.astype("<f4"), "F32"
            else:
                raise ValueError(f"unsupported dtype {dtype}")
        else:
            st = {v[0]: k for k, v in DTYPES.items() if k not in ("BF16",)}.get(arr.dtype.newbyteorder("<"))
            if st is None:
                raise ValueError(f"tensor {name}: unsupported dtype {arr.dtype}")
            data = arr
        raw = np.ascontiguousarray(data).tobytes()
        header[name] = {"dtype": st, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)  # contiguous: readers reject holes between tensors
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * ((-len(head)) % 8)
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)
    tmp.replace(path)
