"""The fast forward pass: the reference model's interface, built from the kernels in cuda/.

`FastModel` mirrors `q27py.model.reference.ReferenceModel`: new_state(), forward(state,
ids, logits_rows, verify) -> output with .logits (numpy) and .hidden, commit(state, trace,
n), mtp_forward(kv, hidden, next_ids, start). Its numerics follow the reference within the
tolerances stated in tests/gpu (fp32 activations and state; weights as the tier stores
them; the GEMV splits activations into bf16 hi+lo so products keep ~16 bits).

How one forward of T tokens ("lanes") runs (all enqueued on one stream, no host sync):
  embed -> per layer: RMSNorm, [GDN | attention], residual add fused into the output GEMV,
  RMSNorm, SwiGLU fused into the gate/up GEMV, down GEMV (+residual) -> final norm ->
  lm_head rows -> argmax with top1-top2 margin.
GEMVs stream the weights once per block of up to 16 lanes. Everything else runs all T lanes
in one launch. With gdn_fused (EngineConfig.gdn_fused, env Q27_GDN_FUSED=1) a decode / verify
GDN layer's conv, gates, delta-rule step, gated norm and window commit are one kernel
(cuda/gdn_decode.cu) with the chain's bits; prefill chunks keep the chain.

Speculative verify (verify=True) never writes committed state: GDN lanes read the committed
S and conv window and only emit outputs; their inputs stay recorded per layer (raw
in_proj rows, normalized q/k/v, g/beta) until `commit(n)` replays the first n of them with
the same kernel body -- so commit(n) leaves the bits of n decode steps. Attention writes
K/V rows past the committed position; rows past the accepted point are overwritten later.

Per-lane results never depend on how many lanes run together (GEMV split-K and attention
splits are chosen from shapes and pos0 only), so greedy output is width-invariant.

decode_batch(states, ids) runs one such forward whose lanes belong to different sequences (up to
max_batch = 16, EngineConfig.batch_sweep): the weights stream once for all of them. The kernels
that touch a sequence's state (q/k norm + RoPE + KV store, decode attention, GDN conv / step /
window, the fused GDN step) run through their *_lanes entries, which read each lane's state
addresses and position from a small device lane table the host writes first (so the captured graph
of a width serves any states) and run the one-sequence body as a one-token decode of that lane's
sequence; every lane's bits are its solo forward's.

verify_batch(states, groups) is that sweep with speculative drafts (EngineConfig.verify_groups): group i
= the tokens [pending, drafts..] of states[i], W_i consecutive lanes at positions p_i, p_i + 1, .., all
groups together at most verify_lanes = 16 (the records' span). The lane table gives every lane its state
and position (the KV stores, then attention, run per lane); a group table beside it (constants GT_*)
gives the kernels whose bits depend on the whole round -- the GDN conv taps and recurrence (lanes of one
sequence in order), attention's split size (from the round's pos0) -- each group, run by their *_groups
entries exactly as that sequence's solo verify runs them. So output i is forward(states[i], groups[i],
verify=True)'s bitwise, and commit_batch(states, traces, ns) replays each group's first ns[i] records
as commit() does (the window slide and the recurrence per group, every GDN layer in one launch each).

mtp_draft_batch(kvs, hiddens, next_ids, starts, depth) runs several sequences' MTP ladders (mtp_draft_chain: the
greedy draft chain on the device) in one MTP sweep per step, where the model has verify lanes: step 0 takes every
chain's backlog rows as groups of consecutive lanes (the KV stores per lane, attention per group through the
verify_batch group entries, from tables of its own: pack_mtp_tables), later steps one lane per chain; each chain's
last row is gathered for the lm_head, and the argmax feeds the next step on the device (cuda/chain.cu). Chain i's
drafts, margins and MTP KV rows are mtp_draft_chain's bitwise.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from q27py.gpu import constants as C
from q27py.gpu import kernels as K
from q27py.gpu import layout as L
from q27py.gpu.runtime import Runtime, i32, ptr, set_pdl_mode
from q27py.gpu.weights import LayerW, ModelWeights
from q27py.model.config import FULL, ModelConfig
from q27py.model.kvformat import get_format
from q27py.model.reference import select_rows

LOGIT_ROWS = 1024  # logits rows one forward chunk can return (compact storage, see FastModel.logits)
VERIFY_SPAN = 16  # lane capacity the attention split size is derived from (>= any verify width)
# Launches of more lanes than any verify (prefill chunks, MTP warm-up) run the tiled tensor-core
# attention, which reads each K/V tile once per 64 query rows instead of once per lane. Decode
# and verify keep the per-lane kernel, whose bits the gates and width invariance rely on.
PREFILL_ATTENTION = True
# fp8 KV on the attn_decode="mma" kernel: None = EngineConfig.attn_decode_fp8 (env Q27_ATTN_DECODE_FP8,
# default off until the device run of tools/device_fp8mma.sh); tests set True / False to force it
FP8_ATTN_MMA: bool | None = None


@dataclass
class FastTrace:
    """Handle of a verify forward: its records live in the model's scratch until commit."""

    n_tokens: int
    serial: int
    state_id: int


@dataclass
class FastGroupTrace(FastTrace):
    """Handle of group `group` of a verify_batch (lane rows first .. first + n_tokens - 1): its records
    live in those rows of the model's scratch until commit_batch. commit() refuses it (its rows are not
    a solo verify's), as commit_batch refuses a solo verify's trace."""

    group: int = 0
    first: int = 0


class FastOutput:
    """logits: numpy [R, V] for the requested rows (host copy on first use); hidden: post-norm
    [T, H] (host copy on first use); greedy_ids(): the device argmax of each requested row.

    Nothing is downloaded until asked for: a greedy round needs W token ids (W x 4 bytes), not
    W logits rows (W x 1 MB on the 27B) and a host argmax over each. Read before the next
    forward (the model reuses its scratch), as with hidden.
    """

    def __init__(self, model: "FastModel", t: int, rows: np.ndarray, trace: FastTrace | None):
        self._model = model
        self._t = t
        self.rows = rows
        self.trace = trace
        self._logits = None
        self._hidden = None
        self._serial = model._out_serial

    def _check_fresh(self) -> None:
        if self._serial != self._model._out_serial:
            raise RuntimeError("FastOutput read after a later forward reused the model's scratch")

    @property
    def logits(self) -> np.ndarray:
        if self._logits is None:
            self._check_fresh()
            self._logits = self._model._fetch_logits(self.rows)
        return self._logits

    def greedy_ids(self) -> np.ndarray:
        """numpy.argmax of each requested logits row (lowest index on ties), computed on the device."""
        if self._logits is not None:
            return np.argmax(self._logits, axis=1)
        self._check_fresh()
        return self._model._fetch_ids(self.rows)

    def masked_greedy_ids(self, picks: list[int], words: np.ndarray) -> np.ndarray:
        """For each pick p (an index into the requested rows, like logits[p]): the argmax of that
        row over the ids allowed by the packed bitmask words[i] (engine.constraint.pack_bits:
        numpy.argmax of the row with refused ids at -inf), computed on the device: one upload of
        the masks and W ids back instead of W logits rows."""
        if self._logits is not None:  # already on the host: the same choice there
            return _masked_argmax_host(self._logits, picks, words)
        self._check_fresh()
        u = np.unique(self.rows)
        compact = np.searchsorted(u, self.rows[np.asarray(picks, dtype=np.int64)])
        return self._model._fetch_masked_ids(compact, words)

    @property
    def hidden(self) -> np.ndarray:
        if self._hidden is None:
            self._check_fresh()
            m = self._model
            # on the model's stream (blocking): the forward that wrote them may still run there, and a get() on
            # the default stream would not wait for that non-blocking stream (tests/gpu/test_output_streams.py)
            self._hidden = m.hidden[: self._t, : m.cfg.hidden_size].get(stream=m.stream)
        return self._hidden

    @property
    def hidden_device(self):
        return self._model.hidden[: self._t]

    def hidden_owned(self, wait: bool = True):
        """The hidden rows [T, H] as a device array the caller owns (a copy: the next forward reuses
        the scratch). Why: the prefill's MTP warm-up reads every chunk's rows, and a host round trip
        (download, then upload by mtp_forward) of a 4,096-token chunk is 2 x 84 MB through pageable
        memory with the stream idle. wait (default): complete when returned, usable from any stream
        and by the host. wait=False: the copy is only queued on the model's stream -- what the
        model's own later calls read in order (mtp_forward) -- so the host need not wait for the
        forward (engine.decoder.prefill_steps: a piece's rows while the next piece is queued);
        engine.decoder.host_rows and drafters.concat_rows synchronize before they read such rows."""
        self._check_fresh()
        m = self._model
        with m.stream:
            rows = m.hidden[: self._t, : m.cfg.hidden_size].copy()
        if wait:
            m.stream.synchronize()
        return rows


def _masked_argmax_host(logits: np.ndarray, picks, words) -> np.ndarray:
    """numpy.argmax of logits[p] with the ids refused by the packed bitmask words[i] at -inf."""
    v = logits.shape[1]
    out = []
    for p, w in zip(picks, words):
        keep = np.unpackbits(np.ascontiguousarray(w, dtype="<u4").view(np.uint8), bitorder="little")[:v]
        out.append(int(np.argmax(np.where(keep.astype(bool), logits[p], -np.inf))))
    return np.asarray(out, dtype=np.int64)


class _LaneBatch:
    """What the outputs of one decode_batch call share: the model rows 0..n-1 they read, the
    freshness mark, and the greedy ids of all lanes (one n x 4-byte copy for the whole batch)."""

    def __init__(self, model: "FastModel", n: int):
        self.model = model
        self.n = n
        self.serial = model._out_serial
        self._ids = None

    def check_fresh(self) -> None:
        if self.serial != self.model._out_serial:
            raise RuntimeError("decode_batch output read after a later forward reused the model's scratch")

    def ids(self) -> np.ndarray:
        if self._ids is None:
            self.check_fresh()
            m = self.model
            self._ids = m.tok[: self.n].get(stream=m.stream).astype(np.int64)
        return self._ids


class FastGroupOutput:
    """Output i of FastModel.verify_batch: the surface of the FastOutput forward(states[i], groups[i],
    logits_rows="all", verify=True) returns, read from the group's rows first .. first + W - 1 of the
    model's buffers -- logits [W, V], greedy_ids() [W], masked_greedy_ids(picks, words), hidden [W, H]
    (post final norm), hidden_device, hidden_owned(), trace (a FastGroupTrace for commit_batch). Valid
    until the next forward / decode_batch / verify_batch / MTP call."""

    def __init__(self, batch: _LaneBatch, first: int, width: int, trace: "FastGroupTrace | None"):
        self._batch = batch
        self.first = first
        self._t = width
        self.rows = np.arange(width, dtype=np.int64)
        self.trace = trace
        self._logits = None
        self._hidden = None

    @property
    def logits(self) -> np.ndarray:
        if self._logits is None:
            self._batch.check_fresh()
            m = self._batch.model
            self._logits = m.logits[self.first : self.first + self._t].get(stream=m.stream)
        return self._logits

    def greedy_ids(self) -> np.ndarray:
        if self._logits is not None:
            return np.argmax(self._logits, axis=1)
        return self._batch.ids()[self.first : self.first + self._t]

    def masked_greedy_ids(self, picks: list[int], words: np.ndarray) -> np.ndarray:
        """As FastOutput.masked_greedy_ids; picks index the group's rows (0 .. W - 1)."""
        rows = self.rows[np.asarray(picks, dtype=np.int64)]  # IndexError for a row this output does not have
        if self._logits is not None:
            return _masked_argmax_host(self._logits, picks, words)
        self._batch.check_fresh()
        return self._batch.model._fetch_masked_ids(self.first + rows, words)

    @property
    def hidden(self) -> np.ndarray:
        if self._hidden is None:
            self._batch.check_fresh()
            m = self._batch.model
            self._hidden = m.hidden[self.first : self.first + self._t, : m.cfg.hidden_size].get(stream=m.stream)
        return self._hidden

    @property
    def hidden_device(self):
        return self._batch.model.hidden[self.first : self.first + self._t]

    def hidden_owned(self, wait: bool = True):
        """FastOutput.hidden_owned for the group's rows: a device copy the caller owns (complete when
        returned, unless wait=False: queued on the model's stream)."""
        self._batch.check_fresh()
        m = self._batch.model
        with m.stream:
            rows = m.hidden[self.first : self.first + self._t, : m.cfg.hidden_size].copy()
        if wait:
            m.stream.synchronize()
        return rows


def batch_sweep_default() -> bool:
    """EngineConfig.batch_sweep with Q27_BATCH_SWEEP applied (models built directly follow the env)."""
    from q27py.config import engine_env

    return bool(engine_env().batch_sweep)


def lane_table_words() -> int:
    """int64 words of the decode_batch lane table: LANES_MAX rows of LT_NFIELDS addresses, then
    LANES_MAX int32 positions and LANES_MAX int32 token ids (common.cuh lane_ptr / lane_positions)."""
    return C.LANES_MAX * C.LT_NFIELDS + C.LANES_MAX


def lane_table_ids_offset() -> int:
    """Index of the token ids in the table viewed as int32 (the positions sit LANES_MAX before it)."""
    return 2 * C.LANES_MAX * C.LT_NFIELDS + C.LANES_MAX


def pack_lane_table(addresses, positions, ids) -> np.ndarray:
    """Host image of the lane table for len(positions) lanes: addresses [lanes][LT_NFIELDS] (device
    addresses of each state's arrays, 0 for none), positions [lanes], ids [lanes]."""
    n = len(positions)
    if not 1 <= n <= C.LANES_MAX or len(ids) != n or len(addresses) != n:
        raise ValueError(f"a lane table holds 1..{C.LANES_MAX} lanes of one address row, position and id each")
    buf = np.zeros(lane_table_words(), dtype=np.int64)
    rows = np.asarray(addresses, dtype=np.int64).reshape(n, C.LT_NFIELDS)
    buf[: n * C.LT_NFIELDS] = rows.reshape(-1)
    words = buf.view(np.int32)
    at = lane_table_ids_offset()
    words[at - C.LANES_MAX : at - C.LANES_MAX + n] = np.asarray(positions, dtype=np.int32)
    words[at : at + n] = np.asarray(ids, dtype=np.int32)
    return buf


class FastLaneOutput(FastGroupOutput):
    """Output i of FastModel.decode_batch: the surface of the FastOutput a one-token forward of that
    sequence returns (logits_rows="all": one row), read from row i of the model's buffers --
    logits [1, V], greedy_ids() [1], masked_greedy_ids(picks, words), hidden [1, H] (post final
    norm), hidden_device, hidden_owned(), trace None: a one-row group. Valid until the next forward /
    decode_batch / MTP call."""

    def __init__(self, batch: _LaneBatch, lane: int):
        super().__init__(batch, lane, 1, None)
        self.lane = lane


class _GroupBatch(_LaneBatch):
    """What the outputs of one verify_batch share: _LaneBatch's rows 0..n-1, freshness mark and greedy ids,
    plus what commit_batch checks and replays (the group widths, the trace serial, the layer strides)."""

    def __init__(self, model: "FastModel", widths: list[int], serial: int, offs: tuple):
        super().__init__(model, sum(widths))
        self.widths = widths
        self.trace_serial = serial
        self.offs = offs

    def check_fresh(self) -> None:
        if self.serial != self.model._out_serial:
            raise RuntimeError("verify_batch output read after a later forward reused the model's scratch")


def verify_groups_default() -> bool:
    """EngineConfig.verify_groups with Q27_VERIFY_GROUPS applied (models built directly follow the env)."""
    from q27py.config import engine_env

    return bool(engine_env().verify_groups)


def group_table_words() -> int:
    """int64 words of the verify_batch group table (GT_NFIELDS x LANES_MAX int32, common.cuh group_field),
    which sits right after the lane table in one buffer: one upload per verify_batch."""
    return C.GT_NFIELDS * C.LANES_MAX // 2


def pack_group_table(widths, keep=None) -> np.ndarray:
    """Host image (int32, GT_NFIELDS x LANES_MAX) of the group table for groups of widths[g] consecutive lane
    rows from row 0: first rows, lane counts, kept counts (keep; zeros: commit_batch writes them) and each
    lane's group."""
    widths = [int(w) for w in widths]
    n = sum(widths)
    if not widths or min(widths) < 1 or n > C.LANES_MAX:
        raise ValueError(f"a group table holds 1..{C.LANES_MAX} lanes in groups of at least one lane")
    buf = np.zeros((C.GT_NFIELDS, C.LANES_MAX), dtype=np.int32)
    first = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int32)
    buf[C.GT_FIRST, : len(widths)] = first
    buf[C.GT_COUNT, : len(widths)] = widths
    if keep is not None:
        buf[C.GT_KEEP, : len(widths)] = np.asarray(keep, dtype=np.int32)
    buf[C.GT_GROUP, :n] = np.repeat(np.arange(len(widths), dtype=np.int32), widths)
    return buf.reshape(-1)


