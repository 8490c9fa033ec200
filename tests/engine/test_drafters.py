"""engine/drafters.py: suffix index, MTP ladder (golden chain semantics, KV hygiene, gate), depth control, arbitration."""

import json

import numpy as np
import pytest

from markov_model import MarkovModel
from q27py.config import SpecConfig
from q27py.engine.drafters import MTP, NONE, SUFFIX, DepthController, Draft, DraftPlanner, MTPLadder, SuffixIndex, top2_margin
from q27py.model.reference import ReferenceModel


# ----------------------------------------------------------------------------- suffix index


def _brute_longest(stream, max_match):
    """Longest earlier match of the stream's tail (ties: most recent), by definition."""
    n = len(stream)
    best_end, best = -1, 0
    for e in range(n - 1):
        m = 0
        while m < max_match and e - m >= 0 and stream[e - m] == stream[n - 1 - m]:
            m += 1
        if m >= best and m > 0:
            best_end, best = e, m
    return best_end, best


@pytest.mark.parametrize("vocab,key_len", [(3, 1), (4, 2), (6, 3)])
def test_incremental_index_finds_the_longest_match(vocab, key_len):
    rng = np.random.default_rng(vocab)
    stream = rng.integers(0, vocab, size=260).tolist()
    idx = SuffixIndex(key_len=key_len, max_candidates=10_000, max_match=40)
    done = 0
    while done < len(stream):
        step = int(rng.integers(1, 6))
        idx.extend(stream[done : done + step])
        done = min(done + step, len(stream))
        end, length = idx.longest_match()
        want_end, want = _brute_longest(stream[:done], 40)
        if want < key_len:
            assert length == 0 or length == want  # shorter than a key: not findable, by design
            continue
        assert (end, length) == (want_end, want)


def test_proposal_copies_the_continuation_and_repeats_a_period():
    idx = SuffixIndex(key_len=2)
    idx.extend([7, 1, 2, 3, 9, 9, 1, 2, 3])
    # Tail "1 2 3" matched at positions 1..3: what followed was 9, 9, 1, 2, 3, ...
    assert idx.propose(4, min_match=3) == ([9, 9, 1, 2], 3)
    period = SuffixIndex(key_len=2)
    period.extend([5, 6, 5, 6, 5])
    # The best match ends one period back; the copy runs into its own proposal.
    assert period.propose(6, min_match=2) == ([6, 5, 6, 5, 6, 5], 3)


def test_proposal_needs_min_match_and_never_matches_itself():
    idx = SuffixIndex(key_len=2)
    idx.extend([1, 2, 3, 4, 5, 6])
    assert idx.propose(4, min_match=2) == ([], 0)
    idx.extend([1, 2])
    assert idx.propose(4, min_match=3)[0] == []
    assert idx.propose(4, min_match=2) == ([3, 4, 5, 6], 2)


def test_candidate_cap_keeps_the_most_recent():
    idx = SuffixIndex(key_len=1, max_candidates=3)
    idx.extend([0, 1, 0, 2, 0, 3, 0, 4, 0])
    # Only the last three "0"s (positions 4, 6 and the tail itself at 8) are candidates: the index
    # keeps every end (it can be truncated back), lookups read the newest max_candidates.
    assert list(idx._index[(0,)])[-idx.max_candidates:] == [4, 6, 8]
    assert idx.propose(1, 1) == ([4], 1)
    # a cap of 1 leaves only the tail itself: no earlier match
    one = SuffixIndex(key_len=1, max_candidates=1)
    one.extend([0, 1, 0, 2, 0])
    assert one.propose(1, 1) == ([], 0)


def test_truncate_then_extend_equals_a_fresh_index():
    rng = np.random.default_rng(5)
    for _ in range(100):
        ids = rng.integers(0, 6, rng.integers(1, 300)).tolist()
        cut = int(rng.integers(0, len(ids) + 1))
        more = rng.integers(0, 6, rng.integers(0, 100)).tolist()
        a = SuffixIndex(key_len=int(rng.integers(1, 5)), max_candidates=int(rng.integers(1, 8)))
        a.extend(ids)
        a.truncate(cut)
        a.extend(more)
        b = SuffixIndex(key_len=a.key_len, max_candidates=a.max_candidates)
        b.extend(ids[:cut] + more)
        assert a.length == b.length and a._index == b._index
        assert a.propose(5, 1) == b.propose(5, 1)
        assert a.common_prefix(ids[:cut] + more + [9]) == a.length


