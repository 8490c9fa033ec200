"""model.decode_batch on the CPU paths (the contract the CUDA FastModel meets too): B distinct states,
one token each, commit mode; each state ends bitwise where forward(state, [id]) leaves it, and each
output is that forward's output (logits [1, V], hidden [1, H], trace None)."""

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.model.fastcpu import FastCPUModel
from q27py.model.reference import ReferenceModel

PROMPTS = ([727, 15336, 263, 4327, 72], [1393, 1590, 198, 257, 262, 4071, 198, 262, 2604], [264], [491, 491, 3245, 11])


def state_bytes(st):
    out = [str(st.position).encode()]
    for i, kv in sorted(st.kv.items()):
        out += [kv.k[: kv.length].tobytes(), kv.v[: kv.length].tobytes()]
    for i, g in sorted(st.gdn.items()):
        out += [g.recurrent.tobytes(), g.conv.tobytes()]
    return out


@pytest.mark.parametrize("cls", [FastCPUModel, ReferenceModel])
def test_decode_batch_is_bitwise_the_solo_forwards(cls):
    model = cls.load(DEFAULT_MODEL_DIR)
    assert model.max_batch >= 4
    batch = [model.new_state() for _ in PROMPTS]
    solo = [model.new_state() for _ in PROMPTS]
    for a, b, p in zip(batch, solo, PROMPTS):  # different positions
        model.forward(a, p, logits_rows="last")
        model.forward(b, p, logits_rows="last")
    ids = [17, 4000, 5, 17]
    for step in range(3):
        outs = model.decode_batch(batch, ids)
        refs = [model.forward(st, [t]) for st, t in zip(solo, ids)]
        for o, r, a, b in zip(outs, refs, batch, solo):
            assert o.logits.shape == (1, model.cfg.vocab_size) and o.hidden.shape == (1, model.cfg.hidden_size)
            assert o.trace is None
            assert o.logits.tobytes() == r.logits.tobytes() and o.hidden.tobytes() == r.hidden.tobytes()
            assert state_bytes(a) == state_bytes(b)
        ids = [int(np.argmax(o.logits[0])) for o in outs]


def test_decode_batch_refuses_what_it_cannot_do():
    model = FastCPUModel.load(DEFAULT_MODEL_DIR)
    st = model.new_state()
    model.forward(st, [1, 2, 3], logits_rows="last")
    with pytest.raises(ValueError, match="twice"):
        model.decode_batch([st, st], [1, 2])  # one sequence cannot take two steps in one batch
    with pytest.raises(ValueError, match="ids"):
        model.decode_batch([st], [1, 2])
    with pytest.raises(ValueError, match="max_batch"):
        model.decode_batch([model.new_state() for _ in range(model.max_batch + 1)], [1] * (model.max_batch + 1))
    assert st.position == 3  # nothing ran
