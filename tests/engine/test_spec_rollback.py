"""The rollback proof: after a verify of W lanes and commit(n), the state is that of n plain
decode steps, bitwise, for every array of the SequenceState (reference path, bundled model)."""

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.model.reference import ReferenceModel
from q27py.model.state import SequenceState


@pytest.fixture(scope="module")
def model():
    return ReferenceModel.load(DEFAULT_MODEL_DIR)


PROMPT = [727, 15336, 263, 4327, 72, 1393, 1590, 198, 257, 262, 4071, 198, 262, 2604, 264, 491, 491, 3245, 11, 364]


def state_arrays(st: SequenceState) -> dict[str, bytes]:
    """Every piece of a state that decoding reads, as bytes (bitwise comparison, -0.0 != 0.0)."""
    out = {"position": str(st.position).encode()}
    for i, kv in st.kv.items():
        out[f"kv{i}.length"] = str(kv.length).encode()
        out[f"kv{i}.k"] = kv.k[: kv.length].tobytes()
        out[f"kv{i}.v"] = kv.v[: kv.length].tobytes()
    for i, g in st.gdn.items():
        out[f"gdn{i}.recurrent"] = g.recurrent.tobytes() + str(g.recurrent.dtype).encode()
        out[f"gdn{i}.conv"] = g.conv.tobytes() + str(g.conv.dtype).encode()
    if st.mtp_kv is not None:
        out["mtp.length"] = str(st.mtp_kv.length).encode()
        out["mtp.k"] = st.mtp_kv.k[: st.mtp_kv.length].tobytes()
        out["mtp.v"] = st.mtp_kv.v[: st.mtp_kv.length].tobytes()
    return out


def assert_same_state(a: SequenceState, b: SequenceState):
    sa, sb = state_arrays(a), state_arrays(b)
    assert sa.keys() == sb.keys()
    diff = [k for k in sa if sa[k] != sb[k]]
    assert not diff, f"state differs in {diff}"


@pytest.fixture(scope="module")
def prefilled(model):
    st = model.new_state()
    out = model.forward(st, PROMPT, logits_rows="last")
    return st, int(np.argmax(out.logits[-1]))


@pytest.mark.parametrize("width", [1, 2, 3, 5, 8, 12, 16])
def test_commit_n_equals_n_plain_steps(model, prefilled, width):
    base, pending = prefilled
    rng = np.random.default_rng(width)
    lanes = [pending] + rng.integers(0, model.cfg.vocab_size, size=width - 1).tolist()
    verified = base.snapshot()
    out = model.forward(verified, lanes, logits_rows="all", verify=True)
    # Verify left the committed GDN state and position alone.
    assert verified.position == base.position
    for i in base.gdn:
        assert verified.gdn[i].recurrent.tobytes() == base.gdn[i].recurrent.tobytes()
        assert verified.gdn[i].conv.tobytes() == base.gdn[i].conv.tobytes()
    plain = base.snapshot()
    for n in range(1, width + 1):
        step = model.forward(plain, [lanes[n - 1]])
        # Lane n-1 computed exactly what the plain step computes: the basis of exactness.
        assert out.logits[n - 1].tobytes() == step.logits[0].tobytes()
        assert out.hidden[n - 1].tobytes() == step.hidden[0].tobytes()
        committed = verified.snapshot()
        model.commit(committed, out.trace, n)
        assert_same_state(committed, plain)


def test_a_rejected_verify_leaves_nothing_behind(model, prefilled):
    """Verify, throw away, verify other tokens, commit: the first verify's rows are gone."""
    base, pending = prefilled
    st = base.snapshot()
    model.forward(st, [pending, 5, 6, 7, 8, 9], verify=True)
    out = model.forward(st, [pending, 11, 12], verify=True)
    model.commit(st, out.trace, 3)
    plain = base.snapshot()
    for tok in (pending, 11, 12):
        model.forward(plain, [tok])
    assert_same_state(st, plain)
    # ...and decoding on from both gives the same bits.
    a = model.forward(st, [13, 14], verify=True)
    b = model.forward(plain, [13, 14], verify=True)
    assert a.logits.tobytes() == b.logits.tobytes()


def test_chained_rounds_equal_plain_decoding(model, prefilled):
    """Several rounds with different widths and accept counts, as the decoder runs them."""
    base, pending = prefilled
    rng = np.random.default_rng(0)
    spec, plain = base.snapshot(), base.snapshot()
    tok = pending
    for width, n in [(4, 1), (6, 6), (3, 2), (16, 9), (1, 1), (8, 3)]:
        lanes = [tok] + rng.integers(0, model.cfg.vocab_size, size=width - 1).tolist()
        out = model.forward(spec, lanes, verify=True)
        model.commit(spec, out.trace, n)
        for t in lanes[:n]:
            model.forward(plain, [t])
        tok = int(rng.integers(0, model.cfg.vocab_size))
    assert_same_state(spec, plain)