# ----------------------------------------------------------------------------- depth controller


def test_depth_controller_promotes_on_saturation_and_demotes_on_low_yield():
    c = DepthController(max_depth=5)
    assert c.depth == 5
    for _ in range(200):
        c.observe(c.depth, 0)  # the deepest draft never accepted
    assert c.depth == 1
    for _ in range(400):
        c.observe(c.depth, c.depth)  # everything accepted
    assert c.depth == 5
    assert c.changes == 8
    fixed = DepthController(max_depth=4, adaptive=False)
    for _ in range(100):
        fixed.observe(4, 0)
    assert fixed.depth == 4


def test_depth_controller_ignores_rounds_that_did_not_reach_the_ceiling():
    c = DepthController(max_depth=4)
    for _ in range(500):
        c.observe(2, 0)  # gated early: says nothing about depth 4
    assert c.depth == 4 and c.changes == 0


@pytest.mark.parametrize("p,lo,hi", [(0.9, 5, 5), (0.8, 3, 5), (0.5, 1, 2), (0.2, 1, 1)])
def test_depth_controller_settles_where_the_deepest_draft_pays(p, lo, hi):
    """Each draft accepted with probability p given the previous: P(all d) = p**d.
    The ceiling settles where p**d sits between the thresholds (0.2 <= p**d < 0.5)."""
    rng = np.random.default_rng(0)
    c = DepthController(max_depth=5)
    seen = []
    for _ in range(3000):
        acc = 0
        while acc < c.depth and rng.random() < p:
            acc += 1
        c.observe(c.depth, acc)
        seen.append(c.depth)
    settled = np.bincount(seen[1000:], minlength=6)
    assert lo <= int(np.argmax(settled)) <= hi


# ----------------------------------------------------------------------------- MTP ladder


@pytest.fixture(scope="module")
def tiny_golden(fixtures_dir):
    base = fixtures_dir / "golden" / "q36-tiny-code"
    model = ReferenceModel.load(fixtures_dir.parent / "models" / "q36-tiny-code")
    return model, dict(np.load(base / "golden.npz")), json.loads((base / "golden.json").read_text())


def _primed_ladder(model, ids, pending):
    st = model.new_state()
    out = model.forward(st, ids, logits_rows="last")
    ladder = MTPLadder(model, st.mtp_kv)
    ladder.defer(out.hidden[:-1], ids[1:])
    ladder.flush()
    ladder.defer(out.hidden[-1:], [pending])
    return st, ladder


def test_ladder_reproduces_the_golden_draft_chain(tiny_golden):
    model, gold, meta = tiny_golden
    ids = [int(t) for t in gold["prompt_ids"]]
    st, ladder = _primed_ladder(model, ids, meta["pending_after_prompt"])
    depth = len(gold["mtp_drafts"])
    draft = ladder.draft(depth, -np.inf, position=len(ids))
    assert draft.tokens == [int(t) for t in gold["mtp_drafts"]]
    assert draft.source == MTP and draft.mtp_steps == depth and not draft.gated
    # Committed rows 0..L-1 are written (row L-1 pairs the last prompt hidden with the
    # pending token); draft rows are gone.
    assert st.mtp_kv.length == len(ids)
    assert ladder.backlog == 0


def test_ladder_warm_rows_equal_one_full_pass(tiny_golden):
    model, gold, meta = tiny_golden
    ids = [int(t) for t in gold["prompt_ids"]]
    st, ladder = _primed_ladder(model, ids, meta["pending_after_prompt"])
    ladder.draft(3, -np.inf, position=len(ids))
    ref = model.new_state()
    out = model.forward(ref, ids, logits_rows="last")
    model.mtp_forward(ref.mtp_kv, out.hidden, ids[1:] + [meta["pending_after_prompt"]], 0)
    n = len(ids)
    np.testing.assert_allclose(st.mtp_kv.k[:n], ref.mtp_kv.k[:n], rtol=0, atol=1e-5)
    np.testing.assert_allclose(st.mtp_kv.v[:n], ref.mtp_kv.v[:n], rtol=0, atol=1e-5)


