"""Recorded acceptance for the real engine on random weights (`bench load --traces FILE ...`).

Random 27B weights accept no drafts, so `bench load` used to run with speculation off, and what
the slot scheduler does with speculating streams (engine/share_policy.py: their own rounds in
turn or the shared sweep) could not be measured on the 27B shapes. TraceAcceptance wraps the
model so that each verify forward accepts the drafts as the trained model's recorded rounds did
(q27py/bench/data/spec_traces*.json, tools/record_traces.py): round i, whatever drafts the
engine's own ladder / suffix drafter offered, accepts min(recorded drafts accepted, offered) of
them. Everything else is the real engine: drafting (the MTP chain on the device), the verify
forward and commit, the scheduler, the policy, host time. Only greedy device picks are forced
(FastOutput.greedy_ids: what a plain greedy request reads), so the load bench's greedy streams
are what this is for; plain decode steps and plain shared lanes are untouched. A shared round's
verify groups (verify_batch: drafts in the sweep) are forced as solo verify forwards are, one recorded
round per group of two or more lanes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def recorded_acceptance(paths) -> list[int]:
    """Drafts accepted per decode round, in recorded order, over the given trace files (a round's
    "accepted" counts the tokens it committed: its accepted drafts plus the verify's own pick)."""
    out = []
    for path in paths:
        for prompt in json.loads(Path(path).read_text())["prompts"]:
            out += [max(0, int(r["accepted"]) - 1) for r in prompt["rounds"] if r.get("lanes", 1) > 0]
    if not out:
        raise ValueError("the traces hold no decode rounds")
    return out


class _Forced:
    """A verify output whose greedy picks accept the first `a` drafts and reject the next one."""

    def __init__(self, out, lanes: list[int], a: int, vocab: int):
        self._out = out
        # the fast path's device argmax, or numpy's over the host rows (the CPU paths: the same choice)
        base = out.greedy_ids() if hasattr(out, "greedy_ids") else np.argmax(np.asarray(out.logits), axis=-1)
        ids = np.array(base, copy=True)
        ids[:a] = lanes[1 : a + 1]
        if a + 1 < len(lanes) and int(ids[a]) == lanes[a + 1]:
            ids[a] = (lanes[a + 1] + 1) % vocab  # the draft after the accepted ones is rejected
        self._ids = ids

    def greedy_ids(self) -> np.ndarray:
        return self._ids

    def __getattr__(self, name):
        return getattr(self._out, name)


class TraceAcceptance:
    """The model, with every verify forward of two or more lanes accepting drafts as recorded."""

    def __init__(self, model, accepted: list[int]):
        self._m = model
        self._accepted = list(accepted)
        self._next = 0
        self.rounds = 0  # verify forwards forced
        self.drafts_offered = 0
        self.drafts_accepted = 0
        # what the forced rounds' records accepted before the cap by the drafts offered (drafts_accepted is
        # the capped sum): their gap is the speculation the engine's drafters left on the table beside the
        # trained model's; and verify lanes that carried no drafts (a shared group of one lane, a solo
        # verify of its pending token alone), which consume no recorded round
        self.drafts_recorded = 0
        self.undrafted = 0

    def __getattr__(self, name):
        return getattr(self._m, name)

    def forward(self, state, ids, logits_rows="all", verify: bool = False):
        out = self._m.forward(state, ids, logits_rows=logits_rows, verify=verify)
        if not verify:
            return out
        return self._force(out, [int(t) for t in np.asarray(ids).reshape(-1)])

    def verify_batch(self, states, groups):
        outs = self._m.verify_batch(states, groups)
        return [self._force(out, [int(t) for t in g]) for out, g in zip(outs, groups)]

    def _force(self, out, lanes: list[int]):
        """The next recorded round's acceptance on a verify output of `lanes` (one-lane ones untouched)."""
        if len(lanes) < 2:
            self.undrafted += 1
            return out
        recorded = self._accepted[self._next % len(self._accepted)]
        self.drafts_recorded += recorded
        a = min(recorded, len(lanes) - 1)
        self._next += 1
        self.rounds += 1
        self.drafts_offered += len(lanes) - 1
        self.drafts_accepted += a
        return _Forced(out, lanes, a, self._m.cfg.vocab_size)
