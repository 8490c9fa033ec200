"""Which decoding slots share the round's weight sweep and which run their own speculative round
(EngineConfig.batch_spec; issue 15 item 2: deep drafts alone, shallower in a shared sweep).

Two ways to move a decoding slot by one round:
- a lane group of the shared sweep: all sharing slots in ONE weight sweep (on a weight-bound 27B
  step, n lanes cost little more than one). Each group is the slot's pending token plus, where the
  model has verify_batch, drafts up to its share of the sweep's flat width (LocalEngine.sweep_lanes,
  16: share_lanes water-fills it by what each slot's drafters would use -- 8 each for two slots
  drafting long, 2 each for eight, a plain lane each for sixteen), so a shared round yields y >= 1
  tokens per slot (y = 1: plain lanes);
- its own round: drafts + a verify forward + commit (engine/spec.py), a + 1 tokens on average
  (a = accepted drafts) for one verify forward of its own.
With the trained MTP head a solo round yields ~2.7-3.7 tokens for about one decode step, so two
streams each running solo rounds in turn move ~1.6x faster than the same two sharing plain
lanes; at eight or sixteen streams the shared sweep wins. Where the crossover sits depends on
the card, the acceptance of each stream's text, the context and whether the sweep carries drafts,
so it is measured, not guessed:

- each slot keeps an average of its solo rounds (tokens, seconds) -- free while it runs alone --
  and of the tokens its shared rounds yield;
- the shared round keeps an average cost per sharing-slot count (its drafting and verify, all in);
- a round's plan maximizes tokens per second: starting from all slots sharing, slots move to
  solo rounds in order of their marginal rate (extra tokens over extra seconds), while that
  rate beats the plan's (the ratio optimum). A sweep left with one lane is that slot's solo
  round instead (a one-lane sweep is a plain step: the slot would give up its drafts).
- a slot with no solo average borrows the others' mean; with none at all it is probed: one
  slot runs a solo round (the rest share), at most one probe per round, each slot's probes
  spaced further apart (PROBE_FIRST rounds, doubling to PROBE_MAX) while they keep losing;
- a probe is skipped (its clock moves on as if it had lost) when even the best solo round the
  decoder can make -- `max_yield` tokens (its verify width: every draft accepted), in the fastest
  solo time measured -- could not raise the plan's tokens per second. Why: a probe stops every
  other stream for one slot's round, and per-slot spacing lets C slots probe C times as often: at
  C = 16 on an H100 (2026-12-06, `bench load` with recorded acceptance) 89 probes took 1.55 s of a
  3.7 s run, for nothing -- a 16-lane sweep's ~1.2 tokens per ms is beyond any one slot's own
  rounds (8 tokens in ~17 ms at best). A slot's first measured rounds can undershoot its steady
  yield (the ladder is still learning), so the bound is the decoder's, not the measurements'.

Modes: "adaptive" (above), "drafts" (every decoding slot shares, groups with drafts: the sweep
alone) and "solo-only" (every decoding slot shares, plain lanes: speculation for a slot alone).

Only speed changes: a slot's tokens are the same solo, shared or mixed (the decode_batch and
verify_batch contracts and exact speculation; tests/engine/test_batched_rounds.py,
test_sweep_drafts.py). Nothing here knows about the model; the scheduler feeds it wall-clock
measurements (engine/scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

ALPHA = 0.25  # weight of the newest measurement in each running average
PROBE_FIRST = 2  # plan rounds before a slot's first probe (the first one measures the sweep)
PROBE_MAX = 512  # the longest spacing between one slot's probes


@dataclass
class SoloStats:
    """A slot's solo rounds: running averages of tokens and seconds per round, and its probe clock."""
    tokens: float = 0.0
    seconds: float = 0.0
    rounds: int = 0
    probe_at: int = PROBE_FIRST  # the plan round at which a shared slot is next probed
    probe_every: int = PROBE_FIRST
    shared_tokens: float = 0.0  # running average of the tokens its shared rounds yield (1: plain lanes)
    shared_rounds: int = 0

    def add(self, tokens: int, seconds: float) -> None:
        a = 1.0 if self.rounds == 0 else ALPHA
        self.tokens += a * (tokens - self.tokens)
        self.seconds += a * (max(seconds, 1e-9) - self.seconds)
        self.rounds += 1

    def add_shared(self, tokens: int) -> None:
        a = 1.0 if self.shared_rounds == 0 else ALPHA
        self.shared_tokens += a * (tokens - self.shared_tokens)
        self.shared_rounds += 1


