"""Snapshots past the device budget (FastModel.save_recurrent -> HostSnapshot): CPU test, stub model.

Why: the device snapshot budget (FastModel.device_snapshot_bytes, 4 GiB on an H200: ~26 of the 27B's 151 MB GDN
states) is shared by every sequence and engine of the process, so a server that keeps idle sequences for prefix
reuse fills it, and from then on every checkpoint of a new prompt (one per 4,096 tokens) was a pageable `.get()`:
a stream synchronize and ~80 ms of the host's time per snapshot, with the prefill's next piece not yet queued.
Now the copy is queued on the model's stream into pinned memory and the host goes on; a reader waits for it.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from q27py.gpu.forward import FastModel, HostSnapshot


class _Event:
    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("event.synchronize")


class _Stream:
    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("stream.synchronize")

    def record(self):
        self.log.append("record")
        return _Event(self.log)


class _Dev:
    """A device array stand-in: get() copies into `out` and records how it was asked to."""

    def __init__(self, data, log):
        self.data, self.log = data, log
        self.nbytes, self.size, self.shape, self.dtype = data.nbytes, data.size, data.shape, data.dtype

    def get(self, stream=None, out=None, blocking=True, **kw):
        self.log.append(("get", stream is not None, out is not None, blocking))
        if out is None:
            return self.data.copy()
        out[...] = self.data
        return out


def _model(log):
    cp = SimpleNamespace(cuda=SimpleNamespace(alloc_pinned_memory=lambda n: bytearray(n)))
    return SimpleNamespace(rt=SimpleNamespace(cp=cp), stream=_Stream(log), device_snapshot_bytes=0,
                           pinned_snapshot_bytes=1 << 20)


def test_a_host_snapshot_does_not_block_the_host_until_read():
    log = []
    m = _model(log)
    gdn = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    win = np.arange(6, dtype=np.float32).reshape(2, 3) * -1
    st = SimpleNamespace(gdn=_Dev(gdn, log), window=_Dev(win, log))
    snap = FastModel.save_recurrent(m, st)
    assert isinstance(snap, HostSnapshot)
    # the copies were queued on the model's stream, asynchronously, into buffers of their own; nothing waited
    assert log == [("get", True, True, False), ("get", True, True, False), "record"]
    # reading waits for the copies once, then returns them
    np.testing.assert_array_equal(snap["gdn"], gdn)
    np.testing.assert_array_equal(snap["window"], win)
    assert log.count("event.synchronize") == 1 and "stream.synchronize" not in log
    assert sorted(snap) == ["gdn", "window"]


def test_values_and_items_wait_too():
    log = []
    snap = HostSnapshot({"gdn": np.zeros(2)}, _Event(log))
    list(snap.items())
    assert log == ["event.synchronize"]
    snap2 = HostSnapshot({"gdn": np.zeros(2)}, _Event(log))
    list(snap2.values())
    assert log == ["event.synchronize"] * 2


def test_past_the_pinned_budget_snapshots_are_pageable_and_the_budget_frees():
    """Page-locked memory is the OS's for good: pinned snapshots stop at FastModel.pinned_snapshot_bytes and the
    rest are plain host copies (the stream synchronized first); a dropped HostSnapshot gives its bytes back."""
    log = []
    m = _model(log)
    m.pinned_snapshot_bytes = 200  # one 96 + 24 byte snapshot fits, a second does not
    st = SimpleNamespace(gdn=_Dev(np.zeros((2, 3, 4), np.float32), log), window=_Dev(np.ones((2, 3), np.float32), log))
    base = HostSnapshot.live_bytes
    first = FastModel.save_recurrent(m, st)
    assert isinstance(first, HostSnapshot) and HostSnapshot.live_bytes == base + 120
    log.clear()
    second = FastModel.save_recurrent(m, st)
    assert not isinstance(second, HostSnapshot) and log[0] == "stream.synchronize"
    assert all(entry[3] for entry in log[1:])  # blocking copies
    del first
    assert HostSnapshot.live_bytes == base
    assert isinstance(FastModel.save_recurrent(m, st), HostSnapshot)
