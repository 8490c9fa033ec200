"""The prefill's chunk grid starts over at the system / stable marks (decoder.chunk_cuts).

Why: a mark cuts a piece anyway; a grid kept from the resume point then left a short piece right
after it (bench replay's cold 25K turn: a system mark at 20,234, then 246 tokens to 20,480, and on
cuda every piece streams every bf16 expansion, ~16 ms, however few its tokens). And a warm turn
restored at the mark cuts from the mark: with the grid restarted there, a cold run cuts exactly as
the warm one does after it, so their rows come from the same pieces. What must hold:
- chunk_cuts: every chunk tokens from the start and from each restart, nothing else;
- prefill_steps: a break marked restarts_grid starts the grid over, a plain checkpoint break does not;
- through the engine (fast CPU path): the pieces after a system mark are full chunks from the
  mark, the same as a warm turn's restored at that mark, and the tokens match that warm turn's.
"""

from q27py.config import Q27Config
from q27py.engine.api import GenerationRequest
from q27py.engine.decoder import chunk_cuts
from q27py.engine.engine import LocalEngine
from fast_path_rules import Probe
from prefill_recorder import pieces


def test_chunk_cuts():
    assert chunk_cuts(0, 1000, 256) == [256, 512, 768]
    assert chunk_cuts(0, 1000, 256, [600]) == [256, 512, 856]
    assert chunk_cuts(100, 1000, 256, [600, 700]) == [356, 956]
    assert chunk_cuts(0, 1000, 256, [0, 1000, 2000]) == [256, 512, 768], "restarts outside (start, end) count not"
    assert chunk_cuts(0, 25278, 4096, [20234, 25273]) == [4096, 8192, 12288, 16384, 24330]


def test_a_boundary_mark_restarts_the_grid_and_a_checkpoint_does_not():
    def mark(restart):
        fn = lambda state: None  # noqa: E731
        fn.restarts_grid = restart
        return fn

    assert pieces(breaks={600: mark(True)}) == [256, 256, 88, 256, 144]
    assert pieces(breaks={600: mark(False)}) == [256, 256, 88, 168, 232], "a checkpoint break adds a cut, the grid stays"
    assert pieces(breaks={}) == [256, 256, 256, 232]


def _engine(model, tok, chunk=64):
    cfg = Q27Config()
    cfg.engine.max_slots = 1
    cfg.engine.checkpoint_every = 0
    cfg.engine.cpu_prefill_chunk = chunk
    cfg.spec.enabled = False
    return LocalEngine(cfg, model, tok)


def _run(engine, ids, **bounds):
    req = GenerationRequest(prompt_ids=ids, max_tokens=8, stop_ids=frozenset(), **bounds)
    return [t for c in engine.generate(req) for t in c.token_ids]


def test_cold_pieces_after_a_mark_are_the_warm_turns(fast, tok):
    ids = tok.encode("def parse(line):\n    return line.split(',')\n" * 40)[:300]
    assert len(ids) == 300
    system = 100  # not on the 64-token grid: the old grid left a 28-token piece (100 -> 128)
    probe = Probe(fast)
    cold = _run(_engine(probe, tok), ids, system_len=system)
    cold_pieces = [c[2] for c in probe.calls if c[0] == "forward" and c[2] > 1]
    assert cold_pieces == [64, 36, 64, 64, 64, 8], cold_pieces
    # a warm engine: the system block first (its snapshot at the mark), then the whole prompt restored there
    probe2 = Probe(fast)
    warm_engine = _engine(probe2, tok)
    _run(warm_engine, ids[:system] + tok.encode(" pass"), system_len=system)
    probe2.calls.clear()
    warm = _run(warm_engine, ids, system_len=system)
    warm_pieces = [c[2] for c in probe2.calls if c[0] == "forward" and c[2] > 1]
    assert warm_pieces == cold_pieces[2:], (warm_pieces, cold_pieces)
    assert warm == cold


def test_only_the_last_piece_asks_for_logits_and_hidden_last_is_set_where_read():
    """On the fast path reading a piece's logits row or its hidden_last is a device sync: the host waits
    for the piece before it enqueues the next. Only the prompt's last row needs logits (the first token)
    and only a break (a snapshot keeps hidden_last) and the end read hidden_last, so the pieces between
    ask for no logits and leave hidden_last unset (None): a cold prompt's pieces run back to back."""
    from types import SimpleNamespace

    from prefill_recorder import Recorder

    from q27py.engine.decoder import drive, prefill_steps

    seen = {}

    def snapshot(state):
        seen[state.position] = state.hidden_last

    model, state = Recorder(), SimpleNamespace(position=0, hidden_last=None)
    hidden_during = []
    inner = model.forward

    def forward(st, ids, logits_rows="last"):
        hidden_during.append(st.hidden_last)
        return inner(st, ids, logits_rows)

    model.forward = forward
    last = drive(prefill_steps(model, state, list(range(1000)), 256, breaks={600: snapshot}))
    assert model.pieces == [256, 256, 88, 168, 232]
    assert model.rows == ["none"] * 4 + ["last"]
    assert last.shape == (3,) and state.hidden_last is not None and state.hidden_last.shape == (1, 2)
    assert seen[600] is not None and seen[600].shape == (1, 2)  # the snapshot saw the row at its position
    assert hidden_during == [None, None, None, seen[600], None]
