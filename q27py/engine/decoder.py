"""Decoding one sequence: prefill, then rounds that each commit one or more tokens.

This is the plain (non-speculative) decoder: one token per round. The
speculative decoder (engine/spec.py) keeps the same interface.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from q27py.engine.api import SamplingParams
from q27py.model.state import SequenceState


@dataclass
class DecodeStats:
    rounds: int = 0
    generated: int = 0
    trace: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "tokens_per_round": (self.generated / self.rounds) if self.rounds else 0.0,
        }


def greedy_pick(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


class Decoder:
    """Plain decoding: prefill in chunks, then one forward per token."""

    def __init__(self, model, prefill_chunk: int = 2048):
        self.model = model
        self.prefill_chunk = prefill_chunk

    def prefill(self, state: SequenceState, ids) -> np.ndarray:
        """Feed prompt tokens (in chunks); returns the logits of the last one."""
        ids = list(ids)
        assert ids, "prefill needs at least one token"
        last = None
        for i in range(0, len(ids), self.prefill_chunk):
            last = self.model.forward(state, ids[i : i + self.prefill_chunk], logits_rows="last").logits[-1]
        return last

    def run(
        self,
        state: SequenceState,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids=frozenset(),
        cancel: threading.Event | None = None,
        stats: DecodeStats | None = None,
    ) -> Iterator[list[int]]:
        """Yield the tokens committed by each round until a stop id, max_tokens or cancel."""
        if sampling.temperature > 0:
            raise NotImplementedError("sampling needs the speculative decoder (engine/spec.py)")
        stats = stats if stats is not None else DecodeStats()
        logits = self.prefill(state, prompt_ids)
        produced = 0
        while produced < max_tokens and not (cancel is not None and cancel.is_set()):
            tok = greedy_pick(logits)
            produced += 1
            stats.rounds += 1
            stats.generated += 1
            yield [tok]
            if tok in stop_ids or produced >= max_tokens:
                return
            logits = self.model.forward(state, [tok]).logits[-1]
