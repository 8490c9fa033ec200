"""A tiny model object with the reference model's decoding interface, for fast statistical tests.

The next-token logits depend only on the last token (a Markov chain), so the
exact probability of any continuation is a product of table rows. Its "GDN
state" is the last token run through it, with the same verify/commit contract
as the reference model: verify records the state after every lane and leaves
the committed one alone; commit(n) installs lane n-1's. The MTP head predicts
the token after next from a second table, so drafts are right only sometimes.

StrictMarkovModel adds the fast path's (q27py/gpu/forward.py) usage rules, so the
decoders are tested against them on the CPU: `commit` must directly follow its
verify forward, and an output's hidden rows live in a scratch buffer that the
next model call overwrites.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from q27py.model.reference import ForwardOutput, Trace
from q27py.model.state import GDNState, KVCache, SequenceState


class MarkovModel:
    # model/interface.py ForwardModel's attributes: no length limit, window or batched step of its own
    chunk: int | None = None
    max_pos: int | None = None
    max_batch = 0
    sized_slots: int | None = None
    drafts_on_device = False
    verify_lanes = 0  # no verify_batch either: shared rounds (none: max_batch 0) would carry plain lanes
    state_format = "markov"

    def __init__(self, logits: np.ndarray, mtp_logits: np.ndarray | None = None):
        self.table = np.asarray(logits, dtype=np.float32)
        self.vocab = self.table.shape[0]
        self.mtp_table = None if mtp_logits is None else np.asarray(mtp_logits, dtype=np.float32)
        self.has_mtp = mtp_logits is not None
        self.cfg = SimpleNamespace(vocab_size=self.vocab)
        self.forward_calls = 0

    @classmethod
    def random(cls, vocab: int, seed: int, sharpness: float = 2.0, mtp_noise: float = 1.0) -> "MarkovModel":
        rng = np.random.default_rng(seed)
        main = rng.normal(size=(vocab, vocab)) * sharpness
        # MTP(next) ~ the main chain two steps ahead, blurred: right often, not always.
        p = np.exp(main - main.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        mtp = np.log(p @ p + 1e-9) + rng.normal(size=(vocab, vocab)) * mtp_noise
        return cls(main, mtp)

    def new_state(self) -> SequenceState:
        gdn = {0: GDNState(np.full((1, 1, 1), -1.0, dtype=np.float32), np.zeros((0, 1), dtype=np.float32))}
        return SequenceState(0, {}, gdn, KVCache(1, 1, np.float32) if self.has_mtp else None)

    def reset_state(self, state: SequenceState) -> None:
        fresh = self.new_state()
        state.position, state.kv, state.gdn, state.mtp_kv = fresh.position, fresh.kv, fresh.gdn, fresh.mtp_kv
        state.hidden_last, state.suffix_index = None, None

    def _hidden(self, ids) -> np.ndarray:
        return np.eye(self.vocab, dtype=np.float32)[np.asarray(ids, dtype=np.int64)]

    def forward(self, state: SequenceState, ids, logits_rows="all", verify: bool = False) -> ForwardOutput:
        self.forward_calls += 1
        ids = [int(t) for t in np.asarray(ids).reshape(-1)]
        logits = self.table[ids]
        hidden = self._hidden(ids)
        states = np.array(ids, dtype=np.float32).reshape(-1, 1, 1, 1)
        trace = None
        if verify:
            trace = Trace(len(ids), {0: states}, {0: np.zeros((len(ids), 0, 1), dtype=np.float32)})
        else:
            state.gdn[0] = GDNState(states[-1].copy(), np.zeros((0, 1), dtype=np.float32))
            state.position += len(ids)
        if isinstance(logits_rows, str):  # select_rows' words ("none": a prefill piece before the last)
            logits = {"all": logits, "last": logits[-1:], "none": logits[:0]}[logits_rows]
        else:
            logits = logits[np.asarray(logits_rows, dtype=np.int64)]
        return ForwardOutput(logits.copy(), hidden, trace)

    def commit(self, state: SequenceState, trace: Trace, n: int) -> None:
        assert 1 <= n <= trace.n_tokens
        state.position += n
        state.gdn[0] = GDNState(trace.recurrent[0][n - 1].copy(), trace.conv[0][n - 1].copy())

    def decode_batch(self, states, ids):
        raise NotImplementedError("max_batch 0: the engine never shares a round on this model")

    def verify_batch(self, states, groups):
        raise NotImplementedError("verify_lanes 0: the engine never runs a verify group on this model")

    def commit_batch(self, states, traces, ns):
        raise NotImplementedError("verify_lanes 0: nothing to commit")

    def mtp_draft_chain(self, kv, hidden, next_ids, start, depth):
        raise NotImplementedError("drafts_on_device False: the ladder runs its host steps")

    def mtp_draft_batch(self, kvs, hiddens, next_ids, starts, depth):
        raise NotImplementedError("drafts_on_device False: no batched chains")

    def mtp_forward(self, kv: KVCache, hidden, next_ids, start: int, logits_rows="all"):
        kv.truncate(start)
        next_ids = [int(t) for t in np.asarray(next_ids).reshape(-1)]
        assert len(next_ids) == np.asarray(hidden).shape[0]
        kv.append(np.zeros((len(next_ids), 1, 1), np.float32), np.zeros((len(next_ids), 1, 1), np.float32))
        logits = self.mtp_table[next_ids].copy()
        if isinstance(logits_rows, str):
            logits = {"all": logits, "last": logits[-1:], "none": logits[:0]}[logits_rows]
        else:
            logits = logits[np.asarray(logits_rows)]
        return logits, self._hidden(next_ids)

    def last_token(self, state: SequenceState) -> int:
        return int(state.gdn[0].recurrent.reshape(-1)[0])


class _ScratchOutput:
    def __init__(self, model: "StrictMarkovModel", out: ForwardOutput):
        self._model, self._epoch = model, model.epoch
        self.logits, self.trace, self._hidden = out.logits, out.trace, out.hidden

    @property
    def hidden(self):
        assert self._epoch == self._model.epoch, "hidden read after a later model call overwrote it"
        return self._hidden

    def hidden_owned(self, wait=True):
        """As the fast path's: a copy the caller keeps past later model calls."""
        return self.hidden.copy()


class StrictMarkovModel(MarkovModel):
    epoch = 0
    _pending = None

    chunk = 4  # like the fast path, a longer prefill returns the hidden rows of its last split only

    def forward(self, state, ids, logits_rows="all", verify=False):
        self.epoch += 1
        out = super().forward(state, ids, logits_rows, verify)
        if not verify:
            n = len(out.hidden)
            out.hidden = out.hidden[(n - 1) // self.chunk * self.chunk :]
        self._pending = out.trace
        return _ScratchOutput(self, out)

    def commit(self, state, trace, n):
        assert trace is not None and trace is self._pending, "commit must directly follow its verify forward"
        self.epoch += 1
        self._pending = None
        super().commit(state, trace, n)

    def mtp_forward(self, kv, hidden, next_ids, start, logits_rows="all"):
        self.epoch += 1
        self._pending = None
        return super().mtp_forward(kv, hidden, next_ids, start, logits_rows)