def _chain_margins(model, st, ladder_tokens, ids, pending):
    """The top1-top2 margin of every step of an ungated chain, recomputed by hand."""
    out = model.forward(model.new_state(), ids, logits_rows="last")
    kv = model.new_state().mtp_kv
    logits, hm = model.mtp_forward(kv, out.hidden, ids[1:] + [pending], 0)
    margins, h = [top2_margin(logits[-1])], hm[-1:]
    for k, tok in enumerate(ladder_tokens[:-1]):
        lg, h = model.mtp_forward(kv, h, [tok], len(ids) + k)
        margins.append(top2_margin(lg[0]))
    return margins


def test_confidence_gate_stops_at_the_first_unsure_draft(tiny_golden):
    model, gold, meta = tiny_golden
    ids = [int(t) for t in gold["prompt_ids"]]
    pending = meta["pending_after_prompt"]
    st, ladder = _primed_ladder(model, ids, pending)
    full = ladder.draft(7, -np.inf, position=len(ids))
    margins = _chain_margins(model, st, full.tokens, ids, pending)
    assert len(margins) == 7
    theta = sorted(margins)[2] + 1e-6  # passes the larger margins only
    first_below = next(i for i, m in enumerate(margins) if m < theta)
    _, ladder = _primed_ladder(model, ids, pending)
    gated = ladder.draft(7, theta, position=len(ids))
    assert gated.tokens == full.tokens[:first_below]
    assert gated.gated and gated.mtp_steps == first_below + 1
    st, ladder = _primed_ladder(model, ids, pending)
    none = ladder.draft(7, np.inf, position=len(ids))
    assert none.source == NONE and none.tokens == [] and none.mtp_steps == 1
    assert st.mtp_kv.length == len(ids), "a gated-out step 0 still writes its committed row"


# ----------------------------------------------------------------------------- arbitration


def _planner(arbitration, model, stream, max_depth=3):
    st = model.new_state()
    out = model.forward(st, stream[:-1])
    ladder = MTPLadder(model, st.mtp_kv)
    ladder.defer(out.hidden, stream[1:])
    idx = SuffixIndex(key_len=2)
    idx.extend(stream)
    cfg = SpecConfig(arbitration=arbitration, suffix_min_match=2, max_depth=max_depth, adaptive_depth=False)
    return DraftPlanner(cfg, ladder, idx), st.position


def test_arbitration_policies():
    model = MarkovModel.random(6, seed=0)
    stream = [1, 2, 3, 4, 5, 0, 1, 2]  # tail "1 2" repeats: the suffix proposes 3, 4, 5, 0, 1
    planner, pos = _planner("suffix_first", model, stream)
    d = planner.plan(5, pos)
    assert d.source == SUFFIX and d.tokens == [3, 4, 5, 0, 1] and d.mtp_steps == 0
    assert planner.plan(2, pos).tokens == [3, 4]
    planner, pos = _planner("mtp", model, stream)
    d = planner.plan(5, pos)
    assert d.source == MTP and len(d.tokens) == 3
    # "agree": the ladder's first draft decides.
    mtp_first = int(np.argmax(model.mtp_table[stream[-1]]))
    planner, pos = _planner("agree", model, stream)
    d = planner.plan(5, pos)
    if mtp_first == 3:
        assert d.source == SUFFIX and d.mtp_steps == 1
    else:
        assert d.source == MTP and d.tokens[0] == mtp_first and len(d.tokens) == 3
    forced = MarkovModel(model.table, np.where(np.arange(6) == 3, 10.0, 0.0)[None, :].repeat(6, 0))
    planner, pos = _planner("agree", forced, stream)
    d = planner.plan(5, pos)
    assert d.source == SUFFIX and d.tokens == [3, 4, 5, 0, 1] and d.mtp_steps == 1
    assert planner.plan(0, pos).source == NONE


