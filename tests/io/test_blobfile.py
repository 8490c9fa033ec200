"""The "header + checked blobs" idiom (q27py/io/blobfile.py) and the .q27 container built on it:
the header is inside the checksum, every blob has a digest, damaged or foreign bytes are refused
with a reason, and io imports nothing above it."""

from __future__ import annotations

import ast
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from q27py.errors import CheckpointError
from q27py.io import blobfile
from q27py.io.blobfile import BlobFileError

REPO = Path(__file__).resolve().parents[2]
MAGIC = b"TESTBLOB"


def _file(header=None, blobs=None):
    return blobfile.pack(MAGIC, header or {"kind": "x"}, blobs or [b"hello", np.arange(10, dtype=np.float32)])


def test_round_trip_with_aligned_blobs():
    data = _file()
    head, blobs = blobfile.unpack(data, MAGIC)
    assert head.header == {"kind": "x"}
    assert bytes(blobs[0]) == b"hello"
    assert np.array_equal(np.frombuffer(blobs[1], np.float32), np.arange(10, dtype=np.float32))
    assert head.data_start % 64 == 0 and all(b.offset % 64 == 0 for b in head.blobs)


def test_every_header_byte_is_covered_by_the_checksum():
    data = bytearray(_file())
    n = struct.unpack("<Q", data[8:16])[0]
    for pos in [*range(8, 24), *range(56, 56 + n)]:  # lengths, data start, each header byte
        bad = bytearray(data)
        bad[pos] ^= 0x01
        with pytest.raises(BlobFileError):
            blobfile.unpack(bytes(bad), MAGIC)


def test_swapped_blob_table_entries_are_detected():
    data = bytearray(_file(blobs=[b"k" * 64, b"v" * 64]))
    n, start = struct.unpack("<QQ", data[8:24])
    head = json.loads(data[56 : 56 + n])
    head["blobs"] = head["blobs"][::-1]
    raw = json.dumps(head).encode()
    assert len(raw) == n
    data[56 : 56 + n] = raw
    with pytest.raises(BlobFileError, match="header checksum"):
        blobfile.unpack(bytes(data), MAGIC)


def test_a_damaged_blob_is_detected():
    data = bytearray(_file())
    data[-1] ^= 0x80
    with pytest.raises(BlobFileError, match="blob 1 checksum"):
        blobfile.unpack(bytes(data), MAGIC)


@pytest.mark.parametrize("cut", [0, 7, 30, 70, -3])
def test_truncated_files_are_refused(cut):
    data = _file()
    with pytest.raises(BlobFileError):
        blobfile.unpack(data[:cut], MAGIC)


def test_foreign_magic_and_non_object_headers_are_refused():
    with pytest.raises(BlobFileError, match="bad magic"):
        blobfile.unpack(_file(), b"OTHERMAG")
    raw = b"[1, 2]"
    start = blobfile.round_up(blobfile.PREAMBLE.size + len(raw), 64)
    data = blobfile._preamble(MAGIC, raw, start) + raw
    data += b"\0" * (start - len(data))
    with pytest.raises(BlobFileError, match="not an object"):
        blobfile.unpack(data, MAGIC)


def test_streaming_writer_equals_the_reader(tmp_path):
    path = tmp_path / "big.bin"
    with open(path, "w+b") as f:
        w = blobfile.Writer(f, MAGIC, header_room=4096, align=4096)
        for i in range(3):
            w.add(np.full(1000 * (i + 1), i, dtype=np.uint8))
        w.finish({"n": 3})
    head, blobs = blobfile.unpack(path.read_bytes(), MAGIC)
    assert head.header == {"n": 3} and [b.nbytes for b in head.blobs] == [1000, 2000, 3000]
    assert all((head.data_start + b.offset) % 4096 == 0 for b in head.blobs)
    assert [set(bytes(b)) for b in blobs] == [{0}, {1}, {2}]


def test_a_fifo_is_refused_without_blocking(tmp_path):
    import os

    fifo = tmp_path / "entry"
    os.mkfifo(fifo)
    with pytest.raises(BlobFileError, match="not a regular file"):
        blobfile.open_regular(fifo)


def test_io_imports_nothing_above_it():
    """io is the bottom layer: no module of q27py/io imports gpu, engine, chat or server."""
    for path in sorted((REPO / "q27py" / "io").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith(("q27py.gpu", "q27py.engine", "q27py.chat", "q27py.server")), (path.name, name)


# ---- the .q27 container


@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    from q27py import DEFAULT_MODEL_DIR
    from q27py.gpu.q27pack import write
    from q27py.io.checkpoint import Checkpoint

    path = tmp_path_factory.mktemp("q27") / "tiny-q8.q27"
    write(path, Checkpoint.open(DEFAULT_MODEL_DIR), "q8", progress=False)
    return path


def test_q27_header_tampering_is_refused(q8_file, tmp_path):
    from q27py.io.q27file import Q27File

    data = bytearray(q8_file.read_bytes())
    n = struct.unpack("<Q", data[8:16])[0]
    head = data[56 : 56 + n]
    pos = bytes(head).index(b'"tier": "q8"') + len('"tier": "q')
    data[56 + pos] = ord("4")  # claims q4 weights: the loader would misread every matrix
    bad = tmp_path / "bad.q27"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        Q27File(bad)


def test_q27_verify_finds_a_damaged_blob(q8_file, tmp_path):
    from q27py.io.q27file import Q27File

    qf = Q27File(q8_file)
    qf.verify()
    off, n = qf.blob_ranges("layers.0.mlp.down")[0]
    qf.close()
    data = bytearray(q8_file.read_bytes())
    data[off + n // 2] ^= 0x10
    bad = tmp_path / "flip.q27"
    bad.write_bytes(bytes(data))
    damaged = Q27File(bad)  # the header is fine; the blob digest is not
    with pytest.raises(CheckpointError, match="layers.0.mlp.down"):
        damaged.verify()


def test_format_1_q27_files_get_a_plain_message(tmp_path):
    from q27py.io.q27file import Q27File

    raw = json.dumps({"format": 1, "tier": "q8", "tensors": {}}).encode()
    old = tmp_path / "old.q27"
    old.write_bytes(b"Q27PACK1" + struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(CheckpointError, match="format 1 .*repack"):
        Q27File(old)
    (tmp_path / "empty.q27").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a .q27 file"):
        Q27File(tmp_path / "empty.q27")
