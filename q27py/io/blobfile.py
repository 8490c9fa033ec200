"""Header + checked blobs: the one on-disk idiom of `.q27` files and prefix-cache entries.

    bytes 0..7     magic (names the kind of file and its layout generation)
    bytes 8..15    header length N, little-endian u64
    bytes 16..23   data start D (blob offsets count from here), little-endian u64
    bytes 24..55   SHA-256 of bytes 0..23 followed by the header bytes
    bytes 56..     header: a UTF-8 JSON object, N bytes; its "blobs" entry is the blob table
    D..            the blobs, each at a multiple of the file's alignment

The blob table lists [offset, nbytes, sha256 hex] per blob, offsets relative to D, so a small
file can be laid out without knowing its header length, and a large one written blob by
blob before its header. The header checksum covers the magic, the lengths and the whole
header, blob table included: a header edited in any way (swapped offsets, a changed shape,
another length) is detected before any of it is believed, and each blob carries its own
digest, checked whenever the reader wants the bytes verified.

Everything a reader trips over is a BlobFileError (a ValueError) saying what is wrong, so
callers can treat "foreign, damaged or truncated" as one case.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

PREAMBLE = struct.Struct("<8sQQ32s")  # magic, header length, data start, header digest
MAX_HEADER = 256 << 20


class BlobFileError(ValueError):
    """The bytes are not a valid file of the expected kind (the message says why)."""


@dataclass(frozen=True)
class Blob:
    offset: int  # from the data start
    nbytes: int
    sha256: str


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _header_digest(magic: bytes, n: int, data_start: int, raw: bytes) -> bytes:
    h = hashlib.sha256(struct.pack("<8sQQ", magic, n, data_start))
    h.update(raw)
    return h.digest()


def _preamble(magic: bytes, raw: bytes, data_start: int) -> bytes:
    return PREAMBLE.pack(magic, len(raw), data_start, _header_digest(magic, len(raw), data_start, raw))


def _encode(header: dict, blobs: list[Blob]) -> bytes:
    if "blobs" in header:
        raise ValueError("'blobs' is the blob table's key; the header may not use it")
    return json.dumps({**header, "blobs": [[b.offset, b.nbytes, b.sha256] for b in blobs]}).encode()


def pack(magic: bytes, header: dict, blobs: list, align: int = 64) -> bytes:
    """A whole small file in memory (prefix-cache entries): preamble + header + aligned blobs."""
    table, pos = [], 0
    datas = [memoryview(b).cast("B") for b in blobs]
    for data in datas:
        table.append(Blob(pos, data.nbytes, hashlib.sha256(data).hexdigest()))
        pos = round_up(pos + data.nbytes, align)
    raw = _encode(header, table)
    data_start = round_up(PREAMBLE.size + len(raw), align)
    out = bytearray(data_start + (table[-1].offset + table[-1].nbytes if table else 0))
    out[: PREAMBLE.size] = _preamble(magic, raw, data_start)
    out[PREAMBLE.size : PREAMBLE.size + len(raw)] = raw
    for blob, data in zip(table, datas):
        out[data_start + blob.offset : data_start + blob.offset + blob.nbytes] = data
    return bytes(out)


class Writer:
    """A large file written blob by blob into a seekable binary file; the header goes in last.

    header_room is an upper bound on the header's encoded length (the blob table included),
    so the data start is fixed before the first blob: no blob is ever moved.
    """

    def __init__(self, f, magic: bytes, header_room: int, align: int = 4096):
        self.f, self.magic, self.align = f, magic, align
        self.header_room = header_room
        self.data_start = round_up(PREAMBLE.size + header_room, align)
        self.blobs: list[Blob] = []
        self._pos = 0

    def next_offset(self) -> int:
        """Absolute file offset the next blob will start at."""
        return self.data_start + self._pos

    def add(self, data) -> int:
        """Write one blob at the next aligned offset; returns its index in the blob table."""
        view = memoryview(data).cast("B")
        self.f.seek(self.data_start + self._pos)
        self.f.write(view)
        self.blobs.append(Blob(self._pos, view.nbytes, hashlib.sha256(view).hexdigest()))
        self._pos = round_up(self._pos + view.nbytes, self.align)
        return len(self.blobs) - 1

    def finish(self, header: dict) -> int:
        """Write the preamble and header; returns the file's length."""
        raw = _encode(header, self.blobs)
        if len(raw) > self.header_room:
            raise ValueError(f"header of {len(raw)} bytes exceeds its reserved room of {self.header_room}")
        end = self.data_start + (self.blobs[-1].offset + self.blobs[-1].nbytes if self.blobs else 0)
        self.f.truncate(end)
        self.f.seek(0)
        self.f.write(_preamble(self.magic, raw, self.data_start) + raw)
        return end


