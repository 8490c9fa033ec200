"""The forward-model interface the engine drives, in one place.

Three implementations: the numpy reference (model/reference.py, the specification), the CPU fast
path (model/fastcpu.py, a ReferenceModel) and the GPU fast path (gpu/forward.py FastModel). The
engine (engine/*.py) reads exactly these attributes and calls exactly these methods, never probing
for one (issue 10 item 5); tests/model/test_interface.py holds every implementation to the list.
What the engine keeps per sequence lives in typed fields of the states (SequenceState /
FastState: hidden_last, suffix_index), not in a side dict.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from q27py.model.config import ModelConfig


class ForwardModel(Protocol):
    cfg: ModelConfig
    has_mtp: bool  # a trained MTP head: mtp_forward works, speculative decoding can draft with it
    # The most tokens one forward returns hidden rows for (the fast path splits a longer forward
    # and keeps its last split's rows; the decoder feeds prefill pieces of at most this). None: any.
    chunk: int | None
    max_pos: int | None  # positions a state can hold (the fast path's sized KV); None: the engine's window
    # Sequences one decode_batch call takes (1: it runs one forward); 0: no batched step, the engine
    # keeps every slot's rounds solo.
    max_batch: int
    sized_slots: int | None  # slots the model sized its memory for at load; None: the engine's setting
    drafts_on_device: bool  # mtp_draft_chain runs the whole greedy MTP ladder in one device call
    # The most lanes (every group together) one verify_batch takes: the shared sweep's flat width, the
    # lanes a weight-bound sweep runs for about one step's cost. 0: no verify_batch (the engine keeps
    # drafts out of shared rounds: each sharing slot is one plain decode_batch lane).
    verify_lanes: int
    state_format: str  # what export_prefix's arrays mean (the prefix disk cache's compatibility hash)

    def new_state(self) -> Any: ...

    def reset_state(self, state) -> None:
        """Make `state` what new_state() gives, in its own memory: the prefix cache reuses an evicted
        sequence's state for a new prompt (the fast path allocates and zero-fills ~3 GB per state at
        a 44K window, ~50-100 ms, where a reset zeroes the recurrent state alone; its captured graphs
        stay valid)."""

    def forward(self, state, ids, logits_rows="all", verify: bool = False) -> Any:
        """Logits (host [R, V] for the requested rows), hidden rows (`hidden`, host [T, H];
        `hidden_owned()`, the model's own memory, the caller's to keep) and, for verify, a trace
        that commit() takes next."""

    def decode_batch(self, states: list, ids) -> list: ...

    def commit(self, state, trace, n: int) -> None: ...

    def verify_batch(self, states: list, groups: list) -> list:
        """Verify forwards of several sequences in one weight sweep (the shared round with drafts,
        engine/scheduler.py): group i = the tokens [pending, drafts..] of states[i] at its position..;
        output i is forward(states[i], groups[i], logits_rows="all", verify=True)'s, bitwise (logits
        [W_i, V], hidden rows, trace). At most max_batch distinct states, each group 1..16 tokens,
        verify_lanes tokens in all. Outputs are read before any other model call, and commit_batch
        follows directly (only where verify_lanes > 0)."""

    def commit_batch(self, states: list, traces: list, ns: list) -> None:
        """Keep the first ns[i] tokens of each group of the verify_batch just run (any subset of its
        states, each once): states[i] becomes that of ns[i] plain decode steps, as commit() does."""

    def mtp_forward(self, kv, hidden, next_ids, start: int, logits_rows="all") -> tuple[np.ndarray, np.ndarray]: ...

    def mtp_draft_chain(self, kv, hidden, next_ids, start: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """The greedy MTP ladder in one call (the ladder uses it where drafts_on_device; the CPU paths
        run it as the host ladder's steps): (ids [depth], top1 - top2 margins [depth])."""

    def mtp_draft_batch(self, kvs: list, hiddens: list, next_ids: list, starts: list, depth: int) -> list:
        """mtp_draft_chain for several sequences at once (the shared round's ladders): output i is
        mtp_draft_chain(kvs[i], hiddens[i], next_ids[i], starts[i], depth)'s, bitwise (the fast path:
        one weight sweep of the MTP layer per step for every chain). Used where drafts_on_device."""

    def save_recurrent(self, state) -> dict: ...

    def rewind(self, state, position: int, recurrent: dict) -> None: ...

    def export_prefix(self, state) -> dict[str, np.ndarray]: ...

    def import_prefix(self, state, arrays: dict[str, np.ndarray], position: int) -> None: ...


# The attributes (not methods) every implementation carries: the engine reads them unguarded.
ATTRIBUTES = ("cfg", "has_mtp", "chunk", "max_pos", "max_batch", "sized_slots", "drafts_on_device", "verify_lanes",
              "state_format")
METHODS = ("new_state", "reset_state", "forward", "decode_batch", "commit", "verify_batch", "commit_batch",
           "mtp_forward", "mtp_draft_chain", "mtp_draft_batch", "save_recurrent", "rewind", "export_prefix",
           "import_prefix")
