"""Self-speculative decoding of one sequence: draft, verify W lanes in one forward, accept, commit.

Between rounds the sequence has a committed state at position P (tokens 0..P-1
run through the model) and a pending token x_P (chosen, not yet run). A round:

1. draft: up to W-1 guesses d_1.. for positions P+1.. (engine/drafters.py);
2. verify: ONE forward of [x_P, d_1, .., d_{W-1}] at positions P..P+W-1 in
   verify mode. Lane t attends only up to its own position, and on the reference
   path (W <= 16) each lane's numbers are those of a plain decode step;
3. accept: lane t's logits choose the token at P+t+1 with the position-keyed
   sampler (argmax when greedy). Walk t = 0, 1, ..: emit that token; continue
   only while it equals d_{t+1} (then lane t+1 saw the right prefix) and is no
   stop id. n = tokens emitted; the last one becomes the new pending token;
4. commit: keep lanes 0..n-1.

GDN rollback is the model's: on the reference path per-lane state slots
(model.md §6, vLLM's layout: verify records every lane's recurrent state and
conv window without writing the committed ones, commit(n) installs lane n-1's);
the fast path records lane inputs and replays n of them (record-then-fold,
q27-design.md §3.6). Rejected lanes leave nothing behind; attention KV rows past
the committed position are cut back. tests/engine/test_spec_rollback.py proves
commit(n) == n plain steps, bitwise, for every array of the state, and
test_spec_exactness.py that a whole speculative run ends in plain decoding's state.

Model calls follow the fast path's rules: commit directly after its verify
forward, and hidden rows read before the next model call.

Because the token at each position is a function of (logits row, seed,
position) only, the output equals plain decoding's for every width, depth and
drafter: drafts change how many tokens a round commits, never which.

The prompt's MTP warm-up (MTPLadder rows of every prompt position but the last, written
after each prefill piece) is not needed to choose the first token, which comes from the
prefill's last logits row alone. So `run` holds those writes back (MTPLadder.hold, at most
EngineConfig.mtp_defer_rows rows across the engine's requests: past it the earliest run at
once), yields the first token, and then runs them (release) before anything else: the same
mtp_forward calls in the same order, so the first draft, the output and the state left for
prefix reuse are those of eager warm-up, bit for bit. A snapshot that exports MTP rows (a disk
prefix entry: decoder.reads_mtp) gets them written first; a piece the scheduler cut short for
decoding slots (Pace.prefill_chunk) warms with its piece, as before, so the held rows never
land on those slots' wait at once; a prefill cancelled, closed or failed before its first
token drops what it held (its state is thrown away).

Shared rounds (the scheduler's batched decode, engine/scheduler.py): while the round
is shared (pace.shared) a slot runs no verify of its own: its pending token and, when
pace.lanes > 1 (its share of a sweep that carries drafts), drafts planned as a solo
round plans them (at most pace.lanes - 1) are one lane group of the round's sweep
(`_shared_round`): the caller runs every group in one model.verify_batch, the group's
rows are walked as `_round` walks its own (decoder.accept_walk), commit_batch keeps the
accepted tokens, and the round settles as `_round` settles. With one lane (batch_spec
"solo-only", a model without verify_batch, or as many sharing slots as the sweep has
lanes) it is a plain decode lane of a decode_batch, and the drafters are still fed every
committed token (the MTP ladder its hidden row, deferred to the next ladder's step 0;
the suffix index the token), so when the slot runs its own round again its drafts are
those it would have made had it never shared one. Same tokens either way: a group's
rows are the solo verify's rows, a plain lane's row the plain decode step's.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator

import numpy as np

from q27py.config import BATCH_SPEC_CHOICES, MTP_DEFER_ROWS, SpecConfig
from q27py.engine.api import SamplingParams
from q27py.engine.decoder import (DecodeStats, Decoder, Lane, Pace, PrefillBreaks, accept_walk, begin_run, paused,
                                  prefill_steps, prompt_suffix, reads_mtp, restarts_grid)
from q27py.engine.drafters import NONE, ChainCall, Draft, DraftPlanner, HoldBudget, MTPLadder, SuffixIndex
from q27py.errors import ConfigError
from q27py.model.state import SequenceState

# SpecDecoder.planner_factory: (spec, ladder, suffix index, the request's state) -> its DraftPlanner
PlannerFactory = Callable[[SpecConfig, MTPLadder | None, SuffixIndex | None, SequenceState], DraftPlanner]

# The reference forward computes T <= 16 tokens row by row (model/reference.py
# SMALL_T); a wider verify would use batched matmuls whose rounding differs
# from a plain decode step, and greedy output could drift on near ties.
MAX_VERIFY_WIDTH = 16


class SpecDecoder:
    """Speculative decoding with the plain Decoder's interface (engine/decoder.py)."""

    def __init__(self, model, spec: SpecConfig, prefill_chunk: int = 2048, batch_spec: str = "adaptive",
                 defer_rows: int = MTP_DEFER_ROWS):
        if not 1 <= spec.max_verify_width <= MAX_VERIFY_WIDTH:
            raise ConfigError(f"spec.max_verify_width must be in 1..{MAX_VERIFY_WIDTH}, got {spec.max_verify_width}")
        if not 1 <= spec.max_depth <= 7:
            raise ConfigError(f"spec.max_depth must be in 1..7, got {spec.max_depth}")
        if spec.pause_after < 0 or spec.pause_probe_every < 1:
            raise ConfigError(f"spec.pause_after must be >= 0 and spec.pause_probe_every >= 1, got "
                              f"{spec.pause_after} / {spec.pause_probe_every}")
        if spec.suffix_min_match < 1:
            raise ConfigError(f"spec.suffix_min_match must be >= 1, got {spec.suffix_min_match}")
        if spec.arbitration not in DraftPlanner.POLICIES:
            raise ConfigError(f"spec.arbitration must be one of {DraftPlanner.POLICIES}, got {spec.arbitration!r}")
        self.model = model
        self.cfg = spec
        self.prefill_chunk = prefill_chunk
        self.width = spec.max_verify_width
        # every choice runs the same rounds here (a shared round's group carries the drafts its
        # Pace.lanes allows); they differ in which slots the scheduler shares and how many lanes each
        # gets (engine/share_policy.py, LocalEngine.sweep_lanes)
        if batch_spec not in BATCH_SPEC_CHOICES:  # EngineConfig.check_batching names the choices
            raise ConfigError(f"batch_spec {batch_spec!r} is not built ({', '.join(BATCH_SPEC_CHOICES)})")
        self.batch_spec = batch_spec
        if isinstance(defer_rows, bool) or not isinstance(defer_rows, int) or defer_rows < 0:
            raise ConfigError(f"mtp_defer_rows must be a row count >= 0 (0 = warm every piece at once), not {defer_rows!r}")
        # the prompt rows whose MTP warm-up waits for the first token, all of this engine's requests together
        self.hold_budget = HoldBudget(defer_rows)
        # The DraftPlanner each request drafts with; None (always, outside the load bench): DraftPlanner itself.
        # A seam for `bench load --traces` alone (q27py/bench/trace_accept.py TracePlanner): random 27B weights
        # make text the suffix drafter finds nothing in, so the engine's own planner offers ~half the drafts
        # the trained model's recorded rounds did; the bench's planner offers each recorded round's width
        # through this request's real ladder and suffix index (so the device work stays the engine's). It is
        # called with (spec config, the request's ladder or None, its suffix index or None, its state).
        self.planner_factory: PlannerFactory | None = None

    def _ladder(self, state: SequenceState, todo: list[int]) -> MTPLadder | None:
        """The MTP ladder for this request, primed with the row it owes; None if it cannot run."""
        if not self.model.has_mtp or state.mtp_kv is None:
            return None
        ladder = MTPLadder(self.model, state.mtp_kv)
        if state.position == 0:
            state.mtp_kv.truncate(0)
            return ladder
        # A reused prefix: the MTP rows must reach position-2 and the hidden at
        # position-1 must be known (its row pairs it with the first new token).
        # (A request abandoned mid-stream, e.g. at a stop string, may leave them short:
        # then this request drafts with the suffix drafter only.)
        hidden_last = state.hidden_last
        if hidden_last is None or state.mtp_kv.length < state.position - 1:
            return None  # drafting without those rows would read a hole in the MTP KV
        state.mtp_kv.truncate(state.position - 1)
        ladder.defer(np.asarray(hidden_last).reshape(1, -1), [todo[0]])
        return ladder

    def _suffix_index(self, state: SequenceState, prompt_ids: list[int]) -> SuffixIndex:
        """The suffix index over prompt_ids, reusing the sequence's index of its last stream (prompt +
        output) when the new prompt shares a prefix with it: an agent turn then indexes only its new
        tokens instead of the whole 20K+ token prompt (~50-100 ms of host time per turn)."""
        key_len = min(4, self.cfg.suffix_min_match)
        idx = state.suffix_index
        if isinstance(idx, SuffixIndex) and idx.key_len == key_len:
            keep = idx.common_prefix(prompt_ids)
            if keep * 2 >= len(prompt_ids):
                idx.truncate(keep)
                idx.extend(prompt_ids[keep:])
                return idx
        idx = SuffixIndex(key_len=key_len)
        idx.extend(prompt_ids)
        state.suffix_index = idx
        return idx

    def run(
        self,
        state: SequenceState,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids=frozenset(),
        cancel: threading.Event | None = None,
        stats: DecodeStats | None = None,
        prefill_breaks: PrefillBreaks | None = None,
        picker=None,
        pause_prefill: bool = False,
        pace: Pace | None = None,
    ) -> Iterator[list[int] | Lane]:
        """Yield the tokens committed by each round until a stop id, max_tokens or cancel.

        pause_prefill: also yield an empty round between prefill chunks (Decoder.run). Each
        yield of tokens follows a whole round (verify forward, commit, hidden rows read): a
        paused run holds nothing of the model's shared scratch, so other sequences may run in
        between. pace: engine/decoder.py's module docstring (shared rounds yield a Lane)."""
        sampler, stats = begin_run(sampling, stats, self.cfg.trace, picker, prompt_ids)
        if max_tokens <= 0 or (cancel is not None and cancel.is_set()):
            return
        todo = prompt_suffix(state, prompt_ids)
        ladder = self._ladder(state, todo)
        suffix = self._suffix_index(state, prompt_ids) if self.cfg.suffix else None
        planner = (DraftPlanner(self.cfg, ladder, suffix) if self.planner_factory is None
                   else self.planner_factory(self.cfg, ladder, suffix, state))

        # The first token is chosen from the prefill's last logits row alone: the prompt's MTP writes
        # (each piece's warm() below) are held back, within hold_budget, and run once that token is out
        # (below), in the same calls and order, so the first draft reads the MTP KV of eager writing.
        hold = ladder is not None and self.hold_budget.limit > 0
        if hold:
            prefill_breaks = _settling(prefill_breaks, ladder)

        def warm(start: int, piece: list[int], hidden) -> None:
            if hold:
                if pace is not None and pace.prefill_chunk:
                    # The scheduler cut this piece short for decoding slots (their wait between tokens):
                    # its warm-up runs with it, as without holding, and so do any held before; held, they
                    # would all land on one of those waits after the first token.
                    ladder.release()
                elif not ladder.holding:
                    ladder.hold(self.hold_budget)
            # Rows whose next token is a prompt token are written chunk by chunk;
            # the last prompt position waits for the first generated token.
            end = start + len(piece)
            known = len(piece) if end < len(prompt_ids) else len(piece) - 1
            ladder.defer(hidden[:known], prompt_ids[start + 1 : start + 1 + known])
            ladder.flush()

        try:
            logits = yield from paused(prefill_steps(self.model, state, todo, self.prefill_chunk, prefill_breaks,
                                                     on_chunk=warm if ladder is not None else None, cancel=cancel,
                                                     pace=pace),
                                       pause_prefill)
        except BaseException:
            # cancelled (PrefillCancelled), closed or failed before the first token: the caller drops the
            # partly prefilled state, and the writes held for it go with it (never run later, when the
            # state may serve another request)
            if ladder is not None:
                ladder.discard()
            raise
        if sampler.finished:  # a constraint that admits nothing at all (Decoder.run)
            if ladder is not None:
                ladder.release()
                ladder.flush(keep_last=True)
            return
        pending = sampler.pick(logits, state.position)
        sampler.commit([pending])
        if ladder is not None:
            ladder.defer(state.hidden_last, [pending])
        if suffix is not None:
            suffix.extend([pending])
        produced = 1
        stats.record_round("none", [], 0, 1)
        new = [pending]
        last = pending in stop_ids or produced >= max_tokens or sampler.finished
        try:
            yield new  # the first token, before the prompt's held MTP writes
        finally:
            # ... which run now: before any draft, or (it was the last token, or the consumer stopped
            # here) so that the state is at rest as below. Also on close(): LocalEngine closes at a stop id.
            if ladder is not None:
                ladder.release()
                if last:
                    ladder.flush(keep_last=True)
        while True:
            if last:
                return
            if cancel is not None and cancel.is_set():
                if ladder is not None:
                    ladder.flush(keep_last=True)
                return
            if pace is not None and pace.shared:
                new = yield from self._shared_round(state, pending, pace, max_tokens - produced, sampler,
                                                    planner, ladder, suffix, stop_ids, stats)
            else:
                new = self._round(state, pending, max_tokens - produced, sampler, planner, ladder, suffix, stop_ids,
                                  stats)
            produced += len(new)
            pending = new[-1]
            if pace is not None:  # what its next group in a shared sweep would use (scheduler: share_lanes)
                pace.want_lanes = planner.wanted(self.width)
            # sampler.finished: the constrained output is complete with no end id to emit
            # (TokenPicker.finished); viable() kept this round's lanes short of that point.
            last = pending in stop_ids or produced >= max_tokens or sampler.finished
            if last and ladder is not None:
                # At rest the MTP rows reach position-2 (prefix reuse resumes from there).
                # Written before the final yield: a consumer stops iterating at EOS.
                ladder.flush(keep_last=True)
            yield new

    def _round(self, state, pending, remaining, sampler, planner, ladder, suffix, stop_ids, stats) -> list[int]:
        position = state.position  # the pending token's position
        draft = self._draft(planner, sampler, self.width, remaining, position)
        lanes = [pending] + draft.tokens
        out = self.model.forward(state, lanes, logits_rows="all", verify=True)
        new = accept_walk(sampler, out, position, draft.tokens, stop_ids)
        n = len(new)
        hidden = np.array(out.hidden[:n])  # read before commit: the fast path reuses its scratch
        self.model.commit(state, out.trace, n)
        self._settle(state, new, hidden, draft, sampler, planner, ladder, suffix, stats)
        return new

    def _draft(self, planner, sampler, lanes: int, remaining: int, position: int) -> Draft:
        """Drafts for a round of at most `lanes` lanes (its pending token + drafts) with `remaining`
        tokens left to produce. Drafts the output constraint refuses are cut here: their lanes could
        never be accepted."""
        draft = planner.plan(min(lanes - 1, remaining - 1), position)
        draft.tokens = sampler.viable(draft.tokens)
        return draft

    @staticmethod
    def _settle(state, new, hidden, draft, sampler, planner, ladder, suffix, stats) -> None:
        """After a round's commit (its own or a shared one): the tokens into the picker, hidden_last,
        the drafters fed (the ladder its rows, the suffix index the tokens), the depth controller and
        the stats told what was accepted."""
        n = len(new)
        accepted = 0
        while accepted < min(n, len(draft.tokens)) and new[accepted] == draft.tokens[accepted]:
            accepted += 1
        sampler.commit(new)
        state.hidden_last = hidden[n - 1 :]
        if ladder is not None:
            ladder.defer(hidden, new)
        if suffix is not None:
            suffix.extend(new)
        planner.observe(draft, accepted)
        stats.record_round(draft.source, draft.tokens, accepted, n, lanes=1 + len(draft.tokens),
                           mtp_steps=draft.mtp_steps)

    def _shared_round(self, state, pending, pace, remaining, sampler, planner, ladder, suffix, stop_ids, stats):
        """A round inside the scheduler's shared forward: the pending token and, when the scheduler
        gives this slot more than one lane of the sweep (Pace.lanes, its share of the sweep's flat
        width), drafts planned as `_round` plans them; the group is yielded (the caller runs every
        slot's group in one verify_batch, or plain lanes in one decode_batch, reads this group's rows
        into it and commits what the walk accepted), then the round settles exactly as `_round`'s.
        With Pace.batch_drafts the MTP ladder's chain is yielded first (a DraftCall): the caller runs
        every sharing slot's chain in one model.mtp_draft_batch and resumes this one with its ids.

        With one lane (batch_spec "solo-only", a model without verify_batch, or a sweep shared by
        as many slots as it has lanes) there are no drafts: a plain decode lane. Everything the
        drafters learn from a committed token is fed either way: the ladder's backlog grows by the
        rows (kv.length + backlog == position holds; a long run of plain shared rounds is written
        eagerly past MTPLadder.MAX_BACKLOG, after the whole batch was read; a group's drafting
        flushes it), the suffix index gets the tokens. The depth controller sees the rounds the
        ladder drafted, so a shared slot's depth follows what its narrower groups accept."""
        draft = Draft(NONE)
        if pace.lanes > 1 and remaining > 1:
            max_drafts = min(min(pace.lanes, self.width) - 1, remaining - 1)
            if pace.batch_drafts and ladder is not None:
                draft = yield from self._plan_batched(planner, ladder, max_drafts, state.position)
            else:
                draft = planner.plan(max_drafts, state.position)
            draft.tokens = sampler.viable(draft.tokens)
        lane = Lane(state, pending, sampler, drafts=draft.tokens, stop_ids=stop_ids)
        yield lane
        new, hidden = lane.result()
        self._settle(state, new, hidden, draft, sampler, planner, ladder, suffix, stats)
        return new

    def _plan_batched(self, planner, ladder, max_drafts: int, position: int):
        """planner.plan with the ladder's chain handed out (a DraftCall, yielded) instead of run here."""
        steps = planner.plan_steps(max_drafts, position)
        answer = None
        try:
            while True:
                ask = steps.send(answer)
                call = DraftCall(ladder.chain_call(ask.depth, position))
                yield call
                ids, margins = call.result()
                answer = ladder.chain_result(call.chain, ids, margins, self.cfg.confidence_margin, ask.stop_if_first)
        except StopIteration as done:
            return done.value


