"""A stand-in model that records the pieces prefill_steps feeds it (test_prefill_grid, test_batched_rounds)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from q27py.engine.decoder import drive, prefill_steps


class Recorder:
    chunk = None  # splits nothing itself

    def __init__(self):
        self.pieces = []
        self.rows = []  # logits_rows of each forward

    def forward(self, state, ids, logits_rows="last"):
        self.pieces.append(len(ids))
        self.rows.append(logits_rows)
        state.position += len(ids)
        hidden = np.zeros((len(ids), 2), np.float32)
        return SimpleNamespace(hidden=hidden, hidden_owned=lambda wait=True: hidden, logits=np.zeros((1, 3), np.float32))


def pieces(n=1000, chunk=256, breaks=None, pace=None) -> list[int]:
    """The piece sizes of one prefill of n tokens from position 0."""
    model, state = Recorder(), SimpleNamespace(position=0, hidden_last=None)
    drive(prefill_steps(model, state, list(range(n)), chunk, breaks=breaks, pace=pace))
    return model.pieces
