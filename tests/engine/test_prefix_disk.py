"""The disk tier of the prefix cache: never trusts a key, ignores foreign or damaged files, evicts LRU."""

import logging

import numpy as np
import pytest

from q27py.engine.prefix_cache import DiskCache, LiveSequence, PrefixCache, common_prefix
from q27py.model.reference import ReferenceModel
from q27py.model.tiny import make_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny(d, seed=5)
    return ReferenceModel.load(d)


def _prefilled(model, tokens):
    seq = LiveSequence(model.new_state())
    out = model.forward(seq.state, tokens)
    seq.tokens = list(tokens)
    seq.state.hidden_last = out.hidden[-1]
    return seq


def _states_equal(a, b):
    assert a.position == b.position
    for i in a.gdn:
        assert np.array_equal(a.gdn[i].recurrent, b.gdn[i].recurrent)
        assert np.array_equal(a.gdn[i].conv, b.gdn[i].conv)
    for i in a.kv:
        assert np.array_equal(a.kv[i].k[: a.position], b.kv[i].k[: b.position])


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0


def test_round_trip_restores_exact_state(model, tmp_path):
    tokens = list(range(10, 50))
    seq = _prefilled(model, tokens)
    disk = DiskCache(tmp_path, compat="abc", min_tokens=1)
    disk.store_async(model, seq)
    disk.flush()
    prompt = tokens + [7, 8]
    assert disk.lookup_length(prompt) == len(tokens)
    fresh = LiveSequence(model.new_state())
    assert disk.load_into(model, fresh, tokens)
    _states_equal(fresh.state, seq.state)
    # and a continuation from the restored state equals one from the original
    a = model.forward(fresh.state, [7, 8]).logits
    b = model.forward(seq.state, [7, 8]).logits
    assert np.array_equal(a, b)