# ----------------------------------------------------------------------------- the ladder's pause


class _Ladder:
    """A stand-in ladder: drafts `depth` copies of token 7, counts its calls and depths."""

    def __init__(self):
        self.depths: list[int] = []

    def draft(self, depth, margin, position, stop_if_first=None):
        self.depths.append(depth)
        return Draft(MTP, [7] * depth, mtp_steps=depth)


def test_ladder_pauses_after_rounds_that_accept_nothing_and_probes():
    """SpecConfig.pause_after ladder rounds in a row with no accepted draft pause the ladder: plain
    rounds, a one-draft probe every pause_probe_every-th round; an accepted probe resumes it."""
    ladder = _Ladder()
    planner = DraftPlanner(SpecConfig(suffix=False, max_depth=3, adaptive_depth=False, pause_after=3,
                                      pause_probe_every=4), ladder, None)
    for _ in range(3):  # three misses at depth 3
        d = planner.plan(7, 0)
        assert d.source == MTP and len(d.tokens) == 3
        planner.observe(d, 0)
    assert planner.paused and planner.pauses == 1 and ladder.depths == [3, 3, 3]
    sources = []
    for _ in range(8):  # paused: three plain rounds, then a one-draft probe (missed), and again
        d = planner.plan(7, 0)
        sources.append((d.source, len(d.tokens)))
        planner.observe(d, 0)
    assert sources == [(NONE, 0)] * 3 + [(MTP, 1)] + [(NONE, 0)] * 3 + [(MTP, 1)]
    assert ladder.depths == [3, 3, 3, 1, 1] and planner.pauses == 1
    for _ in range(3):
        planner.observe(planner.plan(7, 0), 0)
    d = planner.plan(7, 0)  # the next probe is accepted: the pause ends, full depth again
    assert (d.source, len(d.tokens)) == (MTP, 1)
    planner.observe(d, 1)
    assert not planner.paused
    d = planner.plan(7, 0)
    assert d.source == MTP and len(d.tokens) == 3


def test_ladder_never_pauses_when_off_or_when_drafts_land():
    ladder = _Ladder()
    off = DraftPlanner(SpecConfig(suffix=False, adaptive_depth=False, pause_after=0), ladder, None)
    for _ in range(20):
        d = off.plan(7, 0)
        assert d.source == MTP
        off.observe(d, 0)
    on = DraftPlanner(SpecConfig(suffix=False, adaptive_depth=False, pause_after=2), _Ladder(), None)
    for i in range(20):  # every other round accepts: never two misses in a row
        d = on.plan(7, 0)
        assert d.source == MTP
        on.observe(d, i % 2)
    assert on.pauses == 0


def test_paused_ladder_leaves_the_suffix_proposal_alone():
    """Paused: a suffix proposal goes out without the ladder's veto (under "agree" the ladder ran a
    pass and, disagreeing, replaced it); probe rounds still arbitrate as usual."""
    stream = [1, 2, 3, 4, 5, 0, 1, 2]  # tail "1 2" repeats: the suffix proposes 3, 4, 5, 0, 1
    idx = SuffixIndex(key_len=2)
    idx.extend(stream)
    ladder = _Ladder()  # drafts 7: never the suffix's 3
    planner = DraftPlanner(SpecConfig(suffix_min_match=2, adaptive_depth=False, pause_after=2, pause_probe_every=3),
                           ladder, idx)
    for _ in range(2):
        d = planner.plan(5, 0)
        assert d.source == MTP and d.tokens[0] == 7  # the veto, before the pause
        planner.observe(d, 0)
    assert planner.paused
    got = [planner.plan(5, 0) for _ in range(3)]
    assert [(d.source, d.tokens) for d in got[:2]] == [(SUFFIX, [3, 4, 5, 0, 1])] * 2
    assert got[2].source == MTP and got[2].tokens == [7]  # the probe: one draft, still arbitrated
    assert ladder.depths == [3, 3, 1]
