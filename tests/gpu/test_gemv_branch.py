"""constants GEMV_BRANCH (GemvPlan.branches, Runtime.side_branch): a plan's first launch (the GDN layer's bf16 decay /
beta gates, attention's q8 kv) on a side branch beside the plan's other launches instead of ahead of them in the chain. The same kernels
with the same arguments, so the same bits: the 27B heads' q4s model (the gates bf16, as the tier keeps them) decoding,
verifying and committing, eager and as graph replays, branch on against branch off; and the branch only where it
applies (a plan of several launches, one block of at most 16 lanes).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def heads27b(graphs: bool):
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import random_weights
    from q27py.model.config import FULL, LINEAR, qwen36_27b_config

    cfg = dataclasses.replace(qwen36_27b_config(), vocab_size=4096, hidden_size=512, intermediate_size=1024,
                              num_hidden_layers=4, layer_types=(LINEAR, LINEAR, LINEAR, FULL), mtp_num_hidden_layers=0,
                              max_position_embeddings=4096)
    m = FastModel(random_weights(cfg, "q4s", seed=5, with_mtp=False), max_context=2048, kv_dtype="bf16", chunk=64)
    if graphs:
        m.enable_graphs()
    return m


def run(m, ids):
    st = m.new_state()
    out = [m.forward(st, ids, logits_rows="last").logits]
    for step in range(4):  # graphs: eager, capture, replays
        out.append(m.forward(st, [40 + step]).logits)
        drafts = [50 + step, 51, 52, 53, 54, 55, 56, 57][: 2 + 2 * step]
        v = m.forward(st, drafts, verify=True)
        out.append(v.logits)
        m.commit(st, v.trace, 1 + step % len(drafts))
    out += [st.gdn.get(), st.window.get()]
    return out


@pytest.mark.parametrize("graphs", [False, True])
def test_branch_keeps_the_bits(graphs, monkeypatch):
    from q27py.gpu import constants as C

    ids = [int(x) for x in np.random.default_rng(1).integers(0, 4096, 70)]
    got = {}
    for b in (0, 1):
        monkeypatch.setattr(C, "GEMV_BRANCH", b)
        m = heads27b(graphs)
        plan = m.layer_plans[0]["in"]
        assert plan.branches(1) == bool(b) and plan.branches(16) == bool(b)
        assert not plan.branches(17) and not m.layer_plans[0]["up"].branches(1)
        assert m.layer_plans[3]["in"].branches(1) == bool(b)  # attention: kv (q8) beside q (q4)
        got[b] = run(m, ids)
    for a, c in zip(got[0], got[1]):
        np.testing.assert_array_equal(a, c)
