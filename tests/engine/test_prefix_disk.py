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
    seq.state.extra["hidden_last"] = out.hidden[-1]
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
