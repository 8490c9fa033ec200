"""Device-resident speculation pieces of the fast path: the MTP ladder chained on the device
(FastModel.mtp_draft_chain) and device argmax ids (FastOutput.greedy_ids) give exactly what the
host computes from downloaded logits -- drafts bitwise, ids bitwise, margins to rounding."""

from __future__ import annotations

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=[False, True], ids=["eager", "graphs"])
def model(request):
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint
    from q27py.io.checkpoint import Checkpoint

    m = FastModel(from_checkpoint(Checkpoint.open(DEFAULT_MODEL_DIR), "bf16", progress=False), max_context=512,
                  kv_dtype="f32", chunk=64)
    if request.param:
        m.enable_graphs()
    return m


def host_ladder(model, kv, rows, next_ids, start, depth):
    logits, hm = model.mtp_forward(kv, rows, next_ids, start, logits_rows="last")
    ids, margins, h, lg = [], [], hm[-1:], logits[-1]
    position = start + len(next_ids)
    for k in range(depth):
        top = np.sort(lg)[-2:]
        ids.append(int(np.argmax(lg)))
        margins.append(float(top[1] - top[0]))
        if k + 1 < depth:
            out, h = model.mtp_forward(kv, h, [ids[-1]], position - 1 + len(ids))
            lg = out[0]
    return np.array(ids), np.array(margins)


@pytest.mark.parametrize("backlog", [1, 3, 12])  # <= 16: one MTP pass for step 0 on both paths
def test_mtp_draft_chain_equals_host_ladder(model, backlog):
    rng = np.random.default_rng(backlog)
    ids = rng.integers(0, model.cfg.vocab_size, 40)
    for depth in (1, 3, 5):
        want_state = model.new_state()
        got_state = model.new_state()
        res = {}
        for st, key in ((want_state, "host"), (got_state, "dev")):
            out = model.forward(st, ids, logits_rows="last")
            hid = out.hidden
            start = len(ids) - backlog
            model.mtp_forward(st.mtp_kv, hid[: start], ids[1 : start + 1], 0, logits_rows="none")
            nxt = np.concatenate([ids[start + 1 :], [5]])
            if key == "host":
                res[key] = host_ladder(model, st.mtp_kv, hid[start:], nxt, start, depth)
            else:
                for _ in range(2):  # second call replays the captured graph (when graphs are on)
                    st.mtp_kv.truncate(start)
                    res[key] = model.mtp_draft_chain(st.mtp_kv, hid[start:], nxt, start, depth)
            assert st.mtp_kv.length == len(ids) + depth - 1
        np.testing.assert_array_equal(res["dev"][0], res["host"][0])
        np.testing.assert_allclose(res["dev"][1], res["host"][1], rtol=1e-5, atol=1e-5)


def test_greedy_ids_are_numpy_argmax(model):
    rng = np.random.default_rng(9)
    ids = rng.integers(0, model.cfg.vocab_size, 30)
    st = model.new_state()
    model.forward(st, ids, logits_rows="last")
    out = model.forward(st, [3, 4, 5, 6], logits_rows="all", verify=True)
    dev = out.greedy_ids()
    np.testing.assert_array_equal(dev, np.argmax(out.logits, axis=1))
    model.commit(st, out.trace, 2)
    out2 = model.forward(st, [1, 2], logits_rows=[1])
    with pytest.raises(RuntimeError):
        _ = out.hidden  # not read before the next forward: a stale output refuses
    assert out2.greedy_ids().shape == (1,)


def test_graphs_are_released_with_their_state(model):
    import gc

    if model.graphs is None:
        pytest.skip("graphs off")
    st = model.new_state()
    sid = st.id
    model.forward(st, [1, 2, 3], logits_rows="last")
    for t in range(3):  # the second decode step is captured
        model.forward(st, [4 + t])
    assert any(k[0] == sid for k in model.graphs.graphs)
    del st
    gc.collect()
    assert not any(k[0] == sid for k in model.graphs.graphs)
    assert not any(k[0] == sid for k in model.graphs.seen)
