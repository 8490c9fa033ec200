"""What the GemvPlan launch-shape tests (test_gemv_branch.py, test_gemv_merge.py, the folds, the MLP walk) run: a
4-layer model of the 27B's heads (3 GDN layers, 1 attention layer; q4s, the gates bf16 as the tier keeps them), a
sequence of its rounds -- a prefill, then decode steps, verify rounds and commits -- whose logits and final state a
switch must not change, and the launch counts of a decode step and a 2-lane verify."""

from __future__ import annotations

import dataclasses


def heads27b(graphs: bool, hidden: int | None = None, seed: int = 5, intermediate: int = 1024):
    """hidden None: the 27B's own (5,120); the MLP small unless intermediate says (the 27B's: 17,408)."""
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import random_weights
    from q27py.model.config import FULL, LINEAR, qwen36_27b_config

    base = qwen36_27b_config()
    cfg = dataclasses.replace(base, vocab_size=4096, hidden_size=hidden or base.hidden_size, intermediate_size=intermediate,
                              num_hidden_layers=4, layer_types=(LINEAR, LINEAR, LINEAR, FULL), mtp_num_hidden_layers=0,
                              max_position_embeddings=4096)
    m = FastModel(random_weights(cfg, "q4s", seed=seed, with_mtp=False), max_context=2048, kv_dtype="bf16", chunk=64)
    if graphs:
        m.enable_graphs()
    return m


def rounds(m, ids, widths=(2, 4, 6, 8)):
    """Logits of a prefill of ids, then per width a decode step, a verify round of that many drafts and a commit
    (under graphs: eager, capture, replays), and the final GDN state and conv window."""
    st = m.new_state()
    out = [m.forward(st, ids, logits_rows="last").logits]
    for step, w in enumerate(widths):
        out.append(m.forward(st, [40 + step]).logits)
        drafts = [50 + step + i for i in range(w)]
        v = m.forward(st, drafts, verify=True)
        out.append(v.logits)
        m.commit(st, v.trace, 1 + step % len(drafts))
    out += [st.gdn.get(), st.window.get()]
    return out


def decode_counts(m):
    """Launch counts of one decode step and of a 2-lane verify, after a short prefill."""
    from q27py.gpu.runtime import Runtime

    st = m.new_state()
    m.forward(st, [1, 2, 3], logits_rows="last")
    with Runtime.get().count_launches() as dec:
        m.forward(st, [4])
    with Runtime.get().count_launches() as ver:
        m.forward(st, [5, 6], verify=True)
    return dec, ver


def normed_rows(m, ids):
    """self.x after a decode step: the last layer's post-attention / MLP norm (NORM_FOLD: the row-group-0 CTAs' rows;
    NORM_TAIL: the out projection's last CTA's)."""
    st = m.new_state()
    m.forward(st, ids, logits_rows="last")
    m.forward(st, [7])
    return m.x.get()[:1, : m.cfg.hidden_size].copy()
