"""Checkpoint snapping (EngineConfig.checkpoint_min_piece): a grid checkpoint that would cut a
prefill piece shorter than the minimum is taken at the nearest piece boundary instead.

The case it is for: a warm agent turn resumed from a live sequence a few tokens before a
multiple of checkpoint_every. Without snapping the turn runs as a thin piece up to the grid point
plus the rest (on cuda the thin piece misses the cuBLAS route and adds a host sync); with it the
turn runs as one forward, the snapshot is taken of the resumed state before it, and a later
request that diverges after that point restores from it.

Scaled down for the bundled tiny model: checkpoint_every 256 / 384, minimum 128, a first turn of
230 prompt tokens + 8 generated (the live state rests at 237), a second turn of 438 tokens.
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.commands.engine_flags import add_engine_arguments, apply_engine_arguments
from q27py.config import ConfigError, Q27Config, apply_env
from q27py.engine.api import GenerationRequest
from q27py.engine.decoder import prefill
from q27py.engine.engine import LocalEngine
from q27py.engine.prefix_cache import PrefixCache
from q27py.model.reference import ReferenceModel

GEN = 8
TURN1 = 230  # prompt tokens of the first turn; its live state rests at TURN1 + GEN - 1 = 237
NEW = 200  # new prompt tokens of the second turn (its prompt: 230 + 8 + 200 = 438)
RESUME = TURN1 + GEN - 1


@pytest.fixture(scope="module")
def reference():
    return ReferenceModel.load(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def texts(tok):
    base = tok.encode("\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(120)))
    other = tok.encode("\n".join(f"class C{i}:\n    size = {3 * i}\n" for i in range(120)))
    assert len(base) >= TURN1 + NEW and len(other) >= 64
    return base, other


def _engine(model, tok, every: int, min_piece: int = 128) -> LocalEngine:
    cfg = Q27Config()
    cfg.engine.checkpoint_every = every
    cfg.engine.checkpoint_min_piece = min_piece
    cfg.engine.cpu_prefill_chunk = 1024  # the turns fit one chunk: only snapshot marks cut them
    return LocalEngine(cfg, model, tok)


class Recorder:
    """model.forward wrapped: (position, token count) of every call, and a copy of its logits."""

    def __init__(self, monkeypatch, model):
        self.calls: list[tuple[int, int]] = []
        self.logits: list[np.ndarray] = []
        forward = model.forward

        def recording_forward(state, ids, *args, **kwargs):
            self.calls.append((state.position, len(ids)))
            out = forward(state, ids, *args, **kwargs)
            self.logits.append(np.array(out.logits, copy=True))
            return out

        monkeypatch.setattr(model, "forward", recording_forward)

    def reset(self) -> None:
        self.calls, self.logits = [], []

    def prefill(self, end: int) -> list[tuple[int, int]]:
        """The calls that fed prompt tokens (those before position `end`, the prompt's length)."""
        return [c for c in self.calls if c[0] < end]

    def first_logits(self, end: int) -> np.ndarray:
        """The logits row the first token is picked from: the last prefill call's."""
        return self.logits[len(self.prefill(end)) - 1][-1]


def _run(engine, ids, **bounds):
    req = GenerationRequest(prompt_ids=list(ids), max_tokens=GEN, stop_ids=frozenset(), **bounds)
    tokens, stats = [], None
    for chunk in engine.generate(req):
        tokens += chunk.token_ids
        stats = chunk.stats or stats
    return tokens, stats


def _two_turns(engine, base, rec=None):
    """The first turn (cold), then the warm second turn resumed from its live state."""
    first = base[:TURN1]
    out1, _ = _run(engine, first)
    prompt = first + out1 + base[TURN1 : TURN1 + NEW]
    (seq,) = [s for s in engine.prefix.slots if s.tokens]
    assert seq.state.position == RESUME
    if rec is not None:
        rec.reset()
    out2, stats = _run(engine, prompt)
    assert stats["cached_tokens"] == RESUME  # the live state continued where it stood
    return prompt, out2, seq


@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_warm_turn_runs_as_one_forward_and_snapshots_its_resume_point(request, monkeypatch, tok, texts, backend):
    model = request.getfixturevalue(backend)
    base, other = texts
    rec = Recorder(monkeypatch, model)
    # checkpoint_every 256: the grid point 256 lies 19 tokens after the resume point 237
    prompt, out0, seq0 = _two_turns(_engine(model, tok, 256, min_piece=0), base, rec)
    end = len(prompt)
    assert rec.prefill(end) == [(RESUME, 256 - RESUME), (256, end - 256)]  # without snapping: 19 + 182
    assert 256 in seq0.snapshots and RESUME not in seq0.snapshots
    first0 = rec.first_logits(end)

    snapping = _engine(model, tok, 256)
    prompt_s, out, seq = _two_turns(snapping, base, rec)
    assert prompt_s == prompt
    assert rec.prefill(end) == [(RESUME, end - RESUME)]  # ONE forward
    assert seq.snapshots[RESUME].kind == "checkpoint" and 256 not in seq.snapshots
    logits = list(rec.logits)

    # The same tokens as the split run. Its logits are those of one 201-token piece, which rounds
    # differently from 19 + 182 in the last bits (as any other split: a prefix restore, an
    # interleaved piece) ...
    assert out == out0
    np.testing.assert_allclose(rec.first_logits(end), first0, rtol=0, atol=1e-4)
    assert np.argmax(rec.first_logits(end)) == np.argmax(first0)
    # ... and bitwise those of the same warm turn with no checkpoint in it at all: the snapshot of
    # the resumed state (taken before the first forward) changes nothing.
    prompt_n, out_n, _ = _two_turns(_engine(model, tok, 0), base, rec)
    assert prompt_n == prompt and out_n == out
    assert rec.prefill(end) == [(RESUME, end - RESUME)]
    assert len(rec.logits) == len(logits)
    assert all(np.array_equal(a, b) for a, b in zip(logits, rec.logits))

    # A later request that diverges after the relocated snapshot restores from it.
    diverged = prompt[:300] + other[:40]
    assert other[0] != prompt[300]
    got, stats = _run(snapping, diverged)
    assert stats["cached_tokens"] == RESUME
    want, cold = _run(_engine(model, tok, 256), diverged)
    assert cold["cached_tokens"] == 0
    assert got == want


def test_checkpoint_near_the_prompt_end_is_taken_at_the_end(monkeypatch, fast, tok, texts):
    base, other = texts
    rec = Recorder(monkeypatch, fast)
    # checkpoint_every 384: the grid point 384 lies 147 tokens after the resume point, 54 before the end
    prompt, out0, seq0 = _two_turns(_engine(fast, tok, 384, min_piece=0), base, rec)
    end = len(prompt)
    assert rec.prefill(end) == [(RESUME, 384 - RESUME), (384, end - 384)]
    assert 384 in seq0.snapshots

    snapping = _engine(fast, tok, 384)
    _, out, seq = _two_turns(snapping, base, rec)
    assert rec.prefill(end) == [(RESUME, end - RESUME)]
    assert out == out0
    assert seq.snapshots[end].kind == "checkpoint" and 384 not in seq.snapshots
    assert RESUME not in seq.snapshots  # 147 tokens from the resume point: not snapped there

    # A request that shares the whole prompt and continues otherwise (a regenerated answer, an
    # edited last message) restores the state after the last piece.
    diverged = prompt + [t for t in other[:40] if t != out[0]][:30]
    got, stats = _run(snapping, diverged)
    assert stats["cached_tokens"] == end
    want, cold = _run(_engine(fast, tok, 384), diverged)
    assert cold["cached_tokens"] == 0
    assert got == want


def test_system_and_stable_marks_never_move_and_absorb_nearby_checkpoints(monkeypatch, fast, tok, texts):
    base, _ = texts
    rec = Recorder(monkeypatch, fast)
    ids = base[:438]
    bounds = {"system_len": 200, "stable_len": 300}  # the grid point 256: 56 after one, 44 before the other
    _run(_engine(fast, tok, 256, min_piece=0), ids, **bounds)
    assert rec.prefill(438) == [(0, 200), (200, 56), (256, 44), (300, 138)]
    rec.reset()
    engine = _engine(fast, tok, 256)
    _run(engine, ids, **bounds)
    assert rec.prefill(438) == [(0, 200), (200, 100), (300, 138)]
    (seq,) = [s for s in engine.prefix.slots if s.tokens]
    assert {p: s.kind for p, s in seq.snapshots.items()} == {200: "system", 300: "stable"}


def test_prefill_steps_runs_breaks_at_its_start_and_end(monkeypatch, fast, texts):
    base, _ = texts
    state = fast.new_state()
    prefill(fast, state, base[:40], 1024)
    rec = Recorder(monkeypatch, fast)
    seen = []
    breaks = {p: (lambda st, p=p: seen.append((p, st.position, len(rec.calls)))) for p in (40, 70, 100)}
    prefill(fast, state, base[40:100], 1024, breaks)
    assert rec.calls == [(40, 30), (70, 30)]
    # the start's callback before any forward, the end's after the last piece
    assert seen == [(40, 40, 0), (70, 70, 1), (100, 100, 2)]


def test_checkpoint_min_piece_knob_reaches_the_prefix_cache(fast, tok):
    assert Q27Config().engine.checkpoint_min_piece == 128
    assert apply_env(Q27Config(), {"Q27_CHECKPOINT_MIN_PIECE": "0"}).engine.checkpoint_min_piece == 0
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, serving=True)
    cfg = Q27Config()
    apply_engine_arguments(cfg, parser.parse_args(["--checkpoint-min-piece", "64", "--checkpoint-every", "512"]))
    assert (cfg.engine.checkpoint_min_piece, cfg.engine.checkpoint_every) == (64, 512)
    engine = LocalEngine(cfg, fast, tok)
    assert (engine.prefix.checkpoint_min_piece, engine.prefix.checkpoint_every) == (64, 512)
    for bad in (-1, "128", True):
        cfg.engine.checkpoint_min_piece = bad
        with pytest.raises(ConfigError):
            LocalEngine(cfg, fast, tok)