MTP_CHAIN_DEPTH = 8  # deepest MTP chain one device call runs (mtp_draft_chain / mtp_draft_batch draft buffers)


def mtp_tables_words() -> int:
    """int64 words of mtp_draft_batch's tables, one buffer (one upload per call): step 0's lane table and group
    table, then the chain steps' lane table and group table."""
    return 2 * (lane_table_words() + group_table_words())


def mtp_table_views(buf) -> tuple:
    """The kernels' views of mtp_draft_batch's table buffer (numpy or cupy, mtp_tables_words() int64): step 0's
    lane table, group table (int32) and token ids (int32), then the chain steps' three."""
    lw, gw, at = lane_table_words(), group_table_words(), lane_table_ids_offset()
    out = []
    for base in (0, lw + gw):
        lanes = buf[base : base + lw]
        out += [lanes, buf[base + lw : base + lw + gw].view(np.int32), lanes.view(np.int32)[at : at + C.LANES_MAX]]
    return tuple(out)


def pack_mtp_tables(addresses, starts, widths, ids) -> np.ndarray:
    """Host image of mtp_draft_batch's tables for chains i = 0.. of widths[i] backlog rows (starts[i]: the first
    row's MTP position, ids[i]: its widths[i] next ids, addresses[i]: its state's MTP KV lane-table row). Step 0:
    group i = chain i's rows, consecutive lanes at starts[i] .. starts[i] + widths[i] - 1, every row chain i's
    addresses. The chain steps: lane i = chain i at starts[i] + widths[i] (step 1's position; the step kernel
    moves it on and writes its ids), a group of one lane per chain."""
    widths = [int(w) for w in widths]
    nb = len(widths)
    if not (len(addresses) == len(starts) == len(ids) == nb) or any(len(x) != w for x, w in zip(ids, widths)):
        raise ValueError("mtp tables: one address row, start and id list of widths[i] ids per chain")
    rows, positions = [], []
    for a, s, w in zip(addresses, starts, widths):
        rows += [a] * w
        positions += range(int(s), int(s) + w)
    step0 = pack_lane_table(rows, positions, np.concatenate([np.asarray(x, dtype=np.int64) for x in ids]))
    chain = pack_lane_table(addresses, [int(s) + w for s, w in zip(starts, widths)], [0] * nb)
    return np.concatenate([step0, pack_group_table(widths).view(np.int64), chain,
                           pack_group_table([1] * nb).view(np.int64)])


def mtp_batch_parts(widths, lanes: int) -> list[list[int]]:
    """Chains (in order) cut into consecutive parts of at most `lanes` step-0 rows each: one MTP sweep per step
    for every chain of a part (a chain never wider than `lanes`)."""
    parts, rows = [], 0
    for i, w in enumerate(widths):
        if not parts or rows + w > lanes:
            parts.append([])
            rows = 0
        parts[-1].append(i)
        rows += w
    return parts


def check_groups(states, groups, max_batch: int, max_lanes: int, max_pos: int, vocab: int) -> list[np.ndarray]:
    """verify_batch's arguments: 1..max_batch distinct states, one group of 1..VERIFY_SPAN ids in range per
    state, at most max_lanes ids in all, room in every state's window for its group. Returns the groups
    as int64 arrays."""
    if len(states) != len(groups):
        raise ValueError(f"verify_batch: {len(states)} states but {len(groups)} groups")
    if not states:
        raise ValueError("verify_batch needs at least one sequence")
    if len(states) > max_batch:
        raise ValueError(f"verify_batch of {len(states)} sequences: at most {max_batch} per call")
    if len({id(s) for s in states}) != len(states):
        raise ValueError("verify_batch: the same sequence state twice in one call")
    out = [np.asarray(g, dtype=np.int64).reshape(-1) for g in groups]
    if any(not 1 <= g.size <= VERIFY_SPAN for g in out):
        raise ValueError(f"verify_batch: groups of 1..{VERIFY_SPAN} tokens")
    if sum(g.size for g in out) > max_lanes:
        raise ValueError(f"verify_batch: {sum(g.size for g in out)} tokens > {max_lanes} lanes in all")
    allids = np.concatenate(out)
    if allids.min() < 0 or allids.max() >= vocab:
        raise ValueError(f"token id out of range 0..{vocab - 1}")
    for s, g in zip(states, out):
        if s.position + g.size > max_pos:
            raise ValueError(f"context overflow: {s.position + g.size} > {max_pos} positions")
    return out


