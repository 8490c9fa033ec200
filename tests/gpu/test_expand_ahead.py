"""CPU checks of the prefill's expand-ahead pipeline (q27py/gpu/blas.py ExpandAhead): the GEMMs
and expansions it enqueues on two streams, run by a small simulator under many random orders of
the two streams (each stream in order, a wait blocking until its event is recorded), must always
have each GEMM read a buffer holding its own matrix's expansion: a buffer is never rewritten
before the GEMM reading it has run, never read before its expansion is done, and a wrong guess of
the next matrix costs only that expansion."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from q27py.gpu import blas


class _Stream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_event(self, ev):  # CUDA: binds the event's latest record at the time of the call
        self.log.append((self.name, "wait", (ev.id, ev.records)))

    def synchronize(self):
        self.log.append((self.name, "sync", None))

    def __enter__(self):
        _Fake.current.append(self)
        return self

    def __exit__(self, *a):
        _Fake.current.pop()


class _Event:
    n = 0

    def __init__(self, disable_timing=True):
        _Event.n += 1
        self.id, self.records = _Event.n, 0

    def record(self, stream):
        self.records += 1
        stream.log.append((stream.name, "record", (self.id, self.records)))


class _Buf:
    n = 0

    def __init__(self, nbytes):
        _Buf.n += 1
        self.id, self.nbytes = _Buf.n, nbytes


class _Fake:
    current: list = []

    def __init__(self):
        self.log = []
        self.main = _Stream(self.log, "main")
        _Fake.current[:] = [self.main]
        streams = iter(["side", "side2"])
        self.cp = SimpleNamespace(
            cuda=SimpleNamespace(get_current_stream=lambda: _Fake.current[-1],
                                 Stream=lambda non_blocking=True: _Stream(self.log, next(streams)),
                                 Event=_Event),
            empty=lambda n, dtype=None: _Buf(2 * n), uint16=None)


class _Matrix:  # what ExpandAhead reads of a GpuMatrix (weakly referenced, as GpuMatrix is)
    def __init__(self, name, rows, kpad):
        self.name, self.shape = name, SimpleNamespace(row_tiles=rows // 16, kpad=kpad)


def _matrix(name, rows=64, kpad=128):
    return _Matrix(name, rows, kpad)


def _simulate(log, seed):
    """Run the logged ops with the two streams interleaved at random; returns the GEMMs' reads."""
    rng = random.Random(seed)
    queues = {}
    syncs = []  # (host order, stream): a host synchronize() of that stream
    for seq, (st, op, arg) in enumerate(log):
        if op == "sync":
            syncs.append((seq, st))
        else:
            queues.setdefault(st, []).append((seq, op, arg))
    recorded, content, reads, done = set(), {}, [], set()

    def host_ordered(seq):  # every op the host enqueued after synchronize(S) waits for S's earlier ops
        return all(all(q2 in done for q2, (s2, op2, _) in enumerate(log) if s2 == st2 and q2 < k and op2 != "sync")
                   for k, st2 in syncs if k < seq)

    while any(queues.values()):
        ready = []
        for st, q in queues.items():
            if not q:
                continue
            seq, op, arg = q[0]
            if op == "wait" and arg[1] > 0 and arg not in recorded:
                continue  # a wait on an event never recorded yet is a no-op (CUDA)
            if host_ordered(seq):
                ready.append(st)
        assert ready, "deadlock"
        st = rng.choice(ready)
        seq, op, arg = queues[st].pop(0)
        done.add(seq)
        if op == "record":
            recorded.add(arg)
        elif op == "expand":
            content[arg[1]] = arg[0]
        elif op == "gemm":
            reads.append((arg[0], content.get(arg[1])))
    return reads


def _run(monkeypatch, calls):
    fake = _Fake()
    monkeypatch.setattr(blas.Runtime, "get", staticmethod(lambda: fake))

    def expand(m, out=None):
        fake.log.append((_Fake.current[-1].name, "expand", (m.name, out.id)))
        return out

    monkeypatch.setattr(blas, "dequantize_to_bf16", expand)
    ahead = blas.ExpandAhead()
    for m in calls:
        w, b = ahead.weights(m)
        fake.log.append(("main", "gemm", (m.name, w.id)))
        ahead.release(b, m)
    return fake.log


@pytest.mark.parametrize("seed", range(40))
def test_every_gemm_reads_its_own_expansion(monkeypatch, seed):
    mats = [_matrix(f"m{i}", rows=64 * (1 + i % 3)) for i in range(5)]
    calls = mats * 3  # three prefill chunks: from the second on, each next matrix is expanded ahead
    calls += [mats[0], mats[3], mats[1], mats[2], mats[4], mats[0]]  # guesses that go wrong
    log = _run(monkeypatch, calls)
    reads = _simulate(log, seed)
    assert [name for name, _ in reads] == [m.name for m in calls]
    assert all(name == got for name, got in reads), reads
    side = [a for st, op, a in log if st != "main" and op == "expand"]
    assert len(side) >= 2 * len(mats) - 1, "chunks after the first expand ahead on the side stream"


def test_wrong_guess_waits_for_the_side_stream_before_reusing_its_buffer(monkeypatch):
    a, b, c = _matrix("a"), _matrix("b"), _matrix("c")
    log = _run(monkeypatch, [a, b, a, c])  # after a, b is expected; c comes
    i_c = max(i for i, (st, op, arg) in enumerate(log) if op == "expand" and arg[0] == "c")
    pending = [i for i, (st, op, arg) in enumerate(log) if st == "side" and op == "expand" and arg[0] == "b"]
    assert pending, "b was expanded ahead after the second a"
    waits = [arg for st, op, arg in log[:i_c] if st == "main" and op == "wait"]
    side_done = [arg for st, op, arg in log[:i_c] if st == "side" and op == "record"]
    assert side_done[-1] in waits, "main waits for the wrong guess's expansion before overwriting its buffer"
    for seed in range(20):
        assert all(n == g for n, g in _simulate(log, seed))


def test_off_by_default_and_switchable(monkeypatch):
    from q27py.config import Q27Config, apply_env

    assert Q27Config().engine.prefill_expand_ahead is False
    assert apply_env(Q27Config(), {"Q27_PREFILL_EXPAND_AHEAD": "1"}).engine.prefill_expand_ahead is True
    monkeypatch.setattr(blas, "_EXPAND_AHEAD_SET", False)
    monkeypatch.setattr(blas, "_EXPAND_AHEAD", None)
    monkeypatch.delenv("Q27_PREFILL_EXPAND_AHEAD", raising=False)
    assert blas.expand_ahead() is None
    blas.set_expand_ahead(True)
    assert isinstance(blas.expand_ahead(), blas.ExpandAhead)
    blas.set_expand_ahead(False)
    assert blas.expand_ahead() is None