# --------------------------------------------------------------------------- snapshot_positions


def _cache(every: int, min_piece: int) -> PrefixCache:
    cache = PrefixCache(None, checkpoint_every=every)
    cache.checkpoint_min_piece = min_piece
    return cache


def test_snapshot_positions_snap_checkpoints_and_keep_boundaries():
    prompt = [0] * 25278
    # the measured warm turn: resumed at 24,471, 807 new tokens, the grid point 24,576 105 tokens in
    cache = _cache(4096, 128)
    assert cache.snapshot_positions(24471, prompt, 25278, 2000) == {24471: "checkpoint", 25278: "stable"}
    assert cache.snapshot_positions(24471, prompt, 25278, 2000, taken={24471: None}) == {25278: "stable"}
    assert _cache(4096, 0).snapshot_positions(24471, prompt, 25278, 2000) == {24576: "checkpoint", 25278: "stable"}
    # a cold prompt: a grid point near the start has nothing to save (position 0), one near the
    # end is taken at the end, ones near boundary marks are those marks' snapshots
    cache = _cache(256, 128)
    assert cache.snapshot_positions(0, [0] * 1000, None, None) == {256: "checkpoint", 512: "checkpoint", 768: "checkpoint"}
    # a grid finer than the minimum keeps its inner points (only boundaries pull checkpoints)
    assert _cache(100, 128).snapshot_positions(0, [0] * 1000, None, None) == {
        **{p: "checkpoint" for p in range(200, 900, 100)}, 1000: "checkpoint"}
    assert cache.snapshot_positions(0, [0] * 1000, 700, 300) == {300: "system", 512: "checkpoint", 700: "stable"}
    assert cache.snapshot_positions(0, [0] * 896, 896, 300) == {300: "system", 512: "checkpoint", 768: "checkpoint",
                                                                 896: "stable"}  # 128 before it: kept
    assert cache.snapshot_positions(0, [0] * 895, 895, 300) == {300: "system", 512: "checkpoint", 895: "stable"}
    assert cache.snapshot_positions(0, [0] * 800, 800, 300) == {300: "system", 512: "checkpoint", 800: "stable"}
    assert cache.snapshot_positions(0, [0] * 800, None, 300) == {300: "system", 512: "checkpoint", 800: "checkpoint"}