@dataclass
class SharePolicy:
    """Plans each round's solo / shared split (module docstring). mode: "solo-only" (every decoding
    slot shares once two or more decode: the behaviour before "adaptive") or "adaptive"."""
    mode: str = "adaptive"
    shared_cost: dict[int, float] = field(default_factory=dict)  # sharing slots -> seconds per shared round
    plans: int = 0  # rounds planned with two or more decoding slots
    probes: int = 0  # solo rounds run only to measure
    # the most tokens one solo round can commit (the decoder's verify width; the scheduler sets it from
    # LocalEngine.solo_yield_max); 0: unknown, every due probe runs
    max_yield: int = 0
    skipped_probes: int = 0  # probes due but not run: not even a max_yield round could beat the plan

    def observe_solo(self, stats: SoloStats, tokens: int, seconds: float) -> None:
        stats.add(tokens, seconds)

    def observe_shared_tokens(self, stats: SoloStats, tokens: int) -> None:
        """A slot's shared round committed `tokens` (one for a plain lane; 1 + accepted drafts for a group)."""
        stats.add_shared(tokens)

    def observe_shared(self, lanes: int, seconds: float) -> None:
        """A shared round of `lanes` sharing slots (lane groups) took `seconds`, its drafting included."""
        if lanes < 1:
            return
        old = self.shared_cost.get(lanes)
        self.shared_cost[lanes] = seconds if old is None else old + ALPHA * (seconds - old)

    def cost(self, lanes: int) -> float | None:
        """Seconds of a shared round of `lanes` sharing slots: measured, else the nearest measured
        count's (a weight-bound sweep is nearly flat in its width), else None."""
        if lanes in self.shared_cost:
            return self.shared_cost[lanes]
        if not self.shared_cost:
            return None
        near = min(self.shared_cost, key=lambda n: (abs(n - lanes), -n))
        return self.shared_cost[near]

    def plan(self, stats: list[SoloStats]) -> list[bool]:
        """For two or more decoding slots (their SoloStats, in round order): True where the slot runs
        its own round this time, False where it is a lane of the shared sweep."""
        n = len(stats)
        if self.mode != "adaptive" or n < 2:
            return [False] * n
        self.plans += 1
        if self.cost(n) is None:  # measure the sweep first
            return [False] * n
        solo, tokens, seconds = self._best(stats)
        # one probe per round: the shared slot whose probe is due first (never measured, or stale), unless
        # no solo round of it could beat the plan (module docstring)
        due = [i for i in range(n) if not solo[i] and stats[i].probe_at <= self.plans]
        if due:
            i = min(due, key=lambda j: (stats[j].probe_at, j))
            s = stats[i]
            s.probe_at = self.plans + s.probe_every
            s.probe_every = min(PROBE_MAX, 2 * s.probe_every)
            if self._could_pay(stats, i, n - sum(solo), tokens, seconds):
                solo[i] = True
                self.probes += 1
            else:
                self.skipped_probes += 1
        if sum(solo) == n - 1:  # a one-lane sweep is a plain step: that slot keeps its drafts
            solo = [True] * n
        for i in range(n):
            if solo[i] and stats[i].probe_at <= self.plans:  # measured anyway: its next probe waits
                stats[i].probe_at = self.plans + stats[i].probe_every
        return solo

    def _shared_yield(self, stats: list[SoloStats]) -> list[float]:
        """What each slot yields in the sweep: measured, else the measured slots' mean, else a plain lane's one."""
        seen = [s.shared_tokens for s in stats if s.shared_rounds]
        y_prior = sum(seen) / len(seen) if seen else 1.0
        return [s.shared_tokens if s.shared_rounds else y_prior for s in stats]

    def _lane(self, m: int) -> float:
        """One lane's share of a sweep of m lanes: what leaving it saves."""
        return self.cost(m) - (self.cost(m - 1) if m > 1 else 0.0)

    def _could_pay(self, stats: list[SoloStats], i: int, shared: int, tokens: float, seconds: float) -> bool:
        """Whether a probe of slot i (one of `shared` sharing slots, under a plan of tokens / seconds) could pay:
        True where max_yield is unknown or no solo round was measured; else whether a round of max_yield
        tokens in the fastest measured solo time would raise the plan's tokens per second."""
        known = [s for s in stats if s.rounds]
        if not self.max_yield or not known:
            return True
        d_tok = self.max_yield - self._shared_yield(stats)[i]
        d_sec = min(s.seconds for s in known) - self._lane(shared)
        if d_tok <= 0:
            return False
        return d_sec <= 0 or d_tok / d_sec > tokens / seconds

    def _best(self, stats: list[SoloStats]) -> tuple[list[bool], float, float]:
        """The tokens-per-second optimum from the averages (a slot never measured borrows the measured
        ones' mean; with none measured every slot shares): (solo flags, the plan's tokens, its seconds)."""
        n = len(stats)
        known = [s for s in stats if s.rounds]
        solo = [False] * n
        y = self._shared_yield(stats)
        if not known:
            return solo, float(sum(y)), self.cost(n)
        prior = (sum(s.tokens for s in known) / len(known), sum(s.seconds for s in known) / len(known))
        est = [(s.tokens, s.seconds) if s.rounds else prior for s in stats]
        lane = self._lane

        def rate(i, m):  # extra tokens per extra second when slot i leaves a sweep of m lanes
            d_tok, d_sec = est[i][0] - y[i], est[i][1] - lane(m)
            return float("inf") if d_sec <= 0 < d_tok else d_tok / d_sec if d_sec > 0 else float("-inf")

        tokens, seconds, shared = float(sum(y)), self.cost(n), n
        for i in sorted(range(n), key=lambda i: (-rate(i, n), i)):
            d_tok, d_sec = est[i][0] - y[i], est[i][1] - lane(shared)
            if d_tok <= 0 or (d_sec > 0 and d_tok / d_sec <= tokens / seconds):
                break
            solo[i] = True
            tokens, seconds, shared = tokens + d_tok, seconds + d_sec, shared - 1
        return solo, tokens, seconds


def share_lanes(total: int, wants: list[int]) -> list[int]:
    """Each sharing slot's lanes of a sweep of `total` lanes (LocalEngine.sweep_lanes): water-filling --
    every slot gets min(its want, a common level), the level as high as the total allows, and the lanes
    left below the next level go one each to the slots that want more, in slot order. A slot whose
    drafters would use fewer lanes (a paused or shallow ladder, no suffix match: Pace.want_lanes) leaves
    them to the others, so a stream that drafts deep is not held to an even share. Never below one lane
    (a slot's pending token); more slots than lanes: one each (the engine splits the sweep)."""
    n = len(wants)
    wants = [max(1, int(w)) for w in wants]
    if n == 0:
        return []
    if total <= n:
        return [1] * n
    level = 1
    while level < max(wants) and sum(min(w, level + 1) for w in wants) <= total:
        level += 1
    alloc = [min(w, level) for w in wants]
    left = total - sum(alloc)
    for i in range(n):
        if left <= 0:
            break
        if wants[i] > alloc[i]:
            alloc[i] += 1
            left -= 1
    return alloc

