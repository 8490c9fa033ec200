"""The prefill's hidden rows stay on the device (ForwardOutput.hidden_owned, engine.decoder.prefill_steps):
the fast path hands each chunk's rows to the MTP warm-up as a device copy instead of a download and an
upload. The copy is the rows' bits, outlives the next forward, and the MTP rows it writes are those the
host round trip wrote: the same drafts and the same first-token logits."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    from q27py import DEFAULT_MODEL_DIR
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint

    return FastModel(from_checkpoint(Checkpoint.open(DEFAULT_MODEL_DIR), "bf16", progress=False), max_context=1024,
                     chunk=512)


def test_hidden_owned_is_the_rows_and_outlives_the_next_forward(model):
    import cupy as cp

    rng = np.random.default_rng(0)
    st = model.new_state()
    out = model.forward(st, rng.integers(0, model.cfg.vocab_size, 77), logits_rows="last")
    owned = out.hidden_owned()
    assert isinstance(owned, cp.ndarray) and owned.shape == (77, model.cfg.hidden_size)
    want = out.hidden.copy()
    np.testing.assert_array_equal(owned.get(), want)
    model.forward(model.new_state(), rng.integers(0, model.cfg.vocab_size, 90), logits_rows="last")
    np.testing.assert_array_equal(owned.get(), want)  # the scratch moved on, the copy did not


def test_prefill_mtp_warmup_from_device_rows_matches_the_host_round_trip(model):
    from q27py.engine.decoder import drive, host_rows, prefill_steps
    from q27py.engine.drafters import MTPLadder

    rng = np.random.default_rng(1)
    ids = [int(v) for v in rng.integers(0, model.cfg.vocab_size, 300)]

    def run(on_device: bool):
        st = model.new_state()
        ladder = MTPLadder(model, st.mtp_kv)
        kinds = []

        def warm(start, piece, hidden):  # engine/spec.py's warm-up
            kinds.append(type(hidden).__module__.split(".")[0])
            if not on_device:
                hidden = host_rows(hidden)
            end = start + len(piece)
            known = len(piece) if end < len(ids) else len(piece) - 1
            ladder.defer(hidden[:known], ids[start + 1 : start + 1 + known])
            ladder.flush()

        last = drive(prefill_steps(model, st, ids, 128, on_chunk=warm))  # 3 pieces: 128, 128, 44
        pending = int(np.argmax(last))
        ladder.defer(st.hidden_last, [pending])
        draft = ladder.draft(4, -1e30, st.position)
        return last.copy(), st.hidden_last.copy(), draft.tokens, kinds

    host, dev = run(False), run(True)
    assert dev[3] == ["cupy"] * 3  # the fast path's rows are device arrays
    np.testing.assert_array_equal(host[0], dev[0])
    np.testing.assert_array_equal(host[1], dev[1])
    assert len(dev[2]) == 4 and host[2] == dev[2]