def _old_positions(every, start, n, stable, system):
    """snapshot_positions before snapping (what checkpoint_min_piece = 0 must still give)."""
    marks = {}
    if every > 0:
        for p in range((start // every + 1) * every, n, every):
            marks[p] = "checkpoint"
    if system and start < system < n:
        marks[system] = "system"
    if stable and start < stable <= n:
        marks[stable] = "stable"
    return marks


def test_snapshot_positions_properties():
    rng = random.Random(7)
    for _ in range(3000):
        every = rng.choice([0, 64, 128, 256, 300, 4096])
        m = rng.choice([0, 1, 64, 128, 200])
        n = rng.randint(2, 3000)
        start = rng.choice([0, rng.randrange(0, n)])
        stable = rng.choice([None, 0, rng.randint(1, n)])
        system = rng.choice([None, rng.randint(1, n)])
        taken = {start} if rng.random() < 0.3 else set()
        chunk = rng.choice([0, 0, 100, 256, 1000])
        got = _cache(every, m).snapshot_positions(start, [0] * n, stable, system, taken=taken, chunk=chunk)
        old = _old_positions(every, start, n, stable, system)
        where = f"every={every} m={m} n={n} start={start} stable={stable} system={system} taken={taken} chunk={chunk}"
        if m == 0:
            assert got == old, where
        # prefill_steps' grid: every chunk from the start, starting over at each boundary mark
        bounds = sorted({start, *(p for p, k in old.items() if k != "checkpoint" and start < p < n)}) + [n]
        chunk_cuts = {c for a, b in zip(bounds, bounds[1:]) for c in range(a + chunk, b, chunk)} if chunk else set()
        # boundary marks exactly where they were, with their kinds
        assert {p: k for p, k in got.items() if k != "checkpoint"} == {p: k for p, k in old.items() if k != "checkpoint"}, where
        grid = list(range((start // every + 1) * every, n, every)) if every else []
        for p, k in got.items():
            assert start <= p <= n, where
            if k == "checkpoint":
                assert any(abs(p - g) < max(m, 1) for g in grid), where  # within the minimum of its grid point
                assert p != start or (start > 0 and start not in taken), where
        # no checkpoint cuts a piece shorter than m next to the start, the end or a boundary mark
        # (a checkpoint at the start or the end cuts nothing)
        cuts = sorted({start, n, *got, *chunk_cuts})
        inner = {p for p, k in got.items() if k == "checkpoint" and start < p < n and p not in chunk_cuts}
        for a, b in zip(cuts, cuts[1:]):
            if b - a < m and every >= m:
                assert a not in inner and b not in inner, where


def test_snapshot_positions_snap_to_the_prefills_own_chunk_cuts():
    """prefill_steps cuts every `chunk` tokens from the resume point, off the absolute grid: a long
    warm turn (24,471 + 8,000 tokens, 4,096-token chunks) cuts at 28,567, 105 tokens before the grid
    point 28,672 -- without the chunk cuts as edges that checkpoint stays and leaves a 105-token piece."""
    prompt = [0] * 32471
    cache = _cache(4096, 128)
    without = cache.snapshot_positions(24471, prompt, None, None)
    assert 28672 in without  # the thin piece [28567, 28672) the chunk grid would leave
    got = cache.snapshot_positions(24471, prompt, None, None, chunk=4096)
    assert got == {24471: "checkpoint", 28567: "checkpoint"}  # 24,576 snaps to the start, 28,672 to the cut
    assert 28672 not in got and 28567 in got
    cuts = sorted({24471, 32471, *range(24471 + 4096, 32471, 4096), *got})
    assert min(b - a for a, b in zip(cuts, cuts[1:])) >= 128
    # far from every cut the grid point stays: resumed at 20,000, the grid point 24,576 is 480 tokens
    # past the chunk cut 24,096
    assert 24576 in cache.snapshot_positions(20000, [0] * 26000, None, None, chunk=4096)
    # chunk 0 (or a chunk longer than the prompt) is the old behaviour
    assert cache.snapshot_positions(24471, prompt, None, None, chunk=0) == without
    assert cache.snapshot_positions(24471, prompt, None, None, chunk=1 << 20) == without
