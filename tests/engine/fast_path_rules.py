"""A CPU model under the CUDA fast path's rules (gpu/forward.py FastModel, FastOutput), for the
scheduler and batched-round tests: one scratch for every state, so an output (a whole decode_batch's
outputs) is readable only until the next forward / decode_batch / MTP call of any state, and commit
must follow its own verify forward. Interleaved slots that break either rule would corrupt each other
on the GPU; here they raise."""

from __future__ import annotations

import numpy as np


class _Out:
    """An output readable only until the probe's next model call (FastOutput's scratch rule)."""

    def __init__(self, probe, out):
        self._probe, self._out, self._serial = probe, out, probe.serial
        self.trace = out.trace

    def _fresh(self):
        if self._serial != self._probe.serial:
            raise RuntimeError("output read after a later model call reused the scratch")

    @property
    def logits(self):
        self._fresh()
        self._probe.logits_reads += 1
        return self._out.logits

    @property
    def hidden(self):
        self._fresh()
        return self._out.hidden

    def hidden_owned(self, wait=True):
        self._fresh()
        return self._out.hidden.copy()


class _DeviceOut(_Out):
    """... with FastOutput's device picks (numpy.argmax; the masked argmax of engine.constraint)."""

    def greedy_ids(self):
        self._fresh()
        return np.argmax(self._out.logits, axis=1)

    def masked_greedy_ids(self, picks, words):
        from q27py.engine.constraint import masked_argmax

        self._fresh()
        self._probe.masked_launches += 1
        return np.asarray([masked_argmax(self._out.logits[p], w) for p, w in zip(picks, words)])


class Probe:
    """A CPU model with one scratch for every state, as the CUDA fast path has: an output (a whole
    decode_batch's outputs) is readable until the next forward / decode_batch / MTP call of any
    state, and commit must follow its own verify forward (commit_batch its verify_batch). Logs every
    call: ("forward", state, T, verify), ("batch", B, states), ("groups", widths, states),
    ("commit_groups", ns, states), ("chain", 1, depth) and ("chains", B, depth); `fail_batch` makes
    decode_batch / verify_batch raise (after the lanes' states moved, as a device fault mid-batch would
    leave them); `fail_chains` = n makes the next n mtp_draft_batch calls raise."""

    def __init__(self, inner, max_batch=16, device=False, verify_lanes=None, drafts_on_device=None):
        self._m, self.max_batch, self._device = inner, max_batch, device
        # verify_batch's width (None: the inner model's; 0: a model without it, plain shared lanes only)
        self.verify_lanes = inner.verify_lanes if verify_lanes is None else verify_lanes
        # True: the ladder drafts through mtp_draft_chain and a shared round's ladders through one
        # mtp_draft_batch, as on the fast path (the CPU models run both as the host ladder's steps)
        self.drafts_on_device = inner.drafts_on_device if drafts_on_device is None else drafts_on_device
        self.serial, self.pending, self.calls = 0, None, []
        self.logits_reads = self.masked_launches = 0
        self.fail_batch = None  # a set of state ids: a batch holding one of them raises
        self.on_batch = None  # called inside decode_batch (a client leaving mid-forward)
        self.fail_chains = 0  # the next this many mtp_draft_batch calls raise

    def __getattr__(self, name):
        return getattr(self._m, name)

    def _wrap(self, out):
        return (_DeviceOut if self._device else _Out)(self, out)

    def forward(self, state, ids, logits_rows="all", verify=False):
        out = self._m.forward(state, ids, logits_rows=logits_rows, verify=verify)
        self.serial += 1
        self.calls.append(("forward", id(state), len(ids), verify))
        self.pending = (out.trace, id(state)) if verify else None
        return self._wrap(out)

    def decode_batch(self, states, ids):
        outs = self._m.decode_batch(states, ids)
        self.serial += 1
        self.pending = None
        self.calls.append(("batch", len(states), tuple(id(s) for s in states)))
        if self.on_batch is not None:
            self.on_batch()
        if self.fail_batch and any(id(s) in self.fail_batch for s in states):
            raise RuntimeError("device fault in decode_batch")
        return [self._wrap(o) for o in outs]

    def commit(self, state, trace, n):
        if self.pending is None or self.pending[0] is not trace or self.pending[1] != id(state):
            raise RuntimeError("commit must follow its verify forward, with no model call in between")
        self.pending = None
        self._m.commit(state, trace, n)

    def verify_batch(self, states, groups):
        outs = self._m.verify_batch(states, groups)
        self.serial += 1
        # commit_batch must come next: the groups' traces, by state
        self.pending = ("groups", {id(s): o.trace for s, o in zip(states, outs)})
        self.calls.append(("groups", tuple(len(g) for g in groups), tuple(id(s) for s in states)))
        if self.on_batch is not None:
            self.on_batch()
        if self.fail_batch and any(id(s) in self.fail_batch for s in states):
            raise RuntimeError("device fault in verify_batch")
        return [self._wrap(o) for o in outs]

    def commit_batch(self, states, traces, ns):
        held = self.pending[1] if self.pending is not None and self.pending[0] == "groups" else None
        if held is None or any(held.get(id(s)) is not t for s, t in zip(states, traces)) \
                or len({id(s) for s in states}) != len(states):
            raise RuntimeError("commit_batch must follow its verify_batch, with no model call in between")
        self.pending = None
        self.calls.append(("commit_groups", tuple(int(n) for n in ns), tuple(id(s) for s in states)))
        self._m.commit_batch(states, traces, ns)

    def mtp_forward(self, *args, **kwargs):
        self.serial += 1
        self.pending = None
        return self._m.mtp_forward(*args, **kwargs)

    def mtp_draft_chain(self, *args, **kwargs):
        self.serial += 1
        self.pending = None
        self.calls.append(("chain", 1, int(args[4] if len(args) > 4 else kwargs["depth"])))
        return self._m.mtp_draft_chain(*args, **kwargs)

    def mtp_draft_batch(self, kvs, hiddens, next_ids, starts, depth):
        self.serial += 1
        self.pending = None
        self.calls.append(("chains", len(kvs), int(depth)))
        if self.fail_chains:
            self.fail_chains -= 1
            raise RuntimeError("device fault in mtp_draft_batch")
        return self._m.mtp_draft_batch(kvs, hiddens, next_ids, starts, depth)

    def batches(self):
        return [c[1] for c in self.calls if c[0] == "batch"]

    def group_batches(self):
        """The widths of each verify_batch's groups, in call order."""
        return [c[1] for c in self.calls if c[0] == "groups"]