@dataclass(frozen=True)
class Header:
    header: dict  # the JSON object, without its blob table
    blobs: tuple[Blob, ...]
    data_start: int


def parse_header(prefix: bytes, magic: bytes, file_size: int | None = None, what: str = "file",
                 max_header: int = MAX_HEADER) -> Header | int:
    """Check and parse the header at the start of a file.

    `prefix` is the file's first bytes. When they hold the preamble but not the whole header,
    the number of bytes needed is returned instead (read that many and call again).
    Raises BlobFileError on anything invalid; blob digests are not checked here (see check_blob).
    """
    if len(prefix) < PREAMBLE.size:
        if file_size is not None and file_size < PREAMBLE.size:
            raise BlobFileError(f"{what}: truncated ({file_size} bytes)")
        if len(prefix) >= 8 and prefix[:8] != magic:
            raise BlobFileError(f"{what}: bad magic {bytes(prefix[:8])!r} (expected {magic!r})")
        return PREAMBLE.size
    got_magic, n, data_start, digest = PREAMBLE.unpack_from(prefix)
    if got_magic != magic:
        raise BlobFileError(f"{what}: bad magic {got_magic!r} (expected {magic!r})")
    if n > max_header or data_start < PREAMBLE.size + n:
        raise BlobFileError(f"{what}: bad header length {n} / data start {data_start}")
    if file_size is not None and data_start > file_size:
        raise BlobFileError(f"{what}: truncated (data starts at {data_start}, file has {file_size} bytes)")
    if len(prefix) < PREAMBLE.size + n:
        return PREAMBLE.size + n
    raw = bytes(prefix[PREAMBLE.size : PREAMBLE.size + n])
    if _header_digest(got_magic, n, data_start, raw) != digest:
        raise BlobFileError(f"{what}: header checksum mismatch (the header was changed or damaged)")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BlobFileError(f"{what}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise BlobFileError(f"{what}: header is a JSON {type(header).__name__}, not an object")
    table = header.pop("blobs", None)
    if not isinstance(table, list):
        raise BlobFileError(f"{what}: header has no blob table")
    blobs = []
    for i, entry in enumerate(table):
        if not (isinstance(entry, list) and len(entry) == 3 and all(type(x) is int and x >= 0 for x in entry[:2])
                and isinstance(entry[2], str)):
            raise BlobFileError(f"{what}: blob {i} is {entry!r}, not [offset, nbytes, sha256]")
        blob = Blob(*entry)
        if file_size is not None and data_start + blob.offset + blob.nbytes > file_size:
            raise BlobFileError(f"{what}: truncated (blob {i} ends past the end of the file)")
        blobs.append(blob)
    return Header(header, tuple(blobs), data_start)


def check_blob(data, blob: Blob, what: str = "file", index: int | None = None) -> None:
    """Raise BlobFileError unless `data` (the blob's bytes) has the recorded length and digest."""
    view = memoryview(data).cast("B")
    name = f"blob {index}" if index is not None else "a blob"
    if view.nbytes != blob.nbytes:
        raise BlobFileError(f"{what}: {name} is {view.nbytes} bytes, the header says {blob.nbytes}")
    if hashlib.sha256(view).hexdigest() != blob.sha256:
        raise BlobFileError(f"{what}: {name} checksum mismatch (damaged)")


def read_header_from_file(f, magic: bytes, file_size: int, what: str = "file",
                          max_header: int = MAX_HEADER) -> Header:
    """parse_header over an open binary file (reads only the preamble and the header)."""
    f.seek(0)
    data = f.read(PREAMBLE.size)
    while True:
        got = parse_header(data, magic, file_size, what, max_header)
        if isinstance(got, Header):
            return got
        more = f.read(got - len(data))
        if not more:
            raise BlobFileError(f"{what}: truncated header")
        data += more


def unpack(data, magic: bytes, what: str = "file", max_header: int = MAX_HEADER) -> tuple[Header, list[memoryview]]:
    """A whole file in memory, verified whole: header checksum and every blob's digest."""
    view = memoryview(data).cast("B")
    head = parse_header(view, magic, view.nbytes, what, max_header)
    if not isinstance(head, Header):
        raise BlobFileError(f"{what}: truncated header")
    blobs = []
    for i, blob in enumerate(head.blobs):
        start = head.data_start + blob.offset
        part = view[start : start + blob.nbytes]
        check_blob(part, blob, what, i)
        blobs.append(part)
    return head, blobs


def open_regular(path, what: str | None = None):
    """(binary file, size) for a regular file, never blocking: a FIFO, device or directory named
    like one of our files is refused (BlobFileError) instead of hanging the reader on open()."""
    import os
    import stat

    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise BlobFileError(f"{what or path}: not a regular file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)  # a regular file never blocks; reads are plain reads again
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb"), st.st_size
