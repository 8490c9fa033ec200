"""FastOutput's host reads are ordered after the forward that wrote the rows (CPU test, stub model).

Why: the model runs on its own non-blocking stream (FastModel.stream). A cupy `.get()` with no stream copies on
the current stream -- the legacy default stream, which does not wait for a non-blocking one -- so a host read of
rows a forward is still writing returns stale bytes. The device found it (2026-12-05, H100, `test_mtp_draft_batch_gpu
test_on_27b_heads`: two fresh states prefilled with one prompt, the first 128 hidden rows of the first one stale,
read while its first, slow, eager and captured chunks were still running). Every download goes through the
model's stream with cupy's blocking get (the stream's work first, then the copy).
"""

from __future__ import annotations

import numpy as np

from q27py.gpu.forward import FastOutput


class _Rows:
    """A device array stand-in: slicing keeps it, get() records the stream it was asked to copy on."""

    def __init__(self, data, log):
        self.data, self.log = data, log

    def __getitem__(self, key):
        return _Rows(self.data[key], self.log)

    def get(self, stream=None, **kw):
        self.log.append(stream)
        return self.data.copy()


class _Model:
    def __init__(self):
        self.log = []
        self.stream = object()
        self.hidden = _Rows(np.arange(24, dtype=np.float32).reshape(4, 6), self.log)
        self.cfg = type("Cfg", (), {"hidden_size": 5})()
        self._out_serial = 3


def test_hidden_is_read_on_the_models_stream():
    m = _Model()
    out = FastOutput(m, 3, np.arange(3), None)
    got = out.hidden
    assert m.log == [m.stream], "the hidden rows must be copied on the model's stream"
    np.testing.assert_array_equal(got, np.arange(24, dtype=np.float32).reshape(4, 6)[:3, :5])
    assert out.hidden is got and m.log == [m.stream]  # downloaded once
