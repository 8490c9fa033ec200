"""Recorded acceptance for the real engine on random weights (`bench load --traces FILE ...`).

Random 27B weights accept no drafts, so `bench load` used to run with speculation off, and what
the slot scheduler does with speculating streams (engine/share_policy.py: their own rounds in
turn or the shared sweep) could not be measured on the 27B shapes. TraceAcceptance wraps the
model so that each verify forward accepts the drafts as the trained model's recorded rounds did
(q27py/bench/data/spec_traces*.json, tools/record_traces.py): round i accepts min(recorded drafts
accepted, offered) of the drafts offered. Everything else is the real engine: drafting (the MTP
chain on the device), the verify forward and commit, the scheduler, the policy, host time. Only
greedy device picks are forced (FastOutput.greedy_ids: what a plain greedy request reads), so the
load bench's greedy streams are what this is for; plain decode steps and plain shared lanes are
untouched. A shared round's verify groups (verify_batch: drafts in the sweep) are forced as solo
verify forwards are, one recorded round per group of two or more lanes.

Draft widths (issue 15): on random-weight text the engine's own planner offers about half the drafts
the records did -- the suffix drafter finds no earlier match in it, so no round takes the 7-draft
suffix proposals that ~40% of the recorded rounds were (the ladder's depth-3 chains are all that is
left), and 4 zero-acceptance records in a row pause the ladder. `drive_widths` therefore gives each
request a TracePlanner (SpecDecoder.planner_factory): each round takes the next record and offers its
width, through the request's real drafters -- an MTP round runs the ladder to the record's depth (the
MTP chain on the device, as the engine would for that width), a suffix round runs the suffix index's
lookup and, when the record's round ran the "agree" check, the ladder's check chain (as deep as the
engine runs it), then offers the record's count of drafts (the proposal, padded with the ladder's ids:
acceptance is forced, so their values do not matter). The verify of that round is forced with that
same record's acceptance (records are paired with rounds by the request's state). What the engine caps
stays capped: a shared round's lane share (Pace.lanes), the tokens left, the verify width and the
ladder's depth ceiling (counted as `drafts_cut`).
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from q27py.engine.drafters import MTP, NONE, SUFFIX, Draft, DraftPlanner, LadderAsk


@dataclass(frozen=True)
class Round:
    """One recorded decode round: its drafter (mtp | suffix | none; "" for a bare acceptance count, whose
    shape is unknown), the drafts it offered, how many of them were accepted, and its MTP layer passes."""

    source: str
    drafts: int
    accepted: int
    mtp_steps: int = 0


def recorded_rounds(paths) -> list[Round]:
    """The decode rounds, in recorded order, over the given trace files (the first token's round, zero
    lanes, is not one; a round's "accepted" counts the tokens it committed: its accepted drafts plus the
    verify's own pick)."""
    out = []
    for path in paths:
        for prompt in json.loads(Path(path).read_text())["prompts"]:
            for r in prompt["rounds"]:
                if r.get("lanes", 1) > 0:
                    accepted = max(0, int(r["accepted"]) - 1)
                    out.append(Round(str(r.get("source", "")), max(len(r.get("drafts", [])), accepted), accepted,
                                     int(r.get("mtp_steps", 0))))
    if not out:
        raise ValueError("the traces hold no decode rounds")
    return out


def recorded_acceptance(paths) -> list[int]:
    """Drafts accepted per decode round, in recorded order, over the given trace files."""
    return [r.accepted for r in recorded_rounds(paths)]


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
    """The model, with every verify forward of two or more lanes accepting drafts as recorded.

    `records`: Rounds (recorded_rounds), or bare acceptance counts (recorded_acceptance; then the forced
    rounds' widths are the engine's own, and drive_widths is refused). Records are taken in order, one
    per forced verify -- or, with drive_widths, one per round a TracePlanner plans, and that round's
    verify (a solo forward or its group of a verify_batch: the same sequence state) is forced with it."""

    def __init__(self, model, records):
        self._m = model
        self._records = [r if isinstance(r, Round) else Round("", int(r), int(r)) for r in records]
        if not self._records:
            raise ValueError("no recorded rounds")
        self._next = 0
        # id(state) -> (the state, or a weak reference to it; the record its planned round drew). The state is
        # checked on the way out: a state that went away before its verify (a cancelled request) must not hand
        # its record to a new one that the allocator put at the same address.
        self._pending: dict[int, tuple[object, Round]] = {}
        self.recorded_widths = False  # drive_widths: each round offers its record's draft count
        self.rounds = 0  # verify forwards forced
        self.drafts_offered = 0
        self.drafts_accepted = 0
        # what the forced rounds' records accepted before the cap by the drafts offered (drafts_accepted is
        # the capped sum): their gap is the speculation the engine's drafters left on the table beside the
        # trained model's; and verify lanes that carried no drafts (a shared group of one lane, a solo
        # verify of its pending token alone), which consume no recorded round
        self.drafts_recorded = 0
        self.undrafted = 0
        # the drafts the forced rounds' records offered (the trained model's widths: drafts_offered's mark),
        # and, with drive_widths, the rounds planned from records and the recorded drafts the engine's caps
        # cut from them (a shared round's lane share, the tokens left, the ladder's depth ceiling)
        self.drafts_recorded_offered = 0
        self.rounds_planned = 0
        self.drafts_cut = 0

    def __getattr__(self, name):
        return getattr(self._m, name)

    def _take(self) -> Round:
        rec = self._records[self._next % len(self._records)]
        self._next += 1
        return rec

    def forward(self, state, ids, logits_rows="all", verify: bool = False):
        out = self._m.forward(state, ids, logits_rows=logits_rows, verify=verify)
        if not verify:
            return out
        return self._force(state, out, [int(t) for t in np.asarray(ids).reshape(-1)])

    def verify_batch(self, states, groups):
        outs = self._m.verify_batch(states, groups)
        return [self._force(st, out, [int(t) for t in g]) for st, out, g in zip(states, outs, groups)]

    def _force(self, state, out, lanes: list[int]):
        """The recorded round's acceptance on a verify output of `lanes` (one-lane ones untouched): the
        record this state's planned round drew, else the next one."""
        rec = self._pop_pending(state)
        if len(lanes) < 2:
            self.undrafted += 1
            return out
        if rec is None:
            rec = self._take()
        offered = len(lanes) - 1
        a = min(rec.accepted, offered)
        self.rounds += 1
        self.drafts_offered += offered
        self.drafts_accepted += a
        self.drafts_recorded += rec.accepted
        self.drafts_recorded_offered += rec.drafts
        return _Forced(out, lanes, a, self._m.cfg.vocab_size)

    # --- recorded widths (drive_widths): the planner side -----------------------------------------------

    def drive_widths(self, decoder) -> None:
        """Make `decoder` (the engine's SpecDecoder) plan every round from the records: its requests get
        TracePlanners (SpecDecoder.planner_factory)."""
        if not hasattr(decoder, "planner_factory"):
            raise ValueError("recorded draft widths need the speculative decoder (speculation is off)")
        if any(not r.source for r in self._records):
            raise ValueError("recorded draft widths need whole rounds (recorded_rounds), not acceptance counts")
        decoder.planner_factory = self.planner
        self.recorded_widths = True

    def planner(self, cfg, ladder, suffix, state) -> "TracePlanner":
        """SpecDecoder.planner_factory: one request's planner."""
        return TracePlanner(cfg, ladder, suffix, self, state)

    def plan_record(self, state) -> Round:
        """The next record, for the round `state`'s planner is planning (its verify is forced with it)."""
        rec = self._take()
        try:
            ref = weakref.ref(state)
        except TypeError:  # no weak references: hold the state itself (its address then stays its own)
            ref = lambda s=state: s  # noqa: E731
        self._pending[id(state)] = (ref, rec)
        self.rounds_planned += 1
        return rec

    def _pop_pending(self, state) -> Round | None:
        """The record `state`'s planned round drew, if this very state planned one (see _pending)."""
        entry = self._pending.pop(id(state), None)
        if entry is None or entry[0]() is not state:
            return None
        return entry[1]

    def forget(self, state) -> None:
        """`state`'s next round plans no drafts (no lane for them): it draws no record."""
        self._pop_pending(state)


def _fill(tokens: list[int], k: int, more: list[int]) -> list[int]:
    """k draft ids: `tokens`, then `more`, then the last of them repeated (0 when there is none)."""
    out = (list(tokens) + list(more))[:k]
    return out + [out[-1] if out else 0] * (k - len(out))


class TracePlanner(DraftPlanner):
    """A request's DraftPlanner that offers each round the width of the next recorded round, through the
    request's own drafters (TraceAcceptance.drive_widths; module docstring). What the engine's planner
    does besides is kept: the suffix index's lookup every round (host time), the depth controller and the
    ladder's pause fed by what verification accepts (DraftPlanner.observe), and the lane share a shared
    round asks for (DraftPlanner.wanted: the whole width after a suffix round, as after a proposal)."""

    def __init__(self, cfg, ladder, suffix, trace: TraceAcceptance, state):
        super().__init__(cfg, ladder, suffix)
        self._trace = trace
        self._state = state

    def plan_steps(self, max_drafts: int, position: int):
        if max_drafts <= 0:
            self._trace.forget(self._state)
            return Draft(NONE)
        proposal: list[int] = []
        if self.suffix is not None:
            proposal, _ = self.suffix.propose(max_drafts, self.cfg.suffix_min_match)
        rec = self._trace.plan_record(self._state)
        self.last_proposal = rec.drafts if rec.source == SUFFIX else 0
        k = min(rec.drafts, max_drafts)
        draft = Draft(NONE)
        if rec.source == MTP and k > 0 and self.ladder is not None:
            # the ladder to the record's depth (within the engine's ceiling): the MTP chain the engine
            # would run for that width
            k = min(k, self.cfg.max_depth)
            ladder = yield LadderAsk(k)
            draft = Draft(MTP, _fill(ladder.tokens, k, []), ladder.gated, ladder.mtp_steps)
        elif k > 0:
            more: list[int] = []
            steps = 0
            if rec.mtp_steps > 0 and self.ladder is not None:
                # the "agree" check the record's round ran: the ladder's first draft (one pass on the
                # host ladder; on the device the chain runs to the depth it is asked for, as the engine's
                # own check does), agreeing
                depth = 1 if self.paused else min(max_drafts, self.depth.depth)
                ladder = yield LadderAsk(depth, lambda tok: True)
                more, steps = ladder.tokens, ladder.mtp_steps
            draft = Draft(SUFFIX, _fill(proposal, k, more), mtp_steps=steps)
        self._trace.drafts_cut += rec.drafts - len(draft.tokens)
        return draft
