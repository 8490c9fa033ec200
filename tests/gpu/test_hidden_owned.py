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


def test_unwaited_rows_read_right_through_host_rows_and_concat_rows(model):
    """hidden_owned(wait=False) (the prefill's pieces: the host does not wait for each piece) queues the
    copy on the model's stream only; the host readers synchronize first, so they read the rows' bits
    even with the next forward already queued."""
    from q27py.engine.decoder import host_rows
    from q27py.engine.drafters import concat_rows

    rng = np.random.default_rng(2)
    st = model.new_state()
    a = model.forward(st, rng.integers(0, model.cfg.vocab_size, 200), logits_rows="none")
    want_a = a.hidden.copy()
    rows_a = model.forward(model.new_state(), rng.integers(0, model.cfg.vocab_size, 200), logits_rows="none")
    want_b = rows_a.hidden.copy()
    owned_b = rows_a.hidden_owned(wait=False)
    nxt = model.forward(st, rng.integers(0, model.cfg.vocab_size, 300), logits_rows="none")  # queued behind
    owned_c = nxt.hidden_owned(wait=False)
    np.testing.assert_array_equal(host_rows(owned_b), want_b)
    both = concat_rows([owned_b, owned_c])
    np.testing.assert_array_equal(both.get()[:200], want_b)
    np.testing.assert_array_equal(both.get()[200:], nxt.hidden)
    assert want_a.shape == (200, model.cfg.hidden_size)


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