def check_batch(states, ids, max_batch: int, max_pos: int, vocab: int) -> np.ndarray:
    """decode_batch's arguments: 1..max_batch distinct states, one id in range each, room for one
    more position in every state's window. Returns the ids as int64."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    n = len(states)
    if n == 0:
        raise ValueError("decode_batch needs at least one sequence")
    if n > max_batch:
        raise ValueError(f"decode_batch of {n} sequences: at most {max_batch} per call")
    if ids.size != n:
        raise ValueError(f"decode_batch: {ids.size} token ids for {n} sequences")
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"token id out of range 0..{vocab - 1}")
    if len({id(s) for s in states}) != n:
        raise ValueError("decode_batch: the same sequence state twice in one call")
    for s in states:
        if s.position + 1 > max_pos:
            raise ValueError(f"context overflow: {s.position + 1} > {max_pos} positions")
    return ids


class MtpKV:
    """Host-side row count of a state's MTP KV cache (the device rows live in the state).

    Same surface as the reference KVCache the drafters use: `length` and `truncate(n)`.
    """

    def __init__(self, state: "FastState"):
        self.state = state
        self.length = 0

    def truncate(self, length: int) -> None:
        assert 0 <= length <= self.length
        self.length = length


def _release_graphs(model_ref, state_id: int) -> None:
    model = model_ref()
    if model is not None and model.graphs is not None:
        model.graphs.drop_id(state_id)


class FastState:
    """Per-sequence device state: KV caches, GDN recurrent state, conv windows, MTP KV, position."""

    _next_id = 0

    def __init__(self, model: "FastModel"):
        # Zero-filled on the model's stream: the forwards run there (non-blocking, so it would not
        # wait for fills on the legacy stream: a first prefill's KV stores could race the memset)
        with model.stream:
            self._allocate(model)

    def _allocate(self, model: "FastModel") -> None:
        cp = Runtime.get().cp
        cfg = model.cfg
        FastState._next_id += 1
        self.id = FastState._next_id
        self.model = model
        self.position = 0
        self.mtp_position = 0
        kv_dtype = {"bf16": cp.uint16, "fp8": cp.uint8}.get(model.kv_name, cp.float32)
        n_attn = len(cfg.full_layers)
        kv_shape = (max(n_attn, 1), cfg.num_key_value_heads, model.max_pos, cfg.head_dim)
        mtp_shape = (cfg.num_key_value_heads, model.max_pos, cfg.head_dim)
        rot = model.kv_bits  # rotated Lloyd-Max KV: K / V rows are hd * bits / 8 code bytes (u8)
        kd, vd = (cfg.head_dim * rot[0] // 8, cfg.head_dim * rot[1] // 8) if rot else (cfg.head_dim, cfg.head_dim)
        kv_dtype = cp.uint8 if rot else kv_dtype
        self.k = cp.zeros(kv_shape[:3] + (kd,), dtype=kv_dtype)
        self.v = cp.zeros(kv_shape[:3] + (vd,), dtype=kv_dtype)
        self.mtp_k = cp.zeros(mtp_shape[:2] + (kd,), dtype=kv_dtype) if model.has_mtp else None
        self.mtp_v = cp.zeros(mtp_shape[:2] + (vd,), dtype=kv_dtype) if model.has_mtp else None
        # k5v3 / k3v3: one fp16 corrected norm per (layer, kv head, position) for K and for V
        self.k_norm = cp.zeros(kv_shape[:3], dtype=cp.uint16) if rot else None
        self.v_norm = cp.zeros(kv_shape[:3], dtype=cp.uint16) if rot else None
        self.mtp_k_norm = cp.zeros(mtp_shape[:2], dtype=cp.uint16) if rot and model.has_mtp else None
        self.mtp_v_norm = cp.zeros(mtp_shape[:2], dtype=cp.uint16) if rot and model.has_mtp else None
        # fp8 KV: one int8 exponent per (layer, kv head, position) for K and for V (kvformat "fp8")
        fp8 = model.kv_name == "fp8"
        self.k_exp = cp.zeros(kv_shape[:3], dtype=cp.int8) if fp8 else None
        self.v_exp = cp.zeros(kv_shape[:3], dtype=cp.int8) if fp8 else None
        self.mtp_k_exp = cp.zeros(mtp_shape[:2], dtype=cp.int8) if fp8 and model.has_mtp else None
        self.mtp_v_exp = cp.zeros(mtp_shape[:2], dtype=cp.int8) if fp8 and model.has_mtp else None
        ng = max(len(cfg.linear_layers), 1)
        self.gdn = cp.zeros((ng, cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_key_head_dim),
                            dtype=cp.float32)
        self.window = cp.zeros((ng, cfg.linear_conv_kernel_dim - 1, cfg.gdn_conv_dim), dtype=cp.float32)
        # ctl[0] = main pos0, ctl[1] = MTP pos0, ctl[2] = accepted count for commit
        self.ctl = cp.zeros(4, dtype=cp.int32)
        self.mtp_kv = MtpKV(self) if model.has_mtp else None
        # what the engine keeps with a sequence (as on the reference SequenceState): the host hidden row
        # at position - 1 and the speculative decoder's suffix index
        self.hidden_last: np.ndarray | None = None
        self.suffix_index = None
        # when this state is freed (the prefix cache replaces a slot's state), its graphs go too
        weakref.finalize(self, _release_graphs, weakref.ref(model), self.id)

    def reset(self) -> None:
        self.position = 0
        self.mtp_position = 0
        if self.mtp_kv is not None:
            self.mtp_kv.length = 0
        self.hidden_last = None
        self.suffix_index = None
        with self.model.stream:  # in order with the forwards (see __init__)
            self.gdn.fill(0)
            self.window.fill(0)

    def gdn_state_reference_layout(self) -> dict[int, np.ndarray]:
        """GDN recurrent states as the reference stores them: layer -> [HV, dk, dv]."""
        g = self.gdn.get()
        return {li: g[j].transpose(0, 2, 1).copy() for j, li in enumerate(self.model.cfg.linear_layers)}

    def nbytes(self) -> int:
        n = self.k.nbytes + self.v.nbytes + self.gdn.nbytes + self.window.nbytes
        if self.mtp_k is not None:
            n += self.mtp_k.nbytes + self.mtp_v.nbytes
        for a in self.side_arrays().values():
            n += a.nbytes
        return int(n)

    def side_arrays(self) -> dict:
        """Per-row side data of the KV format, by export name: fp8 row exponents or rotated norms."""
        named = {"k.exp": self.k_exp, "v.exp": self.v_exp, "mtp.k.exp": self.mtp_k_exp, "mtp.v.exp": self.mtp_v_exp,
                 "k.norm": self.k_norm, "v.norm": self.v_norm, "mtp.k.norm": self.mtp_k_norm,
                 "mtp.v.norm": self.mtp_v_norm}
        return {name: a for name, a in named.items() if a is not None}

    def side_rows(self, ai: int | None) -> tuple:
        """(K side, V side) of attention layer ai (None: the MTP layer) for _attention; () for bf16 / f32."""
        for k, v, mk, mv in ((self.k_exp, self.v_exp, self.mtp_k_exp, self.mtp_v_exp),
                             (self.k_norm, self.v_norm, self.mtp_k_norm, self.mtp_v_norm)):
            if k is not None:
                return (mk, mv) if ai is None else (k[ai], v[ai])
        return ()


class FastModel:
    # model/interface.py ForwardModel: mtp_draft_chain runs the MTP ladder in one device call
    drafts_on_device = True

    def __init__(self, weights: ModelWeights, max_context: int = 4096, kv_dtype: str = "bf16", chunk: int = 64,
                 device_snapshot_bytes: int | None = None, gdn_fused: bool | None = None,
                 attn_decode: str | None = None, batch_sweep: bool | None = None,
                 verify_groups: bool | None = None):
        rt = Runtime.get()
        cp = rt.cp
        self.rt = rt
        self.w = weights
        self.cfg: ModelConfig = weights.cfg
        cfg = self.cfg
        check_supported(cfg)
        self.has_mtp = weights.mtp is not None
        if kv_dtype not in ("f32",) + FAST_KV_FORMATS:
            raise ValueError(f"fast path KV storage {kv_dtype!r}: f32, {', '.join(FAST_KV_FORMATS)}")
        self.kv_bf16 = kv_dtype == "bf16"
        self.kv_name = kv_dtype
        # k5v3 / k3v3: (K bits, V bits) and the codebooks (centroids, edges) as device tables
        self.kv_bits = K.ROTATED_KV_BITS.get(kv_dtype)
        self.kv_tables = {b: K.rotated_kv_tables(b) for b in set(self.kv_bits)} if self.kv_bits else None
        self.context_budget = None  # set by size_context_to_memory (--max-context auto)
        # slots sized from memory (--max-slots auto; size_context_to_memory): EngineConfig.slots(sized)
        self.sized_slots: int | None = None
        self.slot_plan = None  # kvbudget.SlotPlan of that sizing
        self.max_pos = int(max_context)
        self.chunk = max(VERIFY_SPAN, int(chunk))  # lanes per forward launch (prefill chunk)
        T = self.chunk
        h = cfg.hidden_size
        self.hp = L.round_up(h, 64)
        self.ws = K.Workspace()
        z = lambda *shape: cp.zeros(shape, dtype=cp.float32)  # noqa: E731  (pads stay zero forever)
        self.h = z(T, self.hp)
        self.x = z(T, self.hp)
        self.hidden = z(T, self.hp)
        self.ids = cp.zeros(T, dtype=cp.int32)
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        c = cfg.gdn_conv_dim
        self.ld_proj = L.round_up(c + hv * dv, 4)
        ng = max(len(cfg.linear_layers), 1)
        # GDN records, per layer (they outlive a verify forward until commit): verify widths only.
        # Prefill chunks (t > VERIFY_SPAN) never commit from records, so they share one scratch
        # of T rows -- at T = 4096 per-layer records would cost 48 x T x 107 KB = 21 GB.
        R = VERIFY_SPAN
        self.proj = z(ng, R, self.ld_proj)
        self.qkvn = z(ng, R, c)
        self.gb = z(ng, R, 2 * hv)
        self.proj_big = z(T, self.ld_proj) if T > R else None
        self.qkvn_big = z(T, c) if T > R else None
        self.gb_big = z(T, 2 * hv) if T > R else None
        self.ab = z(T, 2 * hv)
        # decode / verify GDN step as one kernel (EngineConfig.gdn_fused; None: the env default).
        # Its tickets (window per key head, norm per value head) are left zero by every launch.
        self.gdn_fused = K.gdn_fused_default() if gdn_fused is None else bool(gdn_fused)
        self.gdn_fused_warps = C.GDN_FD_WARPS
        # constants GDN_GATES_IN_CONV: decode / verify convs compute the decay / beta gates themselves (_gates_in_conv).
        # Not beside the fused step, which reads the GEMV's gates: its model's verify_batch runs the chain
        # (_gdn_groups), which must keep the solo verify's bits (tests/gpu/test_verify_groups_gpu.py fused cases)
        self.gates_in_conv = bool(C.GDN_GATES_IN_CONV) and not self.gdn_fused
        # constants NORM_FOLD: the norm _norm left for its plan's run to replay (plan, K.NormIn), taken by _take_norm
        self._norm_folded: tuple | None = None
        self.gdn_tickets = cp.zeros(cfg.linear_num_key_heads + hv, dtype=cp.int32)
        # decode_batch: one weight sweep for up to max_batch sequences (one lane each, GEMV lanes).
        # The lane table (lane_table_words: per lane its state's base addresses, then positions,
        # then ids) is written by the host before each call -- one upload -- and read by the lane
        # kernels, so a graph captured for n lanes serves any n states. The fused GDN entry takes
        # h + hv tickets per lane.
        # batch_sweep (EngineConfig.batch_sweep, env Q27_BATCH_SWEEP; None: the env default): off keeps
        # max_batch = 1, so callers that respect it run every sequence through its own forward
        self.batch_sweep = batch_sweep_default() if batch_sweep is None else bool(batch_sweep)
        self.max_batch = min(C.LANES_MAX, VERIFY_SPAN) if self.batch_sweep else 1
        # verify_batch (EngineConfig.verify_groups, env Q27_VERIFY_GROUPS; None: the env default): the shared
        # sweep with drafts, up to verify_lanes lanes of all groups together -- the GEMV's flat width, which
        # the per-layer GDN records (VERIFY_SPAN rows) also hold. 0 (switched off, batch_sweep off, or a KV
        # format without lane kernels: k5v3 / k3v3): the engine keeps drafts out of shared rounds.
        verify_groups = verify_groups_default() if verify_groups is None else bool(verify_groups)
        self.verify_lanes = (min(C.LANES_MAX, VERIFY_SPAN) if verify_groups and self.batch_sweep
                             and self._groups_supported() else 0)
        # the group table (group_table_words) sits right after the lane table: one upload per verify_batch;
        # commit_batch rewrites its kept counts (group_keep) only
        lw = lane_table_words()
        self.lane_buf = cp.zeros(lw + group_table_words(), dtype=cp.int64)
        self.lane_table = self.lane_buf[:lw]
        self.group_table = self.lane_buf[lw:].view(cp.int32)
        self.group_keep = self.group_table[C.GT_KEEP * C.LANES_MAX : (C.GT_KEEP + 1) * C.LANES_MAX]
        at = lane_table_ids_offset()
        self.lane_ids = self.lane_table.view(cp.int32)[at : at + C.LANES_MAX]
        self.gdn_tickets_lanes = cp.zeros((C.LANES_MAX, cfg.linear_num_key_heads + hv), dtype=cp.int32)
        # chunked2 GDN route: per-chunk W, U / V_new, start states and gates of one prefill chunk
        # (kernels.gdn2_scratch_floats: 412.1 MB for the 27B at T = 4096). Allocated here when the
        # route is on at load (so --max-context auto counts it), else on first use (_gdn2_scratch).
        self.gdn2_scratch = None
        if K.GDN_PREFILL == "chunked2" and T > R:
            self._gdn2_scratch()
        self.o_gdn = z(T, hv * dv)
        self.ld_xo = L.round_up(hv * dv, 64)
        self.xo = z(T, self.ld_xo)
        # attention
        self.ld_qg = 2 * nq * hd
        self.qg = z(T, self.ld_qg)
        self.kvp = z(T, 2 * nkv * hd)
        self.qbuf = z(T, nq * hd)
        self.ld_xa = L.round_up(nq * hd, 64)
        self.xa = z(T, self.ld_xa)
        # split-K partials: decode / verify lanes only, unless this card cannot run the tiled
        # prefill attention (then prefill chunks take the per-lane kernel too)
        # The tiled-prefill switch is read once here: the partials buffer below is sized by it, so a
        # model built with it on must never route a prefill chunk to the per-lane kernel later (that
        # kernel would write T lanes of partials into a VERIFY_SPAN-lane buffer).
        self.prefill_attention = PREFILL_ATTENTION
        part_lanes = VERIFY_SPAN if (self.prefill_attention and K.attention_prefill_fits(hd, self.kv_bf16)) else T
        # decode / verify attention kernel (EngineConfig.attn_decode): "mma" where the shape fits at the
        # verify capacity -- decided once here from the shape, so every width takes the same kernel
        self.attn_decode = K.attn_decode_mode(K.attn_decode_default() if attn_decode is None else attn_decode)
        # fp8 KV keeps the split kernel unless FP8_ATTN_MMA / EngineConfig.attn_decode_fp8 (issue 17: the
        # 27B probe's fp8 rows died with an illegal address in device run 3; most likely the probe's
        # inputs raced its stream). Decided once here like attn_decode: main layers, the MTP layer, every width and
        # restored prefixes all take the same kernel, and self.part is sized for it below.
        fp8_mma = K.attn_decode_fp8_default() if FP8_ATTN_MMA is None else bool(FP8_ATTN_MMA)
        self.attn_mma = (self.attn_decode == "mma" and (kv_dtype == "bf16" or (kv_dtype == "fp8" and fp8_mma))
                         and K.attention_mma_supported(hd, nq, nkv, VERIFY_SPAN, kv_dtype == "fp8", self.max_pos))
        nsplit = max(K.ATT_NSPLIT, K.attention_mma_splits(nkv, rt.sm_count)) if self.attn_mma else K.ATT_NSPLIT
        self.part = cp.zeros(K.attention_partials_floats(part_lanes, nq, hd, nsplit), dtype=cp.float32)
        # prefill attention v2: partials of rows past the first key block (allocated now when the
        # engine runs v2, else on first use: benches and tests switch K.ATTN_PREFILL after loading)
        self._pf2_part = None
        if K.ATTN_PREFILL == "v2":
            self._pf2_scratch()
        rd = cfg.rotary_dim
        inv = 1.0 / (cfg.rope_theta ** (np.arange(0, rd, 2, dtype=np.float64) / rd))
        self.inv_freq = cp.asarray(inv)
        # MLP
        self.ld_act = L.round_up(cfg.intermediate_size, 64)
        self.act = z(T, self.ld_act)
        # prefill chunks: bf16 rows of the GEMM inputs, written by their producers (the norms, the GDN
        # output norm, the SwiGLU epilogue) for the matrices on cuBLAS's bf16 route instead of fp32 rows
        # converted afterwards (GemvPlan.gemm_inputs; same bytes). Pads stay zero (never written).
        zb = lambda *shape: cp.zeros(shape, dtype=cp.uint16) if T > VERIFY_SPAN else None  # noqa: E731
        self.xb, self.xob, self.actb = zb(T, self.hp), zb(T, self.ld_xo), zb(T, self.ld_act)
        # logits + argmax. Rows are stored compactly (the i-th requested row of a launch in row i),
        # so a long prefill chunk does not need T x vocab floats (4 GB at T = 4096 on the 27B).
        self.vocab = cfg.vocab_size
        self.logit_rows = min(T, LOGIT_ROWS)
        self.logits = z(self.logit_rows, self.vocab)
        self.top2_part = cp.zeros((T, K.TOP2_BLOCKS, 2), dtype=cp.uint64)
        self.tok = cp.zeros(T, dtype=cp.int32)
        self.top1 = z(T)
        self.margin = z(T)
        # MTP
        self.ld_cat = L.round_up(2 * h, 64)
        self.cat = z(T, self.ld_cat)
        self.mtp_hidden_in = z(T, self.hp)
        self.mtp_out = z(T, self.hp)
        self.mtp_ids = cp.zeros(T, dtype=cp.int32)
        # mtp_draft_batch: several chains in one MTP sweep per step, through the verify_batch group entries (so
        # on where the model has verify lanes: mtp_batch_lanes). Its tables (pack_mtp_tables: step 0's lane +
        # group table, the chain steps' lane + group table) sit in a buffer of their own, so a verify_batch's
        # tables outlive a batch of chains until its commit_batch; the drafts and margins of every chain come
        # back in one download (mtp_chain_step_lanes' rows).
        self.mtp_lane_buf = cp.zeros(mtp_tables_words(), dtype=cp.int64)
        (self.mtp_lanes0, self.mtp_groups0, self.mtp_ids0,
         self.mtp_lanes1, self.mtp_groups1, self.mtp_ids1) = mtp_table_views(self.mtp_lane_buf)
        self.mtp_batch_out = cp.zeros(C.LANES_MAX * 2 * MTP_CHAIN_DEPTH, dtype=cp.int32)
        self._plans()
        self._serial = 0
        self._out_serial = 0  # bumped by every forward / mtp_forward: outputs older than it are stale
        self._pending: FastTrace | None = None
        self._pending_groups: _GroupBatch | None = None  # the verify_batch commit_batch may follow
        self.graphs = None  # q27py.gpu.graphs.GraphCache, attached by enable_graphs()
        self.stream = cp.cuda.Stream(non_blocking=True)
        # every buffer above was zero-filled on the legacy stream, which self.stream does not wait for
        cp.cuda.Stream.null.synchronize()
        # prefix snapshots kept on the device up to this many bytes (host copies beyond)
        self.device_snapshot_bytes = min(4 << 30, rt.total_mem // 10) if device_snapshot_bytes is None \
            else int(device_snapshot_bytes)
        # snapshots past the device budget: pinned host copies up to this many bytes (save_recurrent), pageable beyond
        self.pinned_snapshot_bytes = 8 << 30

    def _gdn2_scratch(self):
        """The chunked2 route's scratch for a prefill chunk of self.chunk lanes (any pos0), or None
        when this model's GDN shape has no chunked2 kernels (the route then falls back)."""
        cfg = self.cfg
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if self.gdn2_scratch is None and cfg.linear_layers and K.gdn2_stages(dk, dv):
            n = K.gdn2_scratch_floats(K.gdn2_max_chunks(self.chunk), hv, dk, dv)
            self.gdn2_scratch = self.rt.cp.empty(n, dtype=self.rt.cp.float32)
        return self.gdn2_scratch

    # ------------------------------------------------------------------ GEMV plans
    def _plans(self) -> None:
        ws = self.ws
        self.layer_plans = []
        gi = 0
        for lw in self.w.layers:
            self.layer_plans.append(self._layer_plan(lw, gi))
            if lw.kind != FULL:
                gi += 1
        # NORM_TAIL bit 2: the next layer's input norm, as _input_norm would launch it, in down's last CTA (the last
        # layer's down is followed by the final norm, whose rows feed the lm_head's own path: no tail there)
        for lw, p, q in zip(self.w.layers[1:], self.layer_plans, self.layer_plans[1:]):
            p["down"].set_norm_tail(K.NormIn(self.h, self.hp, lw.input_ln, self.cfg.rms_norm_eps, self.cfg.hidden_size,
                                             self.x, self.hp), q["in"], bit=2)
        self.lm_plan = K.GemvPlan([self.w.lm_head], [(self.logits, self.vocab)], ws)
        if self.has_mtp:
            m = self.w.mtp
            self.mtp_fc_plan = K.GemvPlan([m.fc], [(self.h, self.hp)], ws)
            self.mtp_layer_plan = self._layer_plan(m.layer, None)
        self.set_gemv_prefetch(K.gemv_prefetch_default())

    def set_gemv_prefetch(self, mb: float) -> None:
        """Link each GEMV of a step to the next for the L2 prefetch (cuda/gemv.cu gemv_prefetch),
        mb MiB per gap (0: off). In place: graphs captured before keep working with the new ranges.
        Order: a decode step's plans (per layer in, out, up, down; then the lm_head, followed by the
        next step's first layer); the MTP head's chain (fc, its layer) ends in the same lm_head."""
        self.gemv_prefetch_mb = float(mb)
        budget = K.prefetch_budget_bytes(mb, Runtime.get().l2_bytes)
        order = ("in", "out", "up", "down")
        main = [p[k] for p in self.layer_plans for k in order] + [self.lm_plan]
        K.link_prefetch(main, budget)
        if self.has_mtp:
            K.link_prefetch([self.mtp_fc_plan] + [self.mtp_layer_plan[k] for k in order] + [self.lm_plan], budget,
                            cyclic=False)

    def _layer_plan(self, lw: LayerW, gi: int | None) -> dict:
        ws = self.ws
        # down reads its a8 activations from buffers of its own, which gate_up's epilogue writes while gate_up
        # still reads its input from the shared ones (GemvPlan quant_into: no quant_act8 launch between them)
        down = K.GemvPlan([lw.down], [(self.h, self.hp)], ws, act8_slot=1)
        p = {"up": K.GemvPlan([lw.gate_up], [(self.act, self.ld_act)], ws, quant_into=down if C.A8_FOLD & 4 else None,
                              walk_into=down),
             "down": down}
        if lw.kind == FULL:
            a = lw.attn
            p["in"] = K.GemvPlan([a.q, a.kv], [(self.qg, self.ld_qg), (self.kvp, self.kvp.shape[1])], ws)
            p["out"] = K.GemvPlan([a.o], [(self.h, self.hp)], ws)
        else:
            g = lw.gdn
            p["in"] = K.GemvPlan([g.qkvz, g.ab], [(self.proj[gi], self.ld_proj), (self.ab, self.ab.shape[1])], ws)
            if self.proj_big is not None:  # prefill chunks write the shared scratch, not the records
                p["in_big"] = K.GemvPlan([g.qkvz, g.ab], [(self.proj_big, self.ld_proj), (self.ab, self.ab.shape[1])], ws)
            p["out"] = K.GemvPlan([g.out], [(self.h, self.hp)], ws)
            p["gi"] = gi
        # NORM_TAIL: the post-attention norm, as _mlp's _norm would launch it, in the out projection's last CTA
        p["out"].set_norm_tail(K.NormIn(self.h, self.hp, lw.post_ln, self.cfg.rms_norm_eps, self.cfg.hidden_size,
                                        self.x, self.hp), p["up"], bit=1)
        return p

    # ------------------------------------------------------------------ public interface
    def new_state(self) -> FastState:
        return FastState(self)

    def reset_state(self, state: FastState) -> None:
        """new_state()'s state in the same memory: positions to 0, GDN state and conv windows zeroed (on
        the model's stream). KV rows need no clearing: a row is written before any forward reads it."""
        if state.model is not self:
            raise ValueError("reset_state: a state of another model")
        state.reset()

    def forward(self, state: FastState, ids, logits_rows="all", verify: bool = False) -> FastOutput:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        t = int(ids.shape[0])
        if t == 0:
            raise ValueError("forward needs at least one token")
        if ids.min() < 0 or ids.max() >= self.cfg.vocab_size:
            raise ValueError(f"token id out of range 0..{self.cfg.vocab_size - 1}")
        if state.position + t > self.max_pos:
            raise ValueError(f"context overflow: {state.position + t} > {self.max_pos} positions")
        if verify and t > VERIFY_SPAN:
            raise ValueError(f"verify width {t} > {VERIFY_SPAN}")
        rows = select_rows(t, logits_rows)
        self._pending = None
        self._pending_groups = None
        self._out_serial += 1
        with self.stream:
            if t > self.chunk:
                # prefill in chunks; only the last chunk's rows can be returned
                done = 0
                while t - done > self.chunk:
                    self._run_main(state, ids[done : done + self.chunk], verify=False, rows=np.zeros(0, np.int64))
                    done += self.chunk
                rest = rows - done
                if rest.size and rest.min() < 0:
                    raise ValueError("logits rows before the last prefill chunk are not kept")
                self._run_main(state, ids[done:], verify=False, rows=rest)
                out = FastOutput(self, t - done, rest, None)
            else:
                self._run_main(state, ids, verify=verify, rows=rows)
                trace = None
                if verify:
                    self._serial += 1
                    trace = FastTrace(t, self._serial, state.id)
                    self._pending = trace
                out = FastOutput(self, t, rows, trace)
        return out

    def decode_batch(self, states: list[FastState], ids) -> list:
        """One weight sweep for len(states) sequences: lane i is ids[i], the next token of states[i]
        at states[i].position, committed exactly as forward(states[i], [ids[i]]) commits it -- and
        bitwise so: logits, greedy id, hidden row and the state afterwards (KV row, GDN state, conv
        window) are that solo call's whatever the other lanes and their number are. Every
        state-dependent kernel runs its one-sequence body per lane on that lane's own state (the
        lane table); norms, GEMVs, lm_head and argmax run all lanes at once and are width-invariant.

        Returns one FastLaneOutput per state (FastOutput's surface for its one row), valid until the
        next forward / decode_batch / MTP call. At most max_batch states, distinct, each with room
        for one more position. One state: forward(). KV formats without lane kernels (k5v3 / k3v3)
        and a fused GDN step wider than its lane entry take one forward per state (same outputs)."""
        states = list(states)
        ids = check_batch(states, ids, self.max_batch, self.max_pos, self.cfg.vocab_size)
        for st in states:
            if st.model is not self:
                raise ValueError("decode_batch: a state of another model")
        n = len(states)
        if n == 1:
            return [self.forward(states[0], ids[:1])]
        if not self._lanes_supported():
            return self._decode_batch_loop(states, ids)
        offs = self._lane_layer_strides(states)
        table = pack_lane_table([self._lane_addresses(st) for st in states], [st.position for st in states], ids)
        self._pending = None
        self._pending_groups = None
        self._out_serial += 1
        with self.stream:
            self.lane_table.set(table, stream=self.stream)
            if self.graphs is not None:  # model-level key: the table carries every state pointer
                self.graphs.run_model(("batch", n) + offs, lambda: self.enqueue_batch(n, offs))
            else:
                self.enqueue_batch(n, offs)
        for st in states:
            st.position += 1
        batch = _LaneBatch(self, n)
        return [FastLaneOutput(batch, i) for i in range(n)]

    def _lanes_supported(self) -> bool:
        """Whether decode_batch has lane kernels for this model's decode path: f32 / bf16 / fp8 KV
        (the split or mma attention as a one-token decode picks it), and the GDN step as decode
        runs it (the chain, or the fused kernel within its lane entry's bounds)."""
        if self.kv_bits is not None:
            return False
        cfg = self.cfg
        shape = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                 cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim)
        if self.gdn_fused and K.gdn_fused_supported(*shape, 1, self.gdn_fused_warps):
            return K.gdn_fused_lanes_supported(*shape, self.gdn_fused_warps)
        return True

    @property
    def mtp_batch_lanes(self) -> int:
        """Step-0 rows one batch of MTP chains takes in all (mtp_draft_batch, through the verify_batch group
        entries): the model's verify lanes where it has an MTP head; 0 = one chain at a time."""
        return self.verify_lanes if self.has_mtp else 0

    def _groups_supported(self) -> bool:
        """Whether verify_batch has group kernels for this model: f32 / bf16 / fp8 KV (the rotated formats
        have no lane kernels). The GDN step runs the chain's group entries even where gdn_fused is on (the
        fused kernel is bitwise the chain: cuda/gdn_decode.cu, tests/gpu/test_gdn_fused.py)."""
        return self.kv_bits is None

    @staticmethod
    def _lane_addresses(st: FastState) -> list[int]:
        """A state's row of the lane table (constants LT_*): layer-0 addresses of its arrays."""
        row = [0] * C.LT_NFIELDS
        for field, arr in ((C.LT_K, st.k), (C.LT_V, st.v), (C.LT_KX, st.k_exp), (C.LT_VX, st.v_exp),
                           (C.LT_GDN, st.gdn), (C.LT_WIN, st.window)):
            row[field] = 0 if arr is None else int(arr.data.ptr)
        return row

    @staticmethod
    def _lane_layer_strides(states: list[FastState]) -> tuple[int, int, int, int]:
        """Bytes from one layer to the next in a state's K / V, fp8 exponents, GDN state and window.
        The lane kernels add layer x stride to each lane's base address, so every state of the batch
        must have the same shapes (true for one model's states; checked, since a graph bakes them)."""
        def strides(st):
            return (st.k.strides[0], 0 if st.k_exp is None else st.k_exp.strides[0], st.gdn.strides[0],
                    st.window.strides[0], st.k.shape, st.gdn.shape, st.window.shape)
        first = strides(states[0])
        if any(strides(st) != first for st in states[1:]):
            raise ValueError("decode_batch: states of different shapes")
        if states[0].k.shape[2] != states[0].model.max_pos:  # the kernels address rows by the model's window
            raise ValueError("decode_batch: a state allocated for another window than the model's")
        return tuple(int(x) for x in first[:4])

    def _decode_batch_loop(self, states: list[FastState], ids: np.ndarray) -> list:
        """decode_batch as one forward per state. Lanes run last to first and each one's results move
        from row 0 to row i of the model's buffers: a one-token forward writes row 0 only, so the
        rows of the lanes already done stay, and the outputs read rows as the batched path's do."""
        n = len(states)
        for i in range(n - 1, -1, -1):
            self.forward(states[i], ids[i : i + 1])
            if i:
                with self.stream:
                    for buf in (self.logits, self.hidden, self.tok, self.top1, self.margin):
                        buf[i] = buf[0]
        batch = _LaneBatch(self, n)
        return [FastLaneOutput(batch, i) for i in range(n)]

    def commit(self, state: FastState, trace: FastTrace, n: int) -> None:
        """Keep the first n lanes of the last verify: state becomes that of n plain steps."""
        if self._pending is None or trace.serial != self._pending.serial or trace.state_id != state.id:
            raise RuntimeError("commit must follow its verify forward, with no forward in between")
        if not 1 <= n <= trace.n_tokens:
            raise ValueError(f"commit n={n} outside 1..{trace.n_tokens}")
        with self.stream:
            state.ctl[2:3].set(np.array([n], dtype=np.int32), stream=self.stream)
            if self.graphs is not None:
                self.graphs.run(state, ("commit",), lambda: self.enqueue_commit(state))
            else:
                self.enqueue_commit(state)
        state.position += n
        self._pending = None
        self._pending_groups = None

    def verify_batch(self, states: list[FastState], groups: list) -> list:
        """Verify forwards of several sequences in one weight sweep (model/interface.py): group i = the
        tokens [pending, drafts..] of states[i] at its position..; output i (a FastGroupOutput) is what
        forward(states[i], groups[i], logits_rows="all", verify=True) returns, bitwise: logits [W_i, V],
        device greedy ids, hidden rows -- and commit_batch then leaves each state as commit() would.

        Group i runs as lanes r0_i .. r0_i + W_i - 1 (consecutive, in call order), each a row of the lane
        table with states[i]'s addresses, position + j and token j. Norms, GEMVs, lm_head and argmax run
        all lanes at once (width-invariant); the KV stores and per-lane attention read the lane table
        (every store of the sweep lands before the attention launch, so lane j sees its group's rows
        p .. p + j); what depends on the whole round (attention's split size, the conv taps over the
        group's earlier raw rows, the recurrence over its lanes in order) runs per group through the
        *_groups entries, from the group table. Like a verify forward, nothing committed is written:
        KV rows past each position are overwritten later, GDN inputs stay in rows r0_i.. of the records.

        At most max_batch distinct states, groups of 1..VERIFY_SPAN tokens, verify_lanes tokens in all;
        ValueError when verify_lanes is 0 (EngineConfig.verify_groups off, batch_sweep off, or rotated KV).
        Outputs are valid until the next forward / decode_batch / verify_batch / MTP call."""
        if not self.verify_lanes:
            raise ValueError("verify_batch: this model has no verify lanes (EngineConfig.verify_groups / batch_sweep "
                             "off, or a KV format without lane kernels)")
        states = list(states)
        groups = check_groups(states, groups, self.max_batch, self.verify_lanes, self.max_pos, self.cfg.vocab_size)
        for st in states:
            if st.model is not self:
                raise ValueError("verify_batch: a state of another model")
        offs = self._lane_layer_strides(states)
        widths = [int(g.size) for g in groups]
        addresses, positions = [], []
        for st, w in zip(states, widths):
            row = self._lane_addresses(st)
            addresses += [row] * w
            positions += range(st.position, st.position + w)
        image = np.concatenate([pack_lane_table(addresses, positions, np.concatenate(groups)),
                                pack_group_table(widths).view(np.int64)])
        n, ng = sum(widths), len(widths)
        self._pending = None
        self._pending_groups = None
        self._out_serial += 1
        with self.stream:
            self.lane_buf.set(image, stream=self.stream)
            # model-level key: the tables carry every state pointer, position and width, so one graph per
            # (lanes, groups) serves every split of the lanes into that many groups, for any states
            if self.graphs is not None:
                self.graphs.run_model(("groups", n, ng) + offs, lambda: self.enqueue_groups(n, ng, offs))
            else:
                self.enqueue_groups(n, ng, offs)
        self._serial += 1
        batch = _GroupBatch(self, widths, self._serial, offs)
        self._pending_groups = batch
        first = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(int).tolist()
        return [FastGroupOutput(batch, first[i], widths[i], FastGroupTrace(widths[i], self._serial, st.id, i, first[i]))
                for i, st in enumerate(states)]

    def commit_batch(self, states: list[FastState], traces: list, ns: list) -> None:
        """Keep the first ns[i] tokens (1..W_i) of each listed group of the verify_batch just run (any subset
        of its states, each once; traces[i] is states[i]'s output's trace): states[i] becomes that of ns[i]
        plain decode steps, bitwise forward(verify=True) + commit(ns[i]). Must follow its verify_batch with
        no forward / decode_batch / verify_batch / commit / rewind in between (RuntimeError), as commit()
        its verify. One launch per kind for every group and GDN layer: the window slide by the kept raw
        rows, then the recurrence replayed over the kept records (kept counts in the group table; groups
        not listed keep 0: untouched)."""
        if not self.verify_lanes:
            raise ValueError("commit_batch: this model has no verify lanes (no verify_batch to commit)")
        states, traces = list(states), list(traces)
        ns = [int(n) for n in ns]
        if not len(states) == len(traces) == len(ns):
            raise ValueError("commit_batch: one trace and one count per state")
        batch = self._pending_groups
        if batch is None or any(not isinstance(tr, FastGroupTrace) or tr.serial != batch.trace_serial
                                or tr.state_id != st.id for st, tr in zip(states, traces)):
            raise RuntimeError("commit_batch must follow its verify_batch, with no forward in between")
        if len({tr.group for tr in traces}) != len(traces):
            raise ValueError("commit_batch: a group twice")
        for tr, n in zip(traces, ns):
            if not 1 <= n <= tr.n_tokens:
                raise ValueError(f"commit_batch n={n} outside 1..{tr.n_tokens}")
        keep = np.zeros(C.LANES_MAX, dtype=np.int32)
        for tr, n in zip(traces, ns):
            keep[tr.group] = n
        ng = len(batch.widths)
        if states:
            with self.stream:
                self.group_keep.set(keep, stream=self.stream)
                if self.graphs is not None:
                    self.graphs.run_model(("commit-groups", ng) + batch.offs,
                                          lambda: self.enqueue_commit_groups(ng, batch.offs))
                else:
                    self.enqueue_commit_groups(ng, batch.offs)
        for st, n in zip(states, ns):
            st.position += n
        self._pending_groups = None

    def mtp_forward(self, kv: MtpKV, hidden, next_ids, start: int, logits_rows="all") -> tuple[np.ndarray, np.ndarray]:
        """One MTP pass over rows at positions start.. (writes their MTP KV rows); host arrays out.

        kv is state.mtp_kv (as on the reference path): rows past `start` are dropped first.
        logits_rows="none" (the KV warm-up) downloads nothing and returns no hidden rows.
        """
        if not self.has_mtp:
            raise RuntimeError("this model has no MTP head")
        state = kv.state
        if start > kv.length:
            raise ValueError(f"MTP rows must be contiguous: start {start} > {kv.length} rows")
        kv.truncate(start)
        cp = self.rt.cp
        next_ids = np.asarray(next_ids, dtype=np.int64).reshape(-1)
        t = int(next_ids.shape[0])
        hid = hidden if isinstance(hidden, cp.ndarray) else cp.asarray(np.asarray(hidden, dtype=np.float32))
        # Warming MTP rows during prefill needs no logits: skipping the lm_head there saves
        # a GEMM and a [rows x vocab] download per chunk.
        want = select_rows(t, logits_rows)
        if want.size:
            self._out_serial += 1  # the logits rows of an earlier forward's output are overwritten
        logits_out, hm_out = [], []
        h = self.cfg.hidden_size
        with self.stream:
            for s0 in range(0, t, self.chunk):
                n = min(self.chunk, t - s0)
                self.mtp_ids[:n].set(next_ids[s0 : s0 + n].astype(np.int32), stream=self.stream)
                self.mtp_hidden_in[:n, :h] = hid[s0 : s0 + n, :h]
                state.ctl[1:2].set(np.array([start + s0], dtype=np.int32), stream=self.stream)
                local = want[(want >= s0) & (want < s0 + n)] - s0
                if local.size == n:
                    mode = "all"
                else:
                    mode = tuple(int(r) for r in local)
                if self.graphs is not None and n <= VERIFY_SPAN:
                    self.graphs.run(state, ("mtp", n, mode), lambda: self.enqueue_mtp(state, n, "all" if mode == "all" else local))
                else:
                    self.enqueue_mtp(state, n, "all" if mode == "all" else local, pos0=start + s0)
                if local.size:
                    logits_out.append(self._fetch_logits(local))
                if want.size:  # "none" is the warm-up: nobody reads its hidden rows, skip the download
                    hm_out.append(self.mtp_out[:n, :h].get(stream=self.stream))
        state.mtp_position = start + t
        kv.length = start + t
        logits = np.concatenate(logits_out) if logits_out else np.zeros((0, self.vocab), dtype=np.float32)
        return logits, np.concatenate(hm_out) if hm_out else np.zeros((0, h), dtype=np.float32)

    def mtp_draft_chain(self, kv: MtpKV, hidden, next_ids, start: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """A whole greedy MTP ladder on the device: step 0 over the t rows at start.. (their KV rows
        are committed rows, kept), then depth - 1 steps each fed the previous step's argmax and
        post-norm output. Returns (draft ids [depth], top1 - top2 margins [depth]) in one download.

        The drafts are what MTPLadder.draft computes on the host (device argmax = numpy.argmax);
        the caller applies the confidence gate to the margins and truncates the KV to start + t.
        One CUDA graph per (t, depth); backlogs over VERIFY_SPAN rows are written first.
        """
        if not self.has_mtp:
            raise RuntimeError("this model has no MTP head")
        cp = self.rt.cp
        rows = hidden if isinstance(hidden, cp.ndarray) else np.asarray(hidden, dtype=np.float32)
        next_ids = np.asarray(next_ids, dtype=np.int64).reshape(-1)
        t = int(next_ids.shape[0])
        if t > VERIFY_SPAN:  # long backlog (suffix rounds): plain warm-up rows first
            self.mtp_forward(kv, rows[: t - 1], next_ids[: t - 1], start, logits_rows="none")
            rows, next_ids, start, t = rows[t - 1 :], next_ids[t - 1 :], start + t - 1, 1
        state = kv.state
        if start > kv.length:
            raise ValueError(f"MTP rows must be contiguous: start {start} > {kv.length} rows")
        kv.truncate(start)
        depth = max(1, int(depth))
        if not hasattr(self, "_chain_draft"):
            self._chain_draft = cp.zeros(MTP_CHAIN_DEPTH, dtype=cp.int32)
            self._chain_margin = cp.zeros(MTP_CHAIN_DEPTH, dtype=cp.float32)
        if depth > self._chain_draft.size:
            raise ValueError(f"MTP chain depth {depth} > {self._chain_draft.size}")
        h = self.cfg.hidden_size
        self._out_serial += 1
        hid = rows if isinstance(rows, cp.ndarray) else cp.asarray(rows)
        with self.stream:
            self.mtp_ids[:t].set(next_ids.astype(np.int32), stream=self.stream)
            self.mtp_hidden_in[:t, :h] = hid[:t, :h]
            state.ctl[1:2].set(np.array([start], dtype=np.int32), stream=self.stream)
            if self.graphs is not None:
                self.graphs.run(state, ("mtp-chain", t, depth), lambda: self.enqueue_mtp_chain(state, t, depth))
            else:
                self.enqueue_mtp_chain(state, t, depth)
            ids = self._chain_draft[:depth].get(stream=self.stream).astype(np.int64)
            margins = self._chain_margin[:depth].get(stream=self.stream)
        kv.length = start + t + depth - 1
        state.mtp_position = kv.length
        return ids, margins

    def mtp_draft_batch(self, kvs: list, hiddens: list, next_ids: list, starts: list, depth: int) -> list:
        """mtp_draft_chain for several sequences (the shared round's ladders, engine.run_drafts): output i is
        mtp_draft_chain(kvs[i], hiddens[i], next_ids[i], starts[i], depth)'s, bitwise (draft ids [depth] int64,
        margins [depth] float32), and each kv is left as that call leaves it (length and mtp_position start + t
        + depth - 1, MTP KV rows start .. written with the same bits).

        One MTP sweep (+ lm_head and argmax) per step for every chain: step 0 runs the chains' backlog rows as
        groups of consecutive lanes (group i = chain i's t_i rows at positions start_i ..; KV stores per lane,
        attention per group through the verify_batch group entries: each group as its solo step 0's launch, its
        pos0 and split size), then each chain's last row is gathered to row i (mtp_gather_last) for the lm_head
        and the next step's hidden input; steps 1 .. depth - 1 run one lane per chain at its own position (a
        group of one: its solo step's one-lane launch), fed its argmax (mtp_chain_step_lanes). The norms, GEMVs,
        lm_head and argmax run every lane at once and are width-invariant. One model-level graph per (rows,
        chains, depth) -- the tables (pack_mtp_tables, uploaded first) carry every state address, position and
        width -- and one download of every chain's ids and margins.

        Chains are cut into parts of at most mtp_batch_lanes step-0 rows (mtp_batch_parts); backlogs over
        VERIFY_SPAN rows are warmed first, as mtp_draft_chain does (their last row is the chain's step 0).
        Where the model has no verify lanes (mtp_batch_lanes 0: verify_groups / batch_sweep off, rotated KV)
        or a state appears twice, the chains run one mtp_draft_chain each, in order (the same outputs).

        Every chain runs `depth` steps (the engine asks for the deepest chain's), but a chain near the end of the
        window has no KV rows for them all: one whose step rows would pass max_pos (start + t + depth - 1 >
        max_pos) runs alone, mtp_draft_chain of the `room` = max_pos - (start + t) + 1 steps its rows allow, the
        steps past it padded (id 0, margin -inf: any gate stops there; the caller's own depth never reaches
        them where its verify fits the window) and its kv left at start + t + room - 1 rows -- where the solo
        chain of `depth` steps would have stored past the window."""
        if not len(kvs) == len(hiddens) == len(next_ids) == len(starts):
            raise ValueError("mtp_draft_batch: one MTP KV, row block, id list and start per chain")
        if not self.has_mtp:
            raise RuntimeError("this model has no MTP head")
        kvs, hiddens = list(kvs), list(hiddens)
        ids = [np.asarray(x, dtype=np.int64).reshape(-1) for x in next_ids]
        starts = [int(s) for s in starts]
        if not self.mtp_batch_lanes or len({id(kv.state) for kv in kvs}) != len(kvs):
            return [self._mtp_chain_in_window(kv, h, x, s, depth) for kv, h, x, s in zip(kvs, hiddens, ids, starts)]
        depth = max(1, int(depth))
        if depth > MTP_CHAIN_DEPTH:
            raise ValueError(f"MTP chain depth {depth} > {MTP_CHAIN_DEPTH}")
        for kv, x, s in zip(kvs, ids, starts):
            if kv.state.model is not self:
                raise ValueError("mtp_draft_batch: a state of another model")
            if x.size == 0:
                raise ValueError("mtp_draft_batch: a chain needs at least one row")
            if x.min() < 0 or x.max() >= self.cfg.vocab_size:
                raise ValueError(f"token id out of range 0..{self.cfg.vocab_size - 1}")
            if not 0 <= s <= kv.length:
                raise ValueError(f"MTP rows must be contiguous: start {s} > {kv.length} rows")
            if s + x.size > self.max_pos:
                raise ValueError(f"context overflow: {s + x.size} > {self.max_pos} MTP positions")
            if kv.state.mtp_k.shape[1] != self.max_pos:  # the kernels address rows by the model's window
                raise ValueError("mtp_draft_batch: a state allocated for another window than the model's")
        out: list = [None] * len(kvs)
        fit = [i for i, (x, s) in enumerate(zip(ids, starts)) if s + x.size + depth - 1 <= self.max_pos]
        for i in sorted(set(range(len(kvs))) - set(fit)):  # near the window's end: alone, as deep as its rows allow
            out[i] = self._mtp_chain_in_window(kvs[i], hiddens[i], ids[i], starts[i], depth)
        widths = [ids[i].size if ids[i].size <= VERIFY_SPAN else 1 for i in fit]
        for part in mtp_batch_parts(widths, self.mtp_batch_lanes):
            got = self._mtp_batch_part([(kvs[fit[j]], hiddens[fit[j]], ids[fit[j]], starts[fit[j]]) for j in part], depth)
            for j, r in zip(part, got):
                out[fit[j]] = r
        return out

    def _mtp_chain_in_window(self, kv: MtpKV, hidden, next_ids, start: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """mtp_draft_chain(kv, hidden, next_ids, start, depth), or where its step rows would pass the window
        (start + t + depth - 1 > max_pos, t >= 1 rows fitting) the chain of the room = max_pos - (start + t) + 1
        steps left, padded to depth with id 0 and margin -inf (mtp_draft_batch)."""
        depth = max(1, int(depth))
        t = int(np.asarray(next_ids).size)
        room = self.max_pos - (start + t) + 1
        if t < 1 or room < 1 or room >= depth:
            return self.mtp_draft_chain(kv, hidden, next_ids, start, depth)
        ids, margins = self.mtp_draft_chain(kv, hidden, next_ids, start, room)
        return (np.concatenate([ids, np.zeros(depth - room, np.int64)]),
                np.concatenate([margins, np.full(depth - room, -np.inf, np.float32)]))

    def _mtp_batch_part(self, chains: list, depth: int) -> list:
        """mtp_draft_batch for chains (kv, rows, next ids, start) of at most mtp_batch_lanes step-0 rows in all,
        distinct states, checked: one upload of the tables, the hidden rows, one graph, one download."""
        cp = self.rt.cp
        h = self.cfg.hidden_size
        prepared = []
        for kv, rows, ids, start in chains:
            rows = rows if isinstance(rows, cp.ndarray) else np.asarray(rows, dtype=np.float32)
            t = int(ids.size)
            if t > VERIFY_SPAN:  # long backlog: plain warm-up rows first, as mtp_draft_chain
                self.mtp_forward(kv, rows[: t - 1], ids[: t - 1], start, logits_rows="none")
                rows, ids, start, t = rows[t - 1 :], ids[t - 1 :], start + t - 1, 1
            kv.truncate(start)
            prepared.append((kv, rows, ids, start, t))
        widths = [p[4] for p in prepared]
        n, nb = sum(widths), len(prepared)
        image = pack_mtp_tables([self._mtp_lane_addresses(p[0].state) for p in prepared], [p[3] for p in prepared],
                                widths, [p[2] for p in prepared])
        self._out_serial += 1
        with self.stream:
            self.mtp_lane_buf.set(image, stream=self.stream)
            r = 0
            for kv, rows, ids, start, t in prepared:
                hid = rows if isinstance(rows, cp.ndarray) else cp.asarray(rows)  # uploaded on the model's stream
                self.mtp_hidden_in[r : r + t, :h] = hid[:t, :h]
                r += t
            # model-level key: the tables carry every state address, position and width
            if self.graphs is not None:
                self.graphs.run_model(("mtp-batch", n, nb, depth), lambda: self.enqueue_mtp_batch(n, nb, depth))
            else:
                self.enqueue_mtp_batch(n, nb, depth)
            res = self.mtp_batch_out[: nb * 2 * depth].get(stream=self.stream).reshape(nb, 2 * depth)
        out = []
        for i, (kv, rows, ids, start, t) in enumerate(prepared):
            kv.length = start + t + depth - 1
            kv.state.mtp_position = kv.length
            out.append((res[i, :depth].astype(np.int64), np.ascontiguousarray(res[i, depth:]).view(np.float32)))
        return out

    @staticmethod
    def _mtp_lane_addresses(st: FastState) -> list[int]:
        """A state's lane-table row for its MTP layer: the MTP K / V rows (and fp8 exponents) in the K / V fields,
        laid out as one attention layer's (so layer offset 0); no GDN arrays."""
        row = [0] * C.LT_NFIELDS
        for field, arr in ((C.LT_K, st.mtp_k), (C.LT_V, st.mtp_v), (C.LT_KX, st.mtp_k_exp), (C.LT_VX, st.mtp_v_exp)):
            row[field] = 0 if arr is None else int(arr.data.ptr)
        return row

    # ------------------------------------------------------------------ device-side steps
    def _run_main(self, state: FastState, ids: np.ndarray, verify: bool, rows: np.ndarray) -> None:
        t = int(ids.shape[0])
        self.ids[:t].set(ids.astype(np.int32), stream=self.stream)
        state.ctl[0:1].set(np.array([state.position], dtype=np.int32), stream=self.stream)
        key = ("main", t, verify, tuple(int(r) for r in rows))
        if self.graphs is not None and t <= VERIFY_SPAN:
            self.graphs.run(state, key, lambda: self.enqueue_main(state, t, verify, rows))
        else:
            self.enqueue_main(state, t, verify, rows)
        if not verify:
            state.position += t

    def enqueue_main(self, state: FastState, t: int, verify: bool, rows) -> None:
        """The whole forward for t lanes already in self.ids, at pos0 = state.ctl[0]."""
        cfg = self.cfg
        h, hp = cfg.hidden_size, self.hp
        eps = cfg.rms_norm_eps
        self._norm_folded = None  # a forward cut short (an exception) leaves none behind
        K.GemvPlan.drop_open_tail()  # nor a NORM_TAIL marker
        K.embed(self.ids, t, self.w.embed, h, self.h, hp)
        ai = 0
        for li, lw in enumerate(self.w.layers):
            plan = self.layer_plans[li]
            self._input_norm(plan, lw, t)
            if lw.kind == FULL:
                self._attention(state, lw, plan, t, state.k[ai], state.v[ai], ptr(state.ctl), max(VERIFY_SPAN, t),
                                *state.side_rows(ai), pos0=state.position)
                ai += 1
            else:
                self._gdn(state, lw, plan, t, commit=not verify)
            self._mlp(lw, plan, t)
        norm = K.rmsnorm_rows if t > VERIFY_SPAN else K.rmsnorm  # same bits; the rows form for prefill chunks
        norm(self.h, hp, self.w.final_norm, eps, h, self.hidden, hp, t)
        self._logits_rows(self.hidden, rows)

    def enqueue_batch(self, n: int, offs: tuple[int, int, int, int]) -> None:
        """decode_batch's forward for n lanes whose ids, positions and state addresses are in the lane
        table: enqueue_main's steps for t = n, the state-dependent ones through the lane kernels.
        offs: the layer strides (bytes) of K / V, fp8 exponents, GDN state, conv window."""
        self._enqueue_sweep(n, offs, lambda lw, plan, ko, xo: self._attention_lanes(lw, plan, n, ko, xo),
                            lambda lw, plan, so, wo: self._gdn_lanes(lw, plan, n, so, wo))

    def _enqueue_sweep(self, n: int, offs: tuple[int, int, int, int], attention, gdn) -> None:
        """The forward of n lanes of the lane table (decode_batch's, verify_batch's): embed, per layer the
        input norm, attention(lw, plan, kv_off, x_off) or gdn(lw, plan, state_off, win_off) at this layer's
        byte offsets, the MLP; the final norm and every lane's logits row."""
        cfg = self.cfg
        h, hp = cfg.hidden_size, self.hp
        self._norm_folded = None  # a forward cut short (an exception) leaves none behind
        K.GemvPlan.drop_open_tail()  # nor a NORM_TAIL marker
        K.embed(self.lane_ids, n, self.w.embed, h, self.h, hp)
        ai = 0
        for li, lw in enumerate(self.w.layers):
            plan = self.layer_plans[li]
            self._input_norm(plan, lw, n)
            if lw.kind == FULL:
                attention(lw, plan, ai * offs[0], ai * offs[1])
                ai += 1
            else:
                gdn(lw, plan, plan["gi"] * offs[2], plan["gi"] * offs[3])
            self._mlp(lw, plan, n)
        K.rmsnorm(self.h, hp, self.w.final_norm, cfg.rms_norm_eps, h, self.hidden, hp, n)
        self._logits_rows(self.hidden, np.arange(n))

    def enqueue_commit(self, state: FastState) -> None:
        """Slide every GDN layer's conv window and replay its state by n = state.ctl[2] recorded lanes."""
        cfg = self.cfg
        ng = len(cfg.linear_layers)
        if ng == 0:
            return
        c, kw = cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim
        n_dev = ptr(state.ctl, 8)
        K.gdn_conv_commit(state.window, state.window[0].size, self.proj, self.ld_proj, self.proj[0].size, c, kw, ng,
                          n_dev=n_dev)
        K.gdn_step(state.gdn, state.gdn[0].size, self.qkvn, self.qkvn[0].size, self.gb, self.gb[0].size, None, 0,
                   cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                   cfg.linear_value_head_dim, VERIFY_SPAN, layers=ng, n_dev=n_dev, emit=False, write_state=True)

    def enqueue_groups(self, n: int, ngroups: int, offs: tuple[int, int, int, int]) -> None:
        """verify_batch's forward for n lanes in ngroups groups whose ids, positions and state addresses are
        in the lane table and whose rows / widths are in the group table: enqueue_main's verify steps for
        t = n, the state-dependent ones through the lane (KV store) and group kernels. offs: the layer
        strides (bytes) of K / V, fp8 exponents, GDN state, conv window."""
        self._enqueue_sweep(n, offs, lambda lw, plan, ko, xo: self._attention_groups(lw, plan, n, ngroups, ko, xo),
                            lambda lw, plan, so, wo: self._gdn_groups(lw, plan, n, ngroups, so, wo))

    def enqueue_commit_groups(self, ngroups: int, offs: tuple[int, int, int, int]) -> None:
        """enqueue_commit for every group of the last verify_batch at once: each group's state window slid
        and its S replayed by its kept count (group table GT_KEEP) over its rows of every GDN layer's
        records."""
        cfg = self.cfg
        ng = len(cfg.linear_layers)
        if ng == 0:
            return
        c, kw = cfg.gdn_conv_dim, cfg.linear_conv_kernel_dim
        K.gdn_conv_commit_groups(self.lane_table, self.group_table, offs[3], self.proj, self.ld_proj, self.proj[0].size,
                                 c, kw, ng, ngroups)
        K.gdn_step_groups(self.lane_table, self.group_table, C.GT_KEEP, 0, offs[2], self.qkvn, self.qkvn[0].size, self.gb,
                          self.gb[0].size, None, 0, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                          cfg.linear_key_head_dim, cfg.linear_value_head_dim, ngroups, layers=ng, emit=False,
                          write_state=True)

    def enqueue_mtp(self, state: FastState, t: int, rows="all", pos0: int | None = None) -> None:
        """MTP layer for t lanes: ids in self.mtp_ids, hidden in self.mtp_hidden_in, pos0 = state.ctl[1]
        (pos0: its host copy, given by eager prefill-sized calls)."""
        cfg = self.cfg
        m = self.w.mtp
        h, hp = cfg.hidden_size, self.hp
        eps = cfg.rms_norm_eps
        self._norm_folded = None  # a forward cut short (an exception) leaves none behind
        K.GemvPlan.drop_open_tail()  # nor a NORM_TAIL marker
        K.embed(self.mtp_ids, t, self.w.embed, h, self.x, hp)
        norm = K.rmsnorm_rows if t > VERIFY_SPAN else K.rmsnorm  # same bits; the rows form for prefill chunks
        norm(self.x, hp, m.pre_e, eps, h, self.cat, self.ld_cat, t)
        norm(self.mtp_hidden_in, hp, m.pre_h, eps, h, self.cat[:, h:], self.ld_cat, t)
        self.mtp_fc_plan.run(self.cat, self.ld_cat, t)
        lw = m.layer
        plan = self.mtp_layer_plan
        self._input_norm(plan, lw, t)
        self._attention(state, lw, plan, t, state.mtp_k, state.mtp_v, ptr(state.ctl, 4), max(VERIFY_SPAN, t),
                        *state.side_rows(None), pos0=pos0)
        self._mlp(lw, plan, t)
        norm(self.h, hp, m.norm, eps, h, self.mtp_out, hp, t)
        self._logits_rows(self.mtp_out, select_rows(t, rows))

    def enqueue_mtp_chain(self, state: FastState, t: int, depth: int) -> None:
        """mtp_draft_chain's device steps: step 0 over the t rows in self.mtp_ids / mtp_hidden_in at pos0 =
        state.ctl[1] (logits of its last row only), then depth - 1 one-row steps, each fed the previous argmax
        and post-norm row by mtp_chain_step; drafts and margins into _chain_draft / _chain_margin."""
        h = self.cfg.hidden_size
        self.enqueue_mtp(state, t, np.array([t - 1]))
        for k in range(depth):
            feed = k + 1 < depth
            src = self.mtp_out[t - 1 if k == 0 else 0]
            self.rt.launch("chain", "mtp_chain_step", 1, 256,
                           (self.tok, self.margin, self._chain_draft, self._chain_margin, i32(k), i32(int(feed)),
                            self.mtp_ids, self.mtp_hidden_in, src, i32(h), state.ctl, i32(t if k == 0 else 1)))
            if feed:
                self.enqueue_mtp(state, 1, np.array([0]))

    def enqueue_mtp_batch(self, n: int, nchains: int, depth: int) -> None:
        """mtp_draft_batch's device steps for nchains chains whose n step-0 rows (hidden rows in mtp_hidden_in,
        ids, positions and MTP KV addresses in the step-0 tables) are groups of consecutive lanes: step 0 over the
        n rows, then depth - 1 steps of one lane per chain (the chain steps' tables). After each step the chains'
        last rows are gathered to mtp_hidden_in rows 0 .. nchains - 1 (the lm_head's rows and the next step's
        hidden inputs), the lm_head and argmax run over them, and mtp_chain_step_lanes records step k's draft and
        margin per chain and feeds its id and position to the next step."""
        h = self.cfg.hidden_size
        for k in range(depth):
            first = k == 0
            lanes, groups = (self.mtp_lanes0, self.mtp_groups0) if first else (self.mtp_lanes1, self.mtp_groups1)
            self._enqueue_mtp_groups(n if first else nchains, nchains, lanes, groups,
                                     self.mtp_ids0 if first else self.mtp_ids1)
            self.rt.launch("chain", "mtp_gather_last", nchains, 256,
                           (self.mtp_out, i32(self.hp), groups, self.mtp_hidden_in, i32(self.hp), i32(h)))
            self.lm_plan.run(self.mtp_hidden_in, self.hp, nchains)
            K.top2(self.logits, self.vocab, self.vocab, nchains, self.top2_part, self.tok, self.top1, self.margin)
            self.rt.launch("chain", "mtp_chain_step_lanes", 1, 32,
                           (self.tok, self.margin, self.mtp_batch_out, i32(depth), i32(k), i32(int(k + 1 < depth)),
                            self.mtp_lanes1, i32(0 if first else 1), i32(nchains)))

    def _enqueue_mtp_groups(self, n: int, ngroups: int, lanes, groups, ids) -> None:
        """enqueue_mtp's MTP layer (t = n <= VERIFY_SPAN) for n lanes in ngroups groups of the tables `lanes` /
        `groups` (each lane's MTP KV addresses and position; group g one chain's rows), ids from `ids`, hidden rows
        in mtp_hidden_in; the post-norm rows into mtp_out. The KV stores per lane, attention per group
        (_attention_groups), everything else over all n lanes."""
        cfg = self.cfg
        m = self.w.mtp
        h, hp = cfg.hidden_size, self.hp
        eps = cfg.rms_norm_eps
        self._norm_folded = None  # a forward cut short (an exception) leaves none behind
        K.GemvPlan.drop_open_tail()  # nor a NORM_TAIL marker
        K.embed(ids, n, self.w.embed, h, self.x, hp)
        K.rmsnorm(self.x, hp, m.pre_e, eps, h, self.cat, self.ld_cat, n)
        K.rmsnorm(self.mtp_hidden_in, hp, m.pre_h, eps, h, self.cat[:, h:], self.ld_cat, n)
        self.mtp_fc_plan.run(self.cat, self.ld_cat, n)
        lw = m.layer
        plan = self.mtp_layer_plan
        self._input_norm(plan, lw, n)
        self._attention_groups(lw, plan, n, ngroups, 0, 0, lanes=lanes, groups=groups)
        self._mlp(lw, plan, n)
        K.rmsnorm(self.h, hp, m.norm, eps, h, self.mtp_out, hp, n)

    # ------------------------------------------------------------------ blocks
    def _gdn(self, state: FastState, lw: LayerW, plan: dict, t: int, commit: bool) -> None:
        cfg = self.cfg
        g = lw.gdn
        gi = plan["gi"]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, kw, c = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.gdn_conv_dim
        if t > VERIFY_SPAN:  # prefill chunk: one shared scratch (never replayed by commit)
            raw, qkvn, gb = self.proj_big, self.qkvn_big, self.gb_big
        else:  # decode / verify: this layer's records
            raw, qkvn, gb = self.proj[gi], self.qkvn[gi], self.gb[gi]
        fused_step = self.gdn_fused and t <= VERIFY_SPAN and K.gdn_fused_supported(hk, hv, dk, dv, kw, t,
                                                                                  self.gdn_fused_warps)
        gates = None if fused_step or t > VERIFY_SPAN else self._gates_in_conv(g)
        if t > VERIFY_SPAN:
            plan["in_big"].run(self.x, self.hp, t, x_bf16=self._bf16_rows(plan["in_big"], t, self.xb))
        else:  # _input_norm wrote an a8 plan's int8 activations
            plan["in"].run(self.x, self.hp, t, prequantized=plan["in"].fuses_quant(t), skip_bf16=gates is not None,
                           norm=self._take_norm(plan["in"]))
        if fused_step:
            # one launch, bitwise the chain below (same records, o, normed rows, state and window), which also
            # writes the out plan's int8 activations where gated_rmsnorm would (no quant_act8 launch then)
            fuse = bool(C.A8_FOLD & 1) and K.gated_rmsnorm_fuses(plan["out"], t, hv, dv)
            K.gdn_decode_fused(raw, self.ld_proj, state.window[gi], g.conv_w, self.ab, self.ab.shape[1], g.neg_a,
                               g.dt_bias, hk, hv, dk, dv, kw, qkvn, gb, state.gdn[gi], self.o_gdn, hv * dv, g.norm_w,
                               cfg.rms_norm_eps, self.xo, self.ld_xo, self.gdn_tickets, t, commit,
                               warps=self.gdn_fused_warps, a8=plan["out"] if fuse else None)
            plan["out"].run(self.xo, self.ld_xo, t, prequantized=fuse)
            return
        fold = bool(C.CONV_COMMIT_FOLD) and commit and t == 1  # the decode step: the conv slides the window itself
        if t > VERIFY_SPAN:  # same bits; the rows form for prefill chunks
            K.gdn_conv_rows(raw, self.ld_proj, state.window[gi], g.conv_w, self.ab, self.ab.shape[1], g.neg_a,
                            g.dt_bias, hk, hv, dk, dv, kw, qkvn, gb, t)
        else:
            K.gdn_conv(raw, self.ld_proj, state.window[gi], g.conv_w, self.ab, self.ab.shape[1], g.neg_a, g.dt_bias,
                       hk, hv, dk, dv, kw, qkvn, gb, t, gates=gates, commit=fold)
        if commit and not fold:
            K.gdn_conv_commit(state.window[gi], 0, raw, self.ld_proj, 0, c, kw, 1, n=t)
        gated = None
        if t > VERIFY_SPAN:  # prefill chunk: the output norm's rows form, writing what the out plan reads
            xob = self._bf16_rows(plan["out"], t, self.xob)
            gated = K.GatedNormArgs(raw[:, c:], self.ld_proj, g.norm_w, cfg.rms_norm_eps,
                                    self.xo if xob is None or plan["out"].gemm_inputs(t)[1] else None, self.ld_xo, xob,
                                    0 if xob is None else xob.shape[1])
        fused = False
        if commit and t > VERIFY_SPAN and K.gdn_prefill_supported(dk, dv):
            # the chunked2 output pass may apply the norm itself (K.GDN2_OUT_GATED: the same bits)
            fused = K.gdn_prefill_run(state.gdn[gi], qkvn, gb, self.o_gdn, hv * dv, hk, hv, dk, dv, t,
                                      pos0=state.position, gated=gated,
                                      scratch=self._gdn2_scratch() if K.GDN_PREFILL == "chunked2" else None)
        else:
            K.gdn_step(state.gdn[gi], 0, qkvn, 0, gb, 0, self.o_gdn, hv * dv, hk, hv, dk, dv, t,
                       emit=True, write_state=commit)
        if gated is not None:
            if not fused:
                K.gated_rmsnorm_rows(self.o_gdn, hv * dv, gated.z, gated.ldz, gated.w, gated.eps, t, hv, dv, gated.y,
                                     gated.ldy, gated.yb, gated.ldyb)
            plan["out"].run(self.xo, self.ld_xo, t, x_bf16=gated.yb)
            return
        self._gdn_out(g, plan["out"], raw, t)

    def _gdn_out(self, g, out: "K.GemvPlan", raw, t: int) -> None:
        """A decode / verify GDN layer's output norm (gated RMSNorm of self.o_gdn by raw's z rows) and its out
        projection: gated_rmsnorm (writing the plan's int8 activations where it fuses them) then the GEMV, or, where
        the plan folds the norm (constants GATED_FOLD, GemvPlan.folds_gated), the GEMV alone computing it (the same
        bits)."""
        cfg = self.cfg
        hv, dv, c = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.gdn_conv_dim
        gin = K.GatedIn(self.o_gdn, hv * dv, raw[:, c:], self.ld_proj, g.norm_w, cfg.rms_norm_eps, dv)
        if out.kpad == hv * dv and out.folds_gated(t, gin):
            out.run(self.xo, self.ld_xo, t, gated=gin)
            return
        fuse = K.gated_rmsnorm_fuses(out, t, hv, dv)
        K.gated_rmsnorm(self.o_gdn, hv * dv, raw[:, c:], self.ld_proj, g.norm_w, cfg.rms_norm_eps, t, hv, dv, self.xo,
                        self.ld_xo, a8=out if fuse else None)
        out.run(self.xo, self.ld_xo, t, prequantized=fuse)

    def _gates_in_conv(self, g) -> "K.GatesInConv | None":
        """The conv's own decay / beta gates (GDN_GATES_IN_CONV) for a decode / verify GDN chain: the layer's bf16 gates
        matrix and the normed rows the in plan reads, or None (the in plan's bf16 GEMV writes ab)."""
        if not self.gates_in_conv or g.ab.shape.fmt != L.FMT_BF16 or g.qkvz.shape.fmt == L.FMT_BF16:
            return None  # the in plan skips its bf16 launch, which must be the gates' alone (not the bf16 tier's)
        return K.GatesInConv(g.ab, self.x, self.hp)

    def _gdn_lanes(self, lw: LayerW, plan: dict, n: int, state_off: int, win_off: int) -> None:
        """_gdn for decode_batch lanes (each a committing one-token step of its own state, offsets:
        this layer's bytes into each state's S and window): the fused kernel where a one-token
        decode takes it, else the chain, as _gdn picks for t = 1."""
        cfg = self.cfg
        g = lw.gdn
        gi = plan["gi"]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, kw, c = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.gdn_conv_dim
        raw, qkvn, gb = self.proj[gi], self.qkvn[gi], self.gb[gi]
        fused_step = self.gdn_fused and K.gdn_fused_supported(hk, hv, dk, dv, kw, 1, self.gdn_fused_warps)
        gates = None if fused_step else self._gates_in_conv(g)
        plan["in"].run(self.x, self.hp, n, prequantized=plan["in"].fuses_quant(n), skip_bf16=gates is not None,
                       norm=self._take_norm(plan["in"]))
        if fused_step:
            fuse = bool(C.A8_FOLD & 1) and K.gated_rmsnorm_fuses(plan["out"], n, hv, dv)
            K.gdn_decode_fused_lanes(raw, self.ld_proj, self.lane_table, win_off, state_off, g.conv_w, self.ab,
                                     self.ab.shape[1], g.neg_a, g.dt_bias, hk, hv, dk, dv, kw, qkvn, gb, self.o_gdn,
                                     hv * dv, g.norm_w, cfg.rms_norm_eps, self.xo, self.ld_xo, self.gdn_tickets_lanes, n,
                                     warps=self.gdn_fused_warps, a8=plan["out"] if fuse else None)
            plan["out"].run(self.xo, self.ld_xo, n, prequantized=fuse)
            return
        fold = bool(C.CONV_COMMIT_FOLD)  # each lane's window slides in the conv (one committing lane a state)
        K.gdn_conv_lanes(raw, self.ld_proj, self.lane_table, win_off, g.conv_w, self.ab, self.ab.shape[1], g.neg_a,
                         g.dt_bias, hk, hv, dk, dv, kw, qkvn, gb, n, gates=gates, commit=fold)
        if not fold:
            K.gdn_conv_commit_lanes(self.lane_table, win_off, raw, self.ld_proj, c, kw, n)
        K.gdn_step_lanes(self.lane_table, state_off, qkvn, gb, self.o_gdn, hv * dv, hk, hv, dk, dv, n)
        self._gdn_out(g, plan["out"], raw, n)

    def _gdn_groups(self, lw: LayerW, plan: dict, n: int, ngroups: int, state_off: int, win_off: int) -> None:
        """_gdn for verify_batch lanes (each group a verify of its own state; offsets: this layer's bytes into
        each state's S and window): the chain as a verify runs it -- conv (no window commit), the recurrence
        emitting o without writing S -- per group; the output norm and GEMV over all lanes. The chain even
        where gdn_fused is on: the fused kernel is bitwise the chain, and has no group entry."""
        cfg = self.cfg
        g = lw.gdn
        gi = plan["gi"]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv, kw, c = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim, cfg.gdn_conv_dim
        raw, qkvn, gb = self.proj[gi], self.qkvn[gi], self.gb[gi]  # rows r0.. of each group: its records
        gates = self._gates_in_conv(g)
        plan["in"].run(self.x, self.hp, n, prequantized=plan["in"].fuses_quant(n), skip_bf16=gates is not None,
                       norm=self._take_norm(plan["in"]))
        K.gdn_conv_groups(raw, self.ld_proj, self.lane_table, self.group_table, win_off, g.conv_w, self.ab,
                          self.ab.shape[1], g.neg_a, g.dt_bias, hk, hv, dk, dv, kw, qkvn, gb, n, gates=gates)
        K.gdn_step_groups(self.lane_table, self.group_table, C.GT_COUNT, state_off, 0, qkvn, 0, gb, 0, self.o_gdn,
                          hv * dv, hk, hv, dk, dv, ngroups, emit=True, write_state=False)
        self._gdn_out(g, plan["out"], raw, n)

    def _attention_groups(self, lw: LayerW, plan: dict, n: int, ngroups: int, kv_off: int, x_off: int,
                          lanes=None, groups=None) -> None:
        """_attention for verify_batch lanes: the lane store (each lane at its own position in its state),
        then the kernel a verify round picks (span VERIFY_SPAN: mma where the model runs it, else split)
        per group, lane j of a group as lane j of its sequence's solo round (pos0, split size). lanes /
        groups: the tables (default the model's; mtp_draft_batch passes its own)."""
        lanes = self.lane_table if lanes is None else lanes
        groups = self.group_table if groups is None else groups
        cfg = self.cfg
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        fp8 = self._store_lanes(lw, plan, n, lanes, kv_off, x_off)
        a8 = self._attn_a8(plan, n)
        if self.attn_mma:  # as _attention's verify branch (span VERIFY_SPAN); never for fp32 rows
            K.attention_mma_groups(self.qbuf, nq * hd, lanes, groups, kv_off, x_off, fp8,
                                   self.max_pos, nq, nkv, hd, VERIFY_SPAN, self.part, self.qg, self.ld_qg, self.xa,
                                   self.ld_xa, n, ngroups, n - ngroups + 1, a8=a8)
        else:
            K.attention_groups(self.qbuf, nq * hd, lanes, groups, kv_off, x_off, self.kv_name,
                               self.max_pos, nq, nkv, hd, VERIFY_SPAN, self.part, self.qg, self.ld_qg, self.xa,
                               self.ld_xa, n, a8=a8)
        plan["out"].run(self.xa, self.ld_xa, n, prequantized=a8 is not None)

    def _store_lanes(self, lw: LayerW, plan: dict, n: int, lanes, kv_off: int, x_off: int) -> bool:
        """The q / k / v / gate projection of n lanes, then q / k norm, RoPE and the KV store, each lane at its
        own (state, position) of the lane table `lanes` (decode_batch's and verify_batch's attention alike).
        Returns whether the KV is fp8."""
        cfg = self.cfg
        a = lw.attn
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        plan["in"].run(self.x, self.hp, n, prequantized=plan["in"].fuses_quant(n), norm=self._take_norm(plan["in"]))
        if self.kv_name == "fp8":
            K.qk_norm_rope_store_fp8_lanes(self.qg, self.ld_qg, self.kvp, self.kvp.shape[1], a.q_norm, a.k_norm,
                                           cfg.rms_norm_eps, nq, nkv, hd, cfg.rotary_dim, self.inv_freq,
                                           lanes, kv_off, x_off, self.qbuf, nq * hd, self.max_pos, n)
            return True
        K.qk_norm_rope_store_lanes(self.qg, self.ld_qg, self.kvp, self.kvp.shape[1], a.q_norm, a.k_norm,
                                   cfg.rms_norm_eps, nq, nkv, hd, cfg.rotary_dim, self.inv_freq, lanes,
                                   kv_off, self.qbuf, nq * hd, self.kv_bf16, self.max_pos, n)
        return False

    def _attention_lanes(self, lw: LayerW, plan: dict, n: int, kv_off: int, x_off: int) -> None:
        """_attention for decode_batch lanes (f32 / bf16 / fp8 KV; offsets: this layer's bytes into
        each state's K / V and fp8 exponents): the kernel a one-token decode picks (span VERIFY_SPAN:
        mma where the model runs it, else split), each lane at its own position."""
        cfg = self.cfg
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        fp8 = self._store_lanes(lw, plan, n, self.lane_table, kv_off, x_off)
        a8 = self._attn_a8(plan, n)
        if self.attn_mma:  # as _attention's decode branch (span VERIFY_SPAN); never for fp32 rows
            K.attention_mma_lanes(self.qbuf, nq * hd, self.lane_table, kv_off, x_off, fp8, self.max_pos, nq, nkv, hd,
                                  VERIFY_SPAN, self.part, self.qg, self.ld_qg, self.xa, self.ld_xa, n, a8=a8)
        else:
            K.attention_lanes(self.qbuf, nq * hd, self.lane_table, kv_off, x_off, self.kv_name, self.max_pos, nq, nkv,
                              hd, VERIFY_SPAN, self.part, self.qg, self.ld_qg, self.xa, self.ld_xa, n, a8=a8)
        plan["out"].run(self.xa, self.ld_xa, n, prequantized=a8 is not None)

    def _attn_a8(self, plan: dict, t: int) -> "K.GemvPlan | None":
        """The out plan when the attention combine of t lanes writes its a8 activations (K.attention_a8_fuses),
        else None; the caller's combine then gets it as a8= and the plan runs prequantized."""
        cfg = self.cfg
        fuse = bool(C.A8_FOLD & 2) and K.attention_a8_fuses(plan["out"], t, cfg.num_attention_heads, cfg.head_dim)
        return plan["out"] if fuse else None

    def _pf2_scratch(self):
        """The v2 partials buffer (None when no row of this window can pass the first key block)."""
        if self._pf2_part is None:
            cfg = self.cfg
            nq, hd = cfg.num_attention_heads, cfg.head_dim
            nblk = K.attention_prefill2_blocks(self.max_pos)
            if nblk > 1:
                want = K.attention_prefill2_part_floats(self.chunk, nq, hd, nblk)
                floats = max(min(want, K.PF2_PART_BYTES // 4), K.attention_prefill2_part_floats(1, nq, hd, nblk))
                self._pf2_part = self.rt.cp.zeros(floats, dtype=self.rt.cp.float32)
        return self._pf2_part

    def _use_pf2(self, t: int, pos0, fp8: bool) -> bool:
        """Prefill lanes take attention v2 when selected, the KV is bf16 / fp8 and the card has a variant."""
        return (self.prefill_attention and K.ATTN_PREFILL == "v2" and t > VERIFY_SPAN and pos0 is not None
                and (fp8 or self.kv_bf16) and K.attention_prefill2_variant(self.cfg.head_dim, fp8) is not None)

    def _attention(self, state, lw: LayerW, plan: dict, t: int, kc, vc, pos0_dev, span: int, kx=None, vx=None,
                   pos0: int | None = None) -> None:
        """pos0: host copy of *pos0_dev (prefill chunks; sizes the v2 kernel's key blocks)."""
        cfg = self.cfg
        a = lw.attn
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if self.kv_bits is not None:  # k5v3 / k3v3: its own store and kernels
            self._attention_rotated(lw, plan, t, kc, vc, pos0_dev, span, kx, vx)
            return
        plan["in"].run(self.x, self.hp, t, prequantized=plan["in"].fuses_quant(t),
                       x_bf16=self._bf16_rows(plan["in"], t, self.xb), norm=self._take_norm(plan["in"]))
        if kx is not None:  # fp8 KV (codes + row exponents): quantize on store, dequantize in attention
            K.qk_norm_rope_store_fp8(self.qg, self.ld_qg, self.kvp, self.kvp.shape[1], a.q_norm, a.k_norm,
                                     cfg.rms_norm_eps, nq, nkv, hd, cfg.rotary_dim, self.inv_freq, pos0_dev, self.qbuf,
                                     nq * hd, kc, vc, kx, vx, self.max_pos, t)
            a8 = None  # set where a combine kernel writes the out plan's a8 activations
            if self._use_pf2(t, pos0, True):
                K.attention_prefill2(self.qbuf, nq * hd, kc, vc, True, self.max_pos, nq, nkv, hd, pos0_dev, pos0,
                                     self.qg, self.ld_qg, self.xa, self.ld_xa, t, self._pf2_scratch(), kx, vx)
            elif self.prefill_attention and t > VERIFY_SPAN and K.attention_prefill_fits(hd, True):
                K.attention_prefill_fp8(self.qbuf, nq * hd, kc, vc, kx, vx, self.max_pos, nq, nkv, hd, pos0_dev,
                                        self.qg, self.ld_qg, self.xa, self.ld_xa, t)
            elif self.attn_mma and span == VERIFY_SPAN:
                a8 = self._attn_a8(plan, t)
                K.attention_mma(self.qbuf, nq * hd, kc, vc, kx, vx, True, self.max_pos, nq, nkv, hd, pos0_dev, span,
                                self.part, self.qg, self.ld_qg, self.xa, self.ld_xa, t, a8=a8)
            else:
                a8 = self._attn_a8(plan, t)
                K.attention_fp8(self.qbuf, nq * hd, kc, vc, kx, vx, self.max_pos, nq, nkv, hd, pos0_dev, span,
                                self.part, self.qg, self.ld_qg, self.xa, self.ld_xa, t, a8=a8)
            plan["out"].run(self.xa, self.ld_xa, t, prequantized=a8 is not None)
            return
        K.qk_norm_rope_store(self.qg, self.ld_qg, self.kvp, self.kvp.shape[1], a.q_norm, a.k_norm, cfg.rms_norm_eps, nq,
                             nkv, hd, cfg.rotary_dim, self.inv_freq, pos0_dev, self.qbuf, nq * hd, kc, vc, self.kv_bf16,
                             self.max_pos, t)
        a8 = None  # set where a combine kernel writes the out plan's a8 activations
        if self._use_pf2(t, pos0, False):
            K.attention_prefill2(self.qbuf, nq * hd, kc, vc, False, self.max_pos, nq, nkv, hd, pos0_dev, pos0, self.qg,
                                 self.ld_qg, self.xa, self.ld_xa, t, self._pf2_scratch())
        elif self.prefill_attention and t > VERIFY_SPAN and K.attention_prefill_fits(hd, self.kv_bf16):
            K.attention_prefill(self.qbuf, nq * hd, kc, vc, self.kv_bf16, self.max_pos, nq, nkv, hd, pos0_dev, self.qg,
                                self.ld_qg, self.xa, self.ld_xa, t)
        elif self.attn_mma and span == VERIFY_SPAN:  # bf16 KV (attn_mma is False for fp32 rows)
            a8 = self._attn_a8(plan, t)
            K.attention_mma(self.qbuf, nq * hd, kc, vc, None, None, False, self.max_pos, nq, nkv, hd, pos0_dev, span,
                            self.part, self.qg, self.ld_qg, self.xa, self.ld_xa, t, a8=a8)
        else:
            a8 = self._attn_a8(plan, t)
            K.attention(self.qbuf, nq * hd, kc, vc, self.kv_bf16, self.max_pos, nq, nkv, hd, pos0_dev, span, self.part,
                        self.qg, self.ld_qg, self.xa, self.ld_xa, t, a8=a8)
        plan["out"].run(self.xa, self.ld_xa, t, prequantized=a8 is not None)

    def _attention_rotated(self, lw: LayerW, plan: dict, t: int, kc, vc, pos0_dev, span: int, kn, vn) -> None:
        """Attention over rotated Lloyd-Max KV (kvformat "k5v3" / "k3v3"): the store quantizes K (after
        q/k norm and RoPE) and V and writes the query rotated, R q; decode / verify lanes score R q
        against the codes (split-K, one inverse rotation per head before the gate), prefill chunks
        run the tiled kernel over the codes dequantized in the rotated basis, then unrotate_gate.
        kc / vc: codes [nkv][max_pos][hd*bits/8]; kn / vn: fp16 norms [nkv][max_pos]."""
        cfg = self.cfg
        a = lw.attn
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        kbits, vbits = self.kv_bits
        kt, vt = self.kv_tables[kbits], self.kv_tables[vbits]
        plan["in"].run(self.x, self.hp, t, prequantized=plan["in"].fuses_quant(t),
                       x_bf16=self._bf16_rows(plan["in"], t, self.xb), norm=self._take_norm(plan["in"]))
        K.qk_norm_rope_store_rot(self.qg, self.ld_qg, self.kvp, self.kvp.shape[1], a.q_norm, a.k_norm,
                                 cfg.rms_norm_eps, nq, nkv, hd, cfg.rotary_dim, self.inv_freq, pos0_dev, self.qbuf,
                                 nq * hd, kc, vc, kn, vn, kbits, vbits, kt, vt, self.max_pos, t)
        if self.prefill_attention and t > VERIFY_SPAN and K.rotated_prefill_fits(hd):
            K.attention_prefill_rotated(self.qbuf, nq * hd, kc, vc, kn, vn, kbits, vbits, kt[0], vt[0], self.max_pos,
                                        nq, nkv, hd, pos0_dev, self.qg, self.ld_qg, self.xa, self.ld_xa, t)
        else:
            K.attention_rotated(self.qbuf, nq * hd, kc, vc, kn, vn, kbits, vbits, kt[0], vt[0], self.max_pos, nq, nkv,
                                hd, pos0_dev, span, self.part, self.qg, self.ld_qg, self.xa, self.ld_xa, t)
        plan["out"].run(self.xa, self.ld_xa, t)

    def _bf16_rows(self, plan: "K.GemvPlan", t: int, buf):
        """buf when a prefill chunk of t lanes feeds `plan` bf16 rows of its input (GemvPlan.gemm_inputs):
        the producer of that input writes them there, and the plan's run() reads them; else None. One
        rule for both sides, so they always agree."""
        return buf if t > VERIFY_SPAN and buf is not None and plan.gemm_inputs(t)[0] else None

    def _norm(self, w, plan: "K.GemvPlan", t: int, skip_bf16: bool = False) -> None:
        """self.x = rmsnorm(self.h) * (1 + w), the input of `plan`: at GEMV widths with the plan's a8
        activations when it fuses them (the plan then runs prequantized); for a prefill chunk through
        the rows kernel (the same bits), as the fp32 and / or bf16 rows the plan reads. Where the plan folds
        the norm (constants NORM_FOLD, GemvPlan.folds_norm; skip_bf16: the run will leave its bf16 launch
        out) no launch here: the norm's arguments wait for that plan's run (_take_norm), whose CTAs compute
        the same activations and self.x bitwise."""
        cfg = self.cfg
        assert self._norm_folded is None, "a folded norm was not taken by its plan's run"
        done = plan.take_norm_done()
        if done is not None:  # NORM_TAIL: the residual GEMV before it computed this norm in its last CTA (the fp32
            # rows too, which a GDN layer's in plan leaves unread where skip_bf16 says its conv computes the gates)
            assert done[0] is w and done[1] == t, "the tail computed another norm"
            return
        if t <= VERIFY_SPAN:
            nin = K.NormIn(self.h, self.hp, w, cfg.rms_norm_eps, cfg.hidden_size, self.x, self.hp)
            if plan.folds_norm(t, skip_bf16, nin):
                self._norm_folded = (plan, nin)
                return
        if t > VERIFY_SPAN:
            xb = self._bf16_rows(plan, t, self.xb)
            K.rmsnorm_rows(self.h, self.hp, w, cfg.rms_norm_eps, cfg.hidden_size,
                           self.x if xb is None or plan.gemm_inputs(t)[1] else None, self.hp, t, xb,
                           0 if xb is None else xb.shape[1])
            return
        K.rmsnorm(self.h, self.hp, w, cfg.rms_norm_eps, cfg.hidden_size, self.x, self.hp, t,
                  a8=plan if plan.fuses_quant(t) else None)

    def _input_norm(self, plan: dict, lw: LayerW, t: int) -> None:
        """The layer's input norm into self.x (_norm), for the plan that reads it: a GDN layer's prefill
        chunks run "in_big"; its decode / verify in plan leaves the bf16 gates out when the conv computes them."""
        skip = lw.kind != FULL and t <= VERIFY_SPAN and self._gates_in_conv(lw.gdn) is not None
        self._norm(lw.input_ln, plan["in_big"] if t > VERIFY_SPAN and "in_big" in plan else plan["in"], t, skip)

    def _take_norm(self, plan: "K.GemvPlan") -> "K.NormIn | None":
        """The norm _norm left for `plan` to fold (its run(norm=...)), or None: a norm launch wrote x."""
        f = self._norm_folded
        if f is None or f[0] is not plan:
            return None
        self._norm_folded = None
        return f[1]

    def _mlp(self, lw: LayerW, plan: dict, t: int) -> None:
        up, down = plan["up"], plan["down"]
        self._norm(lw.post_ln, up, t)
        if t > VERIFY_SPAN:
            # the SwiGLU rows as bf16 only when down reads nothing else (same bytes as converting them)
            actb = self._bf16_rows(down, t, self.actb) if up.swiglu_bf16(t) and not down.gemm_inputs(t)[1] else None
            up.run(self.x, self.hp, t, x_bf16=self._bf16_rows(up, t, self.xb), y_bf16=actb)
            down.run(self.act, self.ld_act, t, x_bf16=actb)
            return
        if self._norm_folded is None and up.walks_into(down, t):  # MLP_WALK: one grid, no boundary between them
            up.run_walk(down, self.x, self.hp, t, prequantized=up.fuses_quant(t))
            return
        up.run(self.x, self.hp, t, prequantized=up.fuses_quant(t), norm=self._take_norm(up))
        if up.quantizes_for(down, t):
            down.run(self.act, self.ld_act, t, prequantized=True)
            return
        # QUANT_FOLD: down's CTAs quantize the SwiGLU rows themselves (the pad columns too, as quant_act8 reads them)
        rows = K.NormIn(self.act, self.ld_act, None, 0.0, down.kpad)
        down.run(self.act, self.ld_act, t, norm=rows if down.folds_quant(t, rows) else None)

    def _logits_rows(self, src, rows: np.ndarray) -> None:
        """lm_head + argmax for the given lanes (contiguous runs become one GEMV each).

        The i-th distinct requested lane (ascending) lands in logits / tok row i: lane r0 of a
        run placed at row c reads src row r0 = (r0 - c) + c, i.e. src shifted by r0 - c and lane0 = c.
        """
        c = 0
        for r0, n in _runs(rows):
            if c + n > self.logit_rows:
                raise ValueError(f"more than {self.logit_rows} logits rows requested from one forward chunk")
            self.lm_plan.run(src[r0 - c :], self.hp, n, lane0=c)
            K.top2(self.logits[c:], self.vocab, self.vocab, n, self.top2_part, self.tok[c:], self.top1[c:],
                   self.margin[c:])
            c += n

    def _fetch_ids(self, rows: np.ndarray) -> np.ndarray:
        """Device argmax ids of the rows computed by the last _logits_rows (compact order)."""
        if rows.size == 0:
            return np.zeros(0, dtype=np.int64)
        u = np.unique(rows)
        ids = self.tok[: u.size].get(stream=self.stream).astype(np.int64)
        return ids[np.searchsorted(u, rows)]

    def _fetch_masked_ids(self, compact: np.ndarray, words: np.ndarray) -> np.ndarray:
        """Masked device argmax of compact logits rows `compact` (words: [n, W] uint32 bitmasks)."""
        cp = self.rt.cp
        n = int(compact.shape[0])
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        words = np.ascontiguousarray(words, dtype=np.uint32).reshape(n, -1)
        if words.shape[1] * 32 < self.vocab:
            raise ValueError(f"a mask of {words.shape[1] * 32} bits for a vocabulary of {self.vocab}")
        with self.stream:
            idx = cp.asarray(compact.astype(np.int32))
            mask = cp.asarray(words)
            part = cp.empty((n, K.TOP2_BLOCKS, 2), dtype=cp.uint64)
            ids = cp.empty(n, dtype=cp.int32)
            top1 = cp.empty(n, dtype=cp.float32)
            margin = cp.empty(n, dtype=cp.float32)
            K.top2_masked(self.logits, self.vocab, self.vocab, n, idx, mask, words.shape[1], part, ids, top1, margin)
            return ids.get(stream=self.stream).astype(np.int64)

    def _fetch_logits(self, rows: np.ndarray) -> np.ndarray:
        if rows.size == 0:
            return np.zeros((0, self.vocab), dtype=np.float32)
        u = np.unique(rows)
        block = self.logits[: u.size].get(stream=self.stream)
        return block[np.searchsorted(u, rows)]

    def argmax_rows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, top1-top2 margins) of the first n logits rows computed by the last step."""
        self.stream.synchronize()
        return self.tok[:n].get(), self.margin[:n].get()

    # ------------------------------------------------------------------ graphs
    def enable_graphs(self, state_budget: int | None = None, model_budget: int | None = None) -> None:
        """Capture the steps as CUDA graphs; the budgets (graph_budgets: what the memory plan reserved)
        bound the graphs' device bytes per state and model-level (GraphCache). None: unbounded."""
        from q27py.gpu.graphs import GraphCache

        self.graphs = GraphCache(self, state_budget=state_budget, model_budget=model_budget)

    # ------------------------------------------------------------------ state transfer (prefix reuse)
    # The reference model's four methods, on device arrays. Saved states are host copies:
    # checkpoints live in host memory so they never compete with the KV cache for VRAM.
    @property
    def state_format(self) -> str:
        return f"cuda-{self.kv_name}kv"  # cuda-f32kv | cuda-bf16kv | cuda-fp8kv | cuda-k5v3kv | cuda-k3v3kv

    def save_recurrent(self, state: FastState) -> dict:
        """GDN state + conv windows at this point. Device copies while the snapshot budget lasts (a
        stream-ordered copy of ~150 MB on the 27B: ~0.1 ms), host copies beyond it: stream-ordered
        copies into pinned buffers (HostSnapshot), so the host goes on queueing the prefill's next
        piece. The budget is shared by every engine and sequence of the process, so a long-running
        server fills it with idle sequences' snapshots and every later prompt's checkpoints land here;
        the pageable `.get()` this replaces synchronized the stream and held the host ~80 ms per
        snapshot (the agent replay, docs/PERF.md), once per 4,096 prompt tokens."""
        nbytes = int(state.gdn.nbytes + state.window.nbytes)
        if DeviceSnapshot.live_bytes + nbytes <= self.device_snapshot_bytes:
            with self.stream:
                return DeviceSnapshot({"gdn": state.gdn.copy(), "window": state.window.copy()}, nbytes)
        if HostSnapshot.live_bytes + nbytes > self.pinned_snapshot_bytes:
            # past the pinned budget too: pageable copies (page-locked memory is taken from the OS for good)
            self.stream.synchronize()
            return {"gdn": state.gdn.get(), "window": state.window.get()}
        cp = self.rt.cp
        arrays = {}
        for name, arr in (("gdn", state.gdn), ("window", state.window)):
            mem = cp.cuda.alloc_pinned_memory(max(1, arr.nbytes))  # CuPy's pinned pool: reused once freed
            out = np.ndarray(arr.shape, dtype=arr.dtype, buffer=mem)  # as cupyx.empty_pinned makes it (writable)
            arr.get(stream=self.stream, out=out, blocking=False)
            arrays[name] = out
        return HostSnapshot(arrays, self.stream.record(), nbytes)

    def rewind(self, state: FastState, position: int, recurrent: dict) -> None:
        """Back to `position`: KV rows past it are dead (overwritten by the next forward)."""
        cp = self.rt.cp
        state.position = position
        if state.mtp_kv is not None:
            state.mtp_kv.truncate(min(state.mtp_kv.length, max(position - 1, 0)))
            state.mtp_position = state.mtp_kv.length
        with self.stream:
            for name, dst in (("gdn", state.gdn), ("window", state.window)):
                src = recurrent[name]
                if isinstance(src, cp.ndarray):
                    dst[...] = src
                else:
                    dst.set(np.ascontiguousarray(src), stream=self.stream)
        self._pending = None
        self._pending_groups = None

    def export_prefix(self, state: FastState) -> dict[str, np.ndarray]:
        n = state.position
        self.stream.synchronize()
        arrays = {"gdn": state.gdn.get(), "window": state.window.get()}  # host arrays: they go to disk
        arrays["k"] = state.k[:, :, :n].get()
        arrays["v"] = state.v[:, :, :n].get()
        side = state.side_arrays()  # fp8 row exponents ("k.exp", ...) or rotated norms ("k.norm", ...)
        for name in ("k", "v"):
            for suffix in (".exp", ".norm"):
                if name + suffix in side:
                    arrays[name + suffix] = side[name + suffix][:, :, :n].get()
        if state.mtp_kv is not None:
            m = min(state.mtp_kv.length, max(n - 1, 0))
            arrays["mtp.k"] = state.mtp_k[:, :m].get()
            arrays["mtp.v"] = state.mtp_v[:, :m].get()
            for name, a in side.items():
                if name.startswith("mtp."):
                    arrays[name] = a[:, :m].get()
        return arrays

    def import_prefix(self, state: FastState, arrays: dict[str, np.ndarray], position: int) -> None:
        cp = self.rt.cp
        side = state.side_arrays()
        _check_prefix_format(state, arrays, side)
        state.k[:, :, :position] = cp.asarray(arrays["k"])
        state.v[:, :, :position] = cp.asarray(arrays["v"])
        for name, a in side.items():
            if not name.startswith("mtp."):
                a[:, :, :position] = cp.asarray(arrays[name])
        if state.mtp_kv is not None and "mtp.k" in arrays:
            m = arrays["mtp.k"].shape[1]
            state.mtp_k[:, :m] = cp.asarray(arrays["mtp.k"])
            state.mtp_v[:, :m] = cp.asarray(arrays["mtp.v"])
            for name, a in side.items():
                if name.startswith("mtp."):
                    a[:, :m] = cp.asarray(arrays[name])
            state.mtp_kv.length = m
        self.rewind(state, position, arrays)

    def memory_per_sequence(self, context: int) -> int:
        cfg = self.cfg
        # bytes of one (position, kv head) row of K and of V, side data included (fp8 exponent, fp16 norm)
        kb, vb = (4 * cfg.head_dim,) * 2 if self.kv_name == "f32" else get_format(self.kv_name).row_bytes(cfg.head_dim)
        per_tok = cfg.num_key_value_heads * (kb + vb) * (len(cfg.full_layers) + (1 if self.has_mtp else 0))
        fixed = 4 * len(cfg.linear_layers) * (
            cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
            + (cfg.linear_conv_kernel_dim - 1) * cfg.gdn_conv_dim)
        return per_tok * context + fixed


def _check_prefix_format(state: FastState, arrays: dict, side: dict) -> None:
    """Rows of another KV format are refused, never reinterpreted (the compatibility hash keeps disk
    entries apart; this guards a caller that hands arrays across models)."""
    want = {"k": (state.k.dtype, state.k.shape[-1]), "v": (state.v.dtype, state.v.shape[-1])}
    for name, (dtype, row) in want.items():
        a = arrays.get(name)
        if a is None or a.dtype != dtype or a.shape[-1] != row:
            got = None if a is None else f"{a.dtype}{list(a.shape)}"
            raise ValueError(f"KV rows in another format: {name} is {got}, this model stores {dtype} rows of {row}")
    base = {n for n in side if not n.startswith("mtp.")}
    extra = {n for n in arrays if n.split(".")[-1] in ("exp", "norm") and not n.startswith("mtp.")}
    if base != extra:
        raise ValueError(f"KV rows in another format: side arrays {sorted(extra)}, this model's {sorted(base)}")


class DeviceSnapshot(dict):
    """save_recurrent()'s dict when its arrays live on the device; counts the bytes it holds so the
    model keeps device snapshots under FastModel.device_snapshot_bytes (freed with the dict)."""

    live_bytes = 0

    def __init__(self, arrays: dict, nbytes: int):
        super().__init__(arrays)
        self._nbytes = nbytes
        DeviceSnapshot.live_bytes += nbytes

    def __del__(self):
        DeviceSnapshot.live_bytes -= self._nbytes


class HostSnapshot(dict):
    """save_recurrent()'s dict past the device budget: pinned host arrays that copies queued on the model's
    stream are still filling. Reading one (rewind's recurrent[name], any test) first waits for those copies
    (the event recorded after them); rewind's set() on the same stream would be ordered after them anyway."""

    live_bytes = 0  # pinned bytes held by live HostSnapshots (FastModel.pinned_snapshot_bytes bounds it)

    def __init__(self, arrays: dict, event, nbytes: int = 0):
        super().__init__(arrays)
        self._event = event
        self._nbytes = int(nbytes)
        HostSnapshot.live_bytes += self._nbytes

    def __del__(self):
        HostSnapshot.live_bytes -= self._nbytes

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def __getitem__(self, name):
        self.wait()
        return super().__getitem__(name)

    def values(self):
        self.wait()
        return super().values()

    def items(self):
        self.wait()
        return super().items()


def check_supported(cfg: ModelConfig) -> None:
    """Dims the kernels handle; anything else keeps the reference path (ConfigError names the field)."""
    from q27py.errors import ConfigError

    hd = cfg.head_dim
    if hd % 32 or hd // 32 not in (1, 2, 4, 8):
        raise ConfigError(f"fast path: head_dim {hd} unsupported (32, 64, 128 or 256)")
    if cfg.num_attention_heads // cfg.num_key_value_heads > 8:
        raise ConfigError("fast path: more than 8 query heads per kv head")
    if cfg.linear_key_head_dim > 128 or max(cfg.linear_key_head_dim, cfg.linear_value_head_dim) > 1024:
        raise ConfigError(f"fast path: GDN head dims {cfg.linear_key_head_dim}/{cfg.linear_value_head_dim} unsupported")
    if cfg.linear_conv_kernel_dim - 1 > 8:
        raise ConfigError(f"fast path: linear_conv_kernel_dim {cfg.linear_conv_kernel_dim} > 9")


def _runs(rows: np.ndarray):
    """Sorted unique rows -> (start, length) runs."""
    r = np.unique(rows)
    i = 0
    while i < r.size:
        j = i
        while j + 1 < r.size and r[j + 1] == r[j] + 1:
            j += 1
        yield int(r[i]), int(j - i + 1)
        i = j + 1


def load_fast_model(cfg) -> FastModel:
    """EngineConfig -> FastModel (the engine's `--device cuda` path).

    model_dir may be a Hugging Face checkpoint directory (quantized on the GPU to
    cfg.engine.tier, bf16 when unset) or a repacked .q27 file (its own tier).
    """
    from pathlib import Path

    from q27py.gpu.weights import from_checkpoint, from_q27file
    from q27py.model.checkpoint import Checkpoint

    e = cfg.engine
    if C.PDL_NOWAIT:  # a timing probe's switch (common.cuh pdl_wait): its results are wrong
        from q27py.errors import Q27Error

        raise Q27Error("PDL_NOWAIT is set in the constants table: a timing probe only, not for serving")
    set_pdl_mode(e.pdl)  # before any compile: PDL_EARLY is a compile option
    src = Path(e.model_dir)
    if src.is_file():
        weights = from_q27file(src, progress=True)
    else:
        weights = from_checkpoint(Checkpoint.open(src), tier=e.tier or "bf16", progress=True)
    mpe = weights.cfg.max_position_embeddings
    kv = resolve_fast_kv(e.kv, weights.tier, Runtime.get().cc)
    ctx = min(e.max_context, mpe) if isinstance(e.max_context, int) else mpe
    # chunk: prefill runs the GEMM (cuBLAS on bf16 expansions, or the mma.sync kernel) on up to
    # this many rows per weight pass (docs/PERF.md)
    K.PREFILL_GEMM = e.prefill_gemm
    K.PREFILL_SMALL_GEMM = K.prefill_small_gemm_mode(e.prefill_small_gemm)
    K.PREFILL_GATE_UP_BF16 = bool(e.prefill_gate_up_bf16)  # its own tolerance class (docs/QUANT.md)
    from q27py.gpu import blas

    blas.set_expand_ahead(e.prefill_expand_ahead)
    # "auto" starts at 0 and is sized with the slots (configure_memory), once the states' size is known
    blas.set_weight_cache(blas.weight_cache_budget(e.prefill_weight_cache_gb, expansions_bytes(weights)))
    K.GDN_PREFILL = K.gdn_prefill_mode(e.gdn_prefill)
    K.ATTN_PREFILL = K.attn_prefill_mode(e.attn_prefill)
    K.ATTN_PREFILL_WGMMA = bool(e.attn_prefill_wgmma)
    K.GEMV_WGMMA = K.gemv_wgmma_mode(e.gemv_wgmma)
    K.GDN2_OUT_GATED = bool(e.gdn_out_fused)
    K.GDN2_OUT_TF32 = bool(e.prefill_gdn_out_tf32)  # its own tolerance class (docs/QUANT.md "tf32 out")
    K.GDN2_STATE_TF32 = bool(e.prefill_gdn_state_tf32)  # its own tolerance class (docs/QUANT.md "tf32 state")
    K.ATTN_DECODE = K.attn_decode_mode(e.attn_decode)
    K.ATTN_DECODE_FP8 = bool(e.attn_decode_fp8)
    model = FastModel(weights, max_context=ctx, kv_dtype=kv, chunk=e.gpu_prefill_chunk, gdn_fused=e.gdn_fused,
                      batch_sweep=e.batch_sweep, verify_groups=e.verify_groups)
    configure_memory(model, e)
    model.enable_graphs(**graph_budgets(model, e))
    # every kernel module compiled now, not inside the first request that needs it (the first short
    # request beside a long prefill waited 911 ms for one in a fresh process: docs/PERF.md, f2)
    model.rt.warm_all()
    return model


# KV formats the fast path's kernels store and read (q27py/model/kvformat.py names; "f32" is the
# golden-test path's fp32 rows). k5v3 / k3v3: cuda/kv_rotated.cu + rope.cu's store + the rotated
# prefill tiles (FastModel._attention_rotated).
FAST_KV_FORMATS = ("bf16", "fp8", "k5v3", "k3v3")
# What `--kv auto` may pick on CUDA. fp8 joins once tests/gpu/test_kv_fp8.py and the decode bench
# (tools/device_kv.sh) pass on the device: until then auto keeps bf16 (and the canonical gates).
AUTO_FAST_KV_FORMATS = ("bf16",)


def resolve_fast_kv(kv: str, tier: str, cc: tuple[int, int]) -> str:
    """EngineConfig.kv -> the fast path's KV storage. auto: fp32 rows for bf16 weights (the path the
    golden tests hold to 1e-3), else kvbudget.auto_kv_format among FAST_KV_FORMATS."""
    from q27py.errors import ConfigError
    from q27py.model.kvbudget import auto_kv_format

    if kv == "auto":
        return "f32" if tier == "bf16" else auto_kv_format(cc, AUTO_FAST_KV_FORMATS)
    if kv not in FAST_KV_FORMATS:
        raise ConfigError(f"--kv {kv}: the CUDA path reads {', '.join(FAST_KV_FORMATS)} KV (docs/KV.md)")
    return kv


def graph_bytes_per_state(model: FastModel, e) -> int:
    """What one state's CUDA graphs are assumed to take (EngineConfig.graph_bytes_per_layer x layers)."""
    return int(e.graph_bytes_per_layer) * (model.cfg.num_hidden_layers + (1 if model.has_mtp else 0))


def graph_budgets(model: FastModel, e) -> dict:
    """enable_graphs' budgets: exactly what configure_memory set aside for graphs, per state
    (graph_bytes_per_state) and model-level (batch_graph_bytes), so the graphs stay inside the plan."""
    return {"state_budget": graph_bytes_per_state(model, e), "model_budget": batch_graph_bytes(model)}


def batch_graph_bytes(model: FastModel) -> int:
    """The model-level graphs' reserve (kvbudget.batch_graph_reserve): decode_batch widths, verify_batch /
    commit_batch keys, and mtp_draft_batch's ("mtp-batch", rows, chains, depth) chain graphs up to
    MTP_CHAIN_DEPTH deep where the model batches MTP chains (mtp_batch_lanes > 0)."""
    from q27py.model.kvbudget import batch_graph_reserve

    return batch_graph_reserve(model.max_batch, model.verify_lanes,
                               mtp_lanes=model.mtp_batch_lanes, mtp_depth=MTP_CHAIN_DEPTH)


def expansions_bytes(weights) -> int:
    """Every bf16 expansion the cuBLAS prefill route can keep resident (ExpansionCache's ceiling)."""
    from q27py.gpu import blas

    return sum(blas.expanded_bytes(m) for m in weights.matrices() if K.gemm_supported(m))


def auto_weight_cache_bytes(free_bytes: int, reserved_bytes: int, expansions: int) -> int:
    """EngineConfig.prefill_weight_cache_gb "auto": what free memory has left once `reserved_bytes`
    (the states the card keeps without the cache, graphs, scratch and margin) are set aside, up to
    every expansion. Never negative."""
    return max(0, min(int(expansions), int(free_bytes) - int(reserved_bytes)))


def _size_auto_cache(model: FastModel, e, free: int, keep: int, state_bytes: int, graphs: int) -> None:
    """Start the "auto" expansion cache with what `free` leaves beside `keep` states of state_bytes,
    the model-level graphs and the margin."""
    from q27py.gpu import blas

    reserved = keep * state_bytes + graphs + e.kv_safety_margin_bytes
    blas.set_weight_cache(auto_weight_cache_bytes(free, reserved, expansions_bytes(model.w)))


def configure_memory(model: FastModel, e) -> None:
    """The load-time memory plan: --max-context / --max-slots auto sized to free memory
    (size_context_to_memory, which also sizes an "auto" expansion cache), or, both fixed, an "auto"
    cache sized beside the fixed states."""
    if not isinstance(e.max_context, int) or not isinstance(e.max_slots, int):
        size_context_to_memory(model, e)
        return
    if e.prefill_weight_cache_gb != "auto":
        return
    cp = model.rt.cp
    cp.get_default_memory_pool().free_all_blocks()
    free, _total = cp.cuda.runtime.memGetInfo()
    _size_auto_cache(model, e, free, max(1, e.max_sequences, e.max_slots),
                     model.memory_per_sequence(model.max_pos) + graph_bytes_per_state(model, e),
                     batch_graph_bytes(model))


def expansion_cache_reserve() -> int:
    """Device bytes the prefill's resident bf16 expansions will take (blas.ExpansionCache; filled
    lazily by the first prefill, after the sizing, so the sizing sets them aside)."""
    from q27py.gpu import blas

    cache = blas.weight_cache()
    return cache.budget - cache.used if cache is not None else 0


def size_context_to_memory(model: FastModel, e) -> None:
    """--max-context auto and --max-slots auto: the window and the slot count the free memory holds
    once weights and scratch are resident (q27py/model/kvbudget.py plan_slots: every slot owns one
    sequence state, KV window + GDN state + the graphs captured for it; the model-level batch graphs
    are reserved once, batch_graph_bytes, and so are the resident prefill expansions not yet made,
    expansion_cache_reserve). A fixed --max-context keeps
    its window (only the slots are sized); a fixed --max-slots keeps its count."""
    import sys

    from q27py.config import GPU_AUTO_MAX_SLOTS, GPU_AUTO_MIN_SLOTS
    from q27py.model.kvbudget import plan_slots

    cp = model.rt.cp
    cp.get_default_memory_pool().free_all_blocks()
    free, _total = cp.cuda.runtime.memGetInfo()
    fixed = model.memory_per_sequence(0)
    graphs = batch_graph_bytes(model)  # decode / verify / commit and the mtp-batch chain graphs

    def plan_for(scratch: int):
        return plan_slots(free, model.memory_per_sequence(1) - fixed, kv_format=model.kv_name,
                          max_slots=e.max_slots, max_context=e.max_context if isinstance(e.max_context, int) else "auto",
                          max_sequences=e.max_sequences, fixed_per_sequence=fixed,
                          graph_bytes_per_state=graph_bytes_per_state(model, e), margin_bytes=e.kv_safety_margin_bytes,
                          scratch_bytes=scratch, max_positions=model.max_pos,
                          cap=GPU_AUTO_MAX_SLOTS, floor=GPU_AUTO_MIN_SLOTS)

    if e.prefill_weight_cache_gb == "auto":
        # The window and the states the card keeps without the cache come first (the floor's, or
        # a fixed --max-slots'); the cache takes only what would have become extra slots.
        keep = max(1, e.max_sequences, e.max_slots if isinstance(e.max_slots, int) else GPU_AUTO_MIN_SLOTS)
        _size_auto_cache(model, e, free, keep, plan_for(graphs).state_bytes, graphs)
    plan = plan_for(graphs + expansion_cache_reserve())
    model.max_pos = plan.budget.window  # states are allocated later, at this size
    model.context_budget = plan.budget
    model.slot_plan = plan
    model.sized_slots = plan.slots if not isinstance(e.max_slots, int) else None
    print(f"q27py: {plan.describe()}", file=sys.stderr, flush=True)