class DraftCall:
    """A ladder's MTP chain waiting for the scheduler's batched drafting (LocalEngine.run_drafts: every
    sharing slot's chain in one model.mtp_draft_batch, the weights of the MTP layer and lm_head swept
    once per step for all of them instead of once per slot). Nothing here calls the model."""

    def __init__(self, chain: ChainCall):
        self.chain = chain
        self.ids = self.margins = None
        self.error: BaseException | None = None

    def done(self, ids, margins) -> None:
        self.ids, self.margins = ids, margins

    def fail(self, exc: BaseException) -> None:
        self.error = exc

    def result(self):
        if self.error is not None:
            raise self.error
        if self.ids is None:
            raise RuntimeError("a draft call was resumed before its chain ran")
        return self.ids, self.margins


def _settling(breaks: PrefillBreaks | None, ladder: MTPLadder) -> PrefillBreaks | None:
    """The prefill's breaks, each one that reads the MTP rows (decoder.reads_mtp: a prefix entry
    written to disk exports them) preceded by the ladder's held writes, so the snapshot holds the
    rows it holds without holding (the other snapshots keep the GDN state and hidden_last only)."""
    if not breaks or not any(reads_mtp(fn) for fn in breaks.values()):
        return breaks

    def settled(fn):
        def run(state):
            ladder.write_held()
            fn(state)
        run.reads_mtp, run.restarts_grid = True, restarts_grid(fn)  # the break's own flags (decoder.py)
        return run

    return {p: settled(fn) if reads_mtp(fn) else fn for p, fn in breaks.items()}


def build_decoder(model, cfg):
    """The decoder the config asks for: speculative unless cfg.spec.enabled is False.

    enabled=None means "on when the checkpoint has an MTP head"; enabled=True on a
    model without one still speculates with the suffix drafter alone. It lives here,
    beside SpecDecoder, so imports run one way (spec -> decoder).
    """
    spec = cfg.spec
    use_spec = spec.enabled if spec.enabled is not None else bool(model.has_mtp)
    chunk = cfg.engine.engine_prefill_chunk()  # cuda: the fast path's large GEMM chunks
    if cfg.engine.device == "cpu":
        # The numpy path is slow per token: smaller chunks let a cancel land within ~1 s.
        chunk = min(chunk, cfg.engine.cpu_prefill_chunk)
    if use_spec:
        return SpecDecoder(model, spec, prefill_chunk=chunk, batch_spec=cfg.engine.batch_spec,
                           defer_rows=cfg.engine.mtp_defer_rows)
    return Decoder(model, prefill_chunk=chunk, trace=spec.trace)