def test_foreign_and_corrupt_entries_are_ignored(model, tmp_path, caplog):
    tokens = list(range(100, 140))
    seq = _prefilled(model, tokens)
    disk = DiskCache(tmp_path, compat="model-A", min_tokens=1)
    disk.store_async(model, seq)
    disk.flush()
    (entry,) = tmp_path.glob("*.q27p")

    # another model's cache: invisible
    other = DiskCache(tmp_path, compat="model-B", min_tokens=1)
    assert other.lookup_length(tokens + [1]) == 0
    assert not other.load_into(model, LiveSequence(model.new_state()), tokens)

    # a bit flip in the payload: detected by the checksum, logged, not used
    data = bytearray(entry.read_bytes())
    data[-5] ^= 0x40
    entry.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="q27py.prefix"):
        assert not disk.load_into(model, LiveSequence(model.new_state()), tokens)
    assert "checksum" in caplog.text

    # a truncated file
    entry.write_bytes(bytes(data[: len(data) // 2]))
    assert not disk.load_into(model, LiveSequence(model.new_state()), tokens)
    assert disk.rejected == 2


def test_key_collision_never_continues_the_wrong_conversation(model, tmp_path):
    """A file under the right name but holding other tokens (a hash collision, a stale file) is refused."""
    a, b = list(range(200, 230)), list(range(300, 330))
    disk = DiskCache(tmp_path, compat="c", min_tokens=1)
    disk.store_async(model, _prefilled(model, a))
    disk.flush()
    (entry,) = tmp_path.glob("*.q27p")
    from q27py.engine.prefix_cache import _key

    entry.rename(tmp_path / f"{_key(b)}.q27p")  # now the name claims to be prefix b
    assert not disk.load_into(model, LiveSequence(model.new_state()), b)


def test_lru_eviction_by_size(model, tmp_path):
    disk = DiskCache(tmp_path, compat="c", min_tokens=1, max_bytes=1)  # every new entry evicts the older ones
    for start in (0, 50):
        disk.store_async(model, _prefilled(model, list(range(start, start + 20))))
        disk.flush()
    assert len(list(tmp_path.glob("*.q27p"))) <= 1


def test_stale_tmp_files_swept(tmp_path):
    (tmp_path / "deadbeef.tmp").write_bytes(b"partial")
    DiskCache(tmp_path, compat="c")
    assert not list(tmp_path.glob("*.tmp"))


def test_live_slot_routing_prefers_longest_restorable(model):
    cache = PrefixCache(model, max_sequences=2, checkpoint_every=0)
    s1, _ = cache.acquire([1, 2, 3, 4, 5, 6])
    model.forward(s1.state, [1, 2, 3, 4])
    s1.tokens = [1, 2, 3, 4]
    cache.save(s1, "stable")
    cache.release(s1, s1.tokens)
    s2, reused = cache.acquire([9, 9, 9])
    assert s2 is not s1 and reused == 0
    cache.release(s2, [])
    s3, reused = cache.acquire([1, 2, 3, 4, 77])
    assert s3 is s1 and reused == 4 and s3.state.position == 4


# ---- hardening (issue 13 item 6): every failure of the disk tier = ignore the entry, log it, serve cold


def _header_edit(path, edit):
    """Rewrite an entry's JSON header through `edit(header)`, keeping the rest of the bytes.

    Works on both entry layouts (v1: magic, u64 length, header; v2: the blobfile preamble), so
    the same tampering can be tried on any version of the cache."""
    import json
    import struct

    data = bytearray(path.read_bytes())
    if data[:8] == b"Q27PREFX":  # v1
        (n,) = struct.unpack("<Q", data[8:16])
        head = edit(json.loads(data[16 : 16 + n]))
        raw = json.dumps(head).encode()
        path.write_bytes(bytes(data[:8]) + struct.pack("<Q", len(raw)) + raw + bytes(data[16 + n :]))
        return
    n, start = struct.unpack("<QQ", data[8:24])
    head = json.loads(data[56 : 56 + n])
    blobs = head.get("blobs")
    head = edit(head)
    if blobs is not None and isinstance(head, dict):
        head.setdefault("blobs", blobs)
    raw = json.dumps(head).encode()
    assert 56 + len(raw) <= start
    data[8:16] = struct.pack("<Q", len(raw))
    data[56 : 56 + len(raw)] = raw
    path.write_bytes(bytes(data))


def _one_entry(model, tmp_path, tokens):
    disk = DiskCache(tmp_path, compat="c", min_tokens=1)
    seq = _prefilled(model, tokens)
    disk.store_async(model, seq)
    disk.flush()
    (entry,) = tmp_path.glob("*.q27p")
    return disk, seq, entry


def test_a_header_that_is_json_but_not_an_object_is_ignored_at_startup(model, tmp_path, caplog):
    tokens = list(range(20, 40))
    _, _, entry = _one_entry(model, tmp_path, tokens)
    _header_edit(entry, lambda head: [1, 2, 3])
    with caplog.at_level(logging.WARNING, logger="q27py.prefix"):
        disk = DiskCache(tmp_path, compat="c", min_tokens=1)  # must not raise
    assert disk.lookup_length(tokens + [1]) == 0
    assert not disk.load_into(model, LiveSequence(model.new_state()), tokens)
    assert entry.name in caplog.text


def test_a_fifo_named_like_an_entry_never_blocks_startup(model, tmp_path, caplog):
    import os
    import threading

    fifo = tmp_path / ("0" * 64 + ".q27p")
    os.mkfifo(fifo)
    done = threading.Event()

    def start():
        DiskCache(tmp_path, compat="c", min_tokens=1)
        done.set()

    with caplog.at_level(logging.WARNING, logger="q27py.prefix"):
        threading.Thread(target=start, daemon=True).start()
        finished = done.wait(10)
    if not finished:  # release the blocked open() so the thread ends
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    assert finished, "DiskCache startup blocked on a FIFO"
    assert "not a regular file" in caplog.text
    disk = DiskCache(tmp_path, compat="c", min_tokens=1)
    assert not disk.load_into(model, LiveSequence(model.new_state()), [0])


def test_leftover_temp_file_in_a_read_only_directory_does_not_stop_startup(model, tmp_path, monkeypatch, caplog):
    import os
    import pathlib

    tokens = list(range(60, 90))
    _one_entry(model, tmp_path, tokens)
    (tmp_path / "deadbeef.tmp").write_bytes(b"partial")

    def read_only(*_a, **_k):  # what a read-only directory does (tests may run as root, so chmod can't)
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(pathlib.Path, "unlink", read_only)
    monkeypatch.setattr(os, "unlink", read_only)
    monkeypatch.setattr(os, "remove", read_only)
    monkeypatch.setattr(os, "utime", read_only)
    with caplog.at_level(logging.WARNING, logger="q27py.prefix"):
        disk = DiskCache(tmp_path, compat="c", min_tokens=1)
    assert "deadbeef.tmp" in caplog.text
    # and os.utime failing on the first hit does not fail the hit
    fresh = LiveSequence(model.new_state())
    assert disk.lookup_length(tokens + [5]) == len(tokens)
    assert disk.load_into(model, fresh, tokens)
    assert fresh.state.position == len(tokens)


def test_an_uncreatable_directory_does_not_stop_startup(model, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="q27py.prefix"):
        disk = DiskCache(blocker / "cache", compat="c", min_tokens=1)
    assert disk.lookup_length([1, 2, 3]) == 0
    disk.store_async(model, _prefilled(model, [1, 2, 3]))
    disk.flush()  # the write fails in the background, logged
    assert "cannot" in caplog.text


def _kv_names(head):
    arrays = head["arrays"]
    ks = sorted(n for n in arrays if n.startswith("kv.") and n.endswith(".k"))
    return ks[0], ks[0][:-1] + "v"


def test_swapped_k_and_v_offsets_are_detected(model, tmp_path, caplog):
    tokens = list(range(100, 130))
    disk, seq, entry = _one_entry(model, tmp_path, tokens)

    def swap(head):
        k, v = _kv_names(head)
        head["arrays"][k], head["arrays"][v] = head["arrays"][v], head["arrays"][k]
        return head

    _header_edit(entry, swap)
    with caplog.at_level(logging.WARNING, logger="q27py.prefix"):
        fresh = LiveSequence(model.new_state())
        assert not disk.load_into(model, fresh, tokens)
    assert "checksum" in caplog.text
    assert fresh.state.position == 0


def test_a_reshaped_array_is_refused_and_the_request_served_cold(model, tmp_path):
    tokens = list(range(140, 170))
    disk, seq, entry = _one_entry(model, tmp_path, tokens)

    def reshape(head):
        name = next(n for n in head["arrays"] if n.endswith(".recurrent"))
        meta = head["arrays"][name]
        if isinstance(meta, dict):
            meta["shape"] = [meta["shape"][1], meta["shape"][0], *meta["shape"][2:]]
        else:  # v1: (dtype, shape, offset, size)
            meta[1] = [meta[1][1], meta[1][0], *meta[1][2:]]
        return head

    _header_edit(entry, reshape)
    cache = PrefixCache(model, max_sequences=1, checkpoint_every=0, disk=disk)
    for _ in range(2):  # refused every time, never an exception
        slot, reused = cache.acquire(tokens + [3, 4])
        assert reused == 0 and slot.state.position == 0
        cache.release(slot, [])
    assert disk.rejected >= 1


def test_checksummed_entry_with_the_wrong_shapes_serves_cold(model, tmp_path, caplog):
    """Even a well-formed entry whose arrays do not fit this model's state (a hand-made file,
    or another build that wrote the same compat) is refused before the state is touched."""
    from q27py.engine.prefix_cache import _key
    from q27py.io import prefix_entry

    tokens = list(range(180, 200))
    arrays = model.export_prefix(_prefilled(model, tokens).state)
    name = next(n for n in arrays if n.endswith(".recurrent"))
    arrays[name] = arrays[name].reshape(arrays[name].shape[1], arrays[name].shape[0], *arrays[name].shape[2:])
    arrays["tokens"] = np.asarray(tokens, dtype=np.int32)
    (tmp_path / f"{_key(tokens)}.q27p").write_bytes(prefix_entry.encode("c", arrays))
    disk = DiskCache(tmp_path, compat="c", min_tokens=1)
    assert disk.lookup_length(tokens + [1]) == len(tokens)
    cache = PrefixCache(model, max_sequences=1, checkpoint_every=0, disk=disk)
    with caplog.at_level(logging.WARNING, logger="q27py.prefix"):
        slot, reused = cache.acquire(tokens + [1])
    assert reused == 0 and slot.state.position == 0 and name in caplog.text
    model.forward(slot.state, tokens + [1])  # the slot is a clean cold state
    cache.release(slot, tokens + [1])
    assert disk.lookup_length(tokens + [1]) == 0  # refused once: not offered again this run


def test_version_1_entries_are_ignored(model, tmp_path, caplog):
    import json
    import struct

    from q27py.engine.prefix_cache import _key

    tokens = list(range(5, 25))
    head = json.dumps({"version": 1, "compat": "c", "n_tokens": len(tokens), "sha256": "0", "arrays": {}}).encode()
    (tmp_path / f"{_key(tokens)}.q27p").write_bytes(b"Q27PREFX" + struct.pack("<Q", len(head)) + head)
    with caplog.at_level(logging.WARNING, logger="q27py.prefix"):
        disk = DiskCache(tmp_path, compat="c", min_tokens=1)
    assert disk.lookup_length(tokens + [1]) == 0
    assert "bad magic" in caplog.text
