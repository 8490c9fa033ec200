"""The reference forward pass in numpy: the specification of the model.

Readable first: one function per block, the math of transformers' Qwen3.5
modeling code (../shared/reference/model.md §2) with nothing fused. Every CUDA
kernel and the fast forward are tested against this.

Two properties matter beyond the math:
- Row independence for small T. For T <= SMALL_T (decode, MTP drafts, verify lanes)
  every matmul and attention is done one row at a time, so the numbers of token t
  never depend on how many tokens were processed with it. That is what makes
  "commit n verified lanes" bitwise equal to "n plain decode steps" on this path.
- Verify never touches committed GDN state: `forward(..., verify=True)` records the
  recurrent state and conv window after every token in a Trace, and `commit`
  installs the one of the last accepted token (per-lane state slots; free rollback).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from q27py.model.checkpoint import Checkpoint
from q27py.io.safetensors import round_to_bf16
from q27py.model import ops
from q27py.model.config import FULL, ModelConfig
from q27py.model.kvformat import get_format
from q27py.model.state import GDNState, KVCache, SequenceState

SMALL_T = 16  # at or below this many tokens, compute row by row (see module docstring)

COMPUTE_DTYPES = {"float32": np.float32, "float64": np.float64, "bfloat16": np.float32}


@dataclass
class Trace:
    """What a verify forward produced, per token, for every GDN layer (committed state untouched)."""

    n_tokens: int
    recurrent: dict[int, np.ndarray]  # layer -> [T, HV, dk, dv], state after each token
    conv: dict[int, np.ndarray]  # layer -> [T, K-1, C], conv window after each token


@dataclass
class ForwardOutput:
    logits: np.ndarray  # [R, V] for the requested rows
    hidden: np.ndarray  # [T, H] post-final-norm hidden states (what the MTP head consumes)
    trace: Trace | None = None

    def hidden_owned(self, wait: bool = True) -> np.ndarray:
        """The hidden rows as an array the caller owns, in the model's own memory (host here; a
        device copy on the fast path, gpu/forward.py FastOutput): the prefill hands them to the MTP
        warm-up without a round trip through the host. wait=False lets the fast path's copy stay
        queued on its stream (nothing to wait for here)."""
        return self.hidden


class ReferenceModel:
    def __init__(self, checkpoint: Checkpoint, dtype: str = "float32", kv: str | None = None):
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(COMPUTE_DTYPES)}")
        # KV format (q27py/model/kvformat.py) of every attention layer's cache, the MTP layer's
        # included: rows are quantized on store and attention reads their dequantization.
        # None keeps rows in the compute dtype (the specification's own numbers).
        self.kv_format = None if kv in (None, "auto", "none") else get_format(kv).name
        self.cfg: ModelConfig = checkpoint.config
        self.dtype_name = dtype
        self.dtype = COMPUTE_DTYPES[dtype]
        # bfloat16 mode: fp32 arithmetic, activations rounded to bf16 where a bf16 model stores them.
        self._round = round_to_bf16 if dtype == "bfloat16" else (lambda x: x)
        self.has_mtp = checkpoint.has_mtp
        self.w = {name: checkpoint.get(name, self.dtype) for name in checkpoint.names()}
        self.lm_head = self.w["embed_tokens.weight"] if self.cfg.tie_word_embeddings else self.w["lm_head.weight"]
        # A_log is exponentiated in fp32 (at least), once.
        for i in self.cfg.linear_layers:
            p = f"layers.{i}.linear_attn."
            self.w[p + "neg_A"] = -np.exp(self.w[p + "A_log"].astype(np.float64)).astype(self.dtype)
            self.w[p + "conv1d.weight"] = self.w[p + "conv1d.weight"][:, 0, :]

    @classmethod
    def load(cls, model_dir, dtype: str = "float32", kv: str | None = None) -> "ReferenceModel":
        return cls(Checkpoint.open(model_dir), dtype, kv)

    def new_state(self) -> SequenceState:
        state_dtype = np.float64 if self.dtype == np.float64 else np.float32
        return SequenceState.new(self.cfg, self.dtype, state_dtype, with_mtp=self.has_mtp, kv_format=self.kv_format)

    def reset_state(self, state: SequenceState) -> None:
        fresh = self.new_state()  # host arrays that grow with the sequence: nothing to keep
        state.position, state.kv, state.gdn, state.mtp_kv = fresh.position, fresh.kv, fresh.gdn, fresh.mtp_kv
        state.hidden_last, state.suffix_index = None, None

    # ------------------------------------------------------------------ primitives
    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        w = self.w[name]
        if x.shape[0] <= SMALL_T:
            y = np.stack([x[i] @ w.T for i in range(x.shape[0])])
        else:
            y = x @ w.T
        return self._round(y)

    def _norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return self._round(ops.rms_norm(x, self.w[name], self.cfg.rms_norm_eps))

    # ------------------------------------------------------------------ blocks
    def _mlp(self, x: np.ndarray, p: str) -> np.ndarray:
        h = self._round(ops.silu(self._linear(x, p + "mlp.gate_proj.weight")) * self._linear(x, p + "mlp.up_proj.weight"))
        return self._linear(h, p + "mlp.down_proj.weight")

    def _attention(self, x: np.ndarray, p: str, kv: KVCache, start: int) -> np.ndarray:
        cfg = self.cfg
        t, nq, nkv, hd = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg = self._linear(x, p + "self_attn.q_proj.weight").reshape(t, nq, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(t, nq * hd)
        q = self._round(ops.rms_norm(q, self.w[p + "self_attn.q_norm.weight"], cfg.rms_norm_eps))
        k = self._linear(x, p + "self_attn.k_proj.weight").reshape(t, nkv, hd)
        k = self._round(ops.rms_norm(k, self.w[p + "self_attn.k_norm.weight"], cfg.rms_norm_eps))
        v = self._linear(x, p + "self_attn.v_proj.weight").reshape(t, nkv, hd)
        pos = np.arange(start, start + t)
        cos, sin = ops.rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, self.dtype)
        q = self._round(ops.apply_rope(q, cos, sin))
        k = self._round(ops.apply_rope(k, cos, sin))
        assert kv.length == start, "KV rows must be contiguous with the new tokens"
        kv.append(k, v)
        keys, values = kv.k[: kv.length], kv.v[: kv.length]
        scale = hd ** -0.5
        if t <= SMALL_T:
            o = np.concatenate([ops.attention(q[i : i + 1], keys[: start + i + 1], values[: start + i + 1], pos[i : i + 1], scale) for i in range(t)])
        else:
            o = ops.attention(q, keys, values, pos, scale)
        o = self._round(o.reshape(t, nq * hd).astype(self.dtype)) * ops.sigmoid(gate)
        return self._linear(self._round(o), p + "self_attn.o_proj.weight")

    def _gdn(self, x: np.ndarray, p: str, st: GDNState, record: bool):
        cfg = self.cfg
        a = p + "linear_attn."
        t = x.shape[0]
        h, hv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        raw = self._linear(x, a + "in_proj_qkv.weight")  # [T, C] = [q | k | v], pre-conv
        conv_out, new_conv = ops.causal_conv1d(raw, self.w[a + "conv1d.weight"], st.conv)
        mixed = self._round(ops.silu(conv_out))
        kd = cfg.gdn_key_dim
        q = mixed[:, :kd].reshape(t, h, dk)
        k = mixed[:, kd : 2 * kd].reshape(t, h, dk)
        v = mixed[:, 2 * kd :].reshape(t, hv, dv)
        z = self._linear(x, a + "in_proj_z.weight").reshape(t, hv, dv)
        beta = ops.sigmoid(self._linear(x, a + "in_proj_b.weight"))
        g = self.w[a + "neg_A"] * ops.softplus(self._linear(x, a + "in_proj_a.weight") + self.w[a + "dt_bias"])
        q = ops.l2norm(q) * (dk ** -0.5)
        k = ops.l2norm(k)
        sd = st.recurrent.dtype
        res = ops.gdn_recurrent(q.astype(sd), k.astype(sd), v.astype(sd), g.astype(sd), beta.astype(sd), st.recurrent, return_all_states=record)
        o = res[0].astype(self.dtype)
        o = self._round(ops.rms_norm_gated(o, z, self.w[a + "norm.weight"], cfg.rms_norm_eps))
        out = self._linear(o.reshape(t, hv * dv), a + "out_proj.weight")
        if record:
            # conv window after token i = the last K-1 raw inputs ending at i
            km1 = cfg.linear_conv_kernel_dim - 1
            history = np.concatenate([st.conv, raw], axis=0)
            windows = np.stack([history[i + 1 : i + 1 + km1] for i in range(t)])
            return out, (res[2], windows)
        return out, (res[1], new_conv)

    # ------------------------------------------------------------------ forward
    def embed(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.cfg.vocab_size):
            raise ValueError(f"token id out of range 0..{self.cfg.vocab_size - 1}")
        return self.w["embed_tokens.weight"][ids].astype(self.dtype)

    def logits(self, hidden: np.ndarray) -> np.ndarray:
        if hidden.shape[0] == 0:
            return np.zeros((0, self.lm_head.shape[0]), dtype=self.dtype)
        if hidden.shape[0] <= SMALL_T:
            return np.stack([hidden[i] @ self.lm_head.T for i in range(hidden.shape[0])])
        return hidden @ self.lm_head.T

    def forward(self, state: SequenceState, ids, logits_rows="all", verify: bool = False) -> ForwardOutput:
        """Run tokens `ids` at positions state.position.. through the stack.

        Commit mode (default): state advances by len(ids) (prefill chunk or decode).
        Verify mode: attention KV rows are appended past state.position but the GDN
        state and position are untouched; the returned Trace lets `commit` keep any
        prefix of the tokens. logits_rows: "all", "last", or a list of row indices.
        """
        cfg = self.cfg
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        t = ids.shape[0]
        start = state.position
        for kv in state.kv.values():
            kv.truncate(start)  # drop rows of an earlier, uncommitted verify
        h = self.embed(ids)
        trace = Trace(t, {}, {}) if verify else None
        for i, kind in enumerate(cfg.layer_types):
            p = f"layers.{i}."
            r = h
            x = self._norm(h, p + "input_layernorm.weight")
            if kind == FULL:
                y = self._attention(x, p, state.kv[i], start)
            else:
                y, (rec, conv) = self._gdn(x, p, state.gdn[i], record=verify)
                if verify:
                    trace.recurrent[i], trace.conv[i] = rec, conv
                else:
                    state.gdn[i] = GDNState(rec, conv)
            h = self._round(r + y)
            h = self._round(h + self._mlp(self._norm(h, p + "post_attention_layernorm.weight"), p))
        hidden = self._norm(h, "norm.weight")
        if not verify:
            state.position = start + t
        rows = select_rows(t, logits_rows)
        return ForwardOutput(self.logits(hidden[rows]), hidden, trace)

    # The batched decode contract (the engine's shared rounds, engine/scheduler.py), met by the
    # CUDA FastModel too: at most max_batch distinct states, one token each, commit mode; state i
    # advances exactly as forward(states[i], [ids[i]]) would advance it, and output i is that
    # forward's output (logits [1, V], hidden [1, H], trace None), bitwise.
    max_batch = 16
    # The rest of the engine's interface (model/interface.py ForwardModel): a forward of any length
    # returns every hidden row, no window or slot count of its own, the MTP ladder runs on the host.
    chunk: int | None = None
    max_pos: int | None = None
    sized_slots: int | None = None
    drafts_on_device = False
    # verify_batch's lanes, all groups together: the GPU sweep's flat width (16, the GEMV's lanes), so
    # the engine splits its shared rounds here as it does there and the CPU tests see the same shapes
    verify_lanes = 16

    def decode_batch(self, states: list[SequenceState], ids: list[int]) -> list[ForwardOutput]:
        """One decode step for each of several sequences: here literally the loop of solo forwards,
        so bitwise by construction. There is no weight-bandwidth win on the CPU (every row's matmul
        reads the weights anyway; B lanes cost B steps): this is what lets the engine's batched
        rounds run, and be tested, without a GPU."""
        if len(states) != len(ids):
            raise ValueError(f"decode_batch: {len(states)} states but {len(ids)} ids")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("decode_batch: a state appears twice (each lane is its own sequence)")
        if len(states) > self.max_batch:
            raise ValueError(f"decode_batch: {len(states)} lanes > max_batch {self.max_batch}")
        return [self.forward(state, [int(t)]) for state, t in zip(states, ids)]

    def verify_batch(self, states: list[SequenceState], groups: list) -> list[ForwardOutput]:
        """The verify forwards of several sequences (the shared round with drafts): here the loop of
        solo verify forwards, so bitwise by construction (no sweep to share on the CPU, as for
        decode_batch). Each forward leaves its own Trace (copies of every lane's recurrent state), so
        the commits that follow may come in any order."""
        groups = [[int(t) for t in g] for g in groups]
        if len(states) != len(groups):
            raise ValueError(f"verify_batch: {len(states)} states but {len(groups)} groups")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("verify_batch: a state appears twice (each group is its own sequence)")
        if len(states) > self.max_batch:
            raise ValueError(f"verify_batch: {len(states)} groups > max_batch {self.max_batch}")
        if any(not 1 <= len(g) <= SMALL_T for g in groups) or sum(map(len, groups)) > self.verify_lanes:
            raise ValueError(f"verify_batch: groups of 1..{SMALL_T} tokens, at most {self.verify_lanes} in all")
        return [self.forward(state, g, logits_rows="all", verify=True) for state, g in zip(states, groups)]

    def commit_batch(self, states: list[SequenceState], traces: list, ns: list) -> None:
        """commit() for each group of the verify_batch just run."""
        if not len(states) == len(traces) == len(ns):
            raise ValueError("commit_batch: one trace and one count per state")
        for state, trace, n in zip(states, traces, ns):
            self.commit(state, trace, int(n))

    def commit(self, state: SequenceState, trace: Trace, n: int) -> None:
        """Keep the first n tokens of a verify forward: the state becomes that of n plain steps."""
        assert 1 <= n <= trace.n_tokens
        state.position += n
        for kv in state.kv.values():
            kv.truncate(state.position)
        for i, st in state.gdn.items():
            state.gdn[i] = GDNState(trace.recurrent[i][n - 1].copy(), trace.conv[i][n - 1].copy())

    # ------------------------------------------------------------------ MTP head
    def mtp_draft_chain(self, kv: KVCache, hidden, next_ids, start: int, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """The fast path's whole greedy MTP ladder as one call, here as its host steps (the same
        mtp_forward calls the host ladder makes, engine/drafters.py MTPLadder.draft): step 0 over the
        rows at start.., then depth - 1 steps each fed the previous argmax and post-norm row. Returns
        (ids [depth], top1 - top2 margins [depth]); the MTP KV ends at start + t + depth - 1 rows (the
        caller truncates). What lets the engine batch several ladders' chains (mtp_draft_batch) and be
        tested without a GPU: the drafts a caller keeps are the host ladder's, bit for bit."""
        next_ids = [int(t) for t in np.asarray(next_ids).reshape(-1)]
        t, depth = len(next_ids), max(1, int(depth))
        logits, h = self.mtp_forward(kv, hidden, next_ids, start, logits_rows="last")
        step, h = logits[-1], h[-1:]
        ids, margins = np.zeros(depth, np.int64), np.zeros(depth, np.float32)
        for k in range(depth):
            top = np.partition(step, -2)[-2:] if step.shape[0] >= 2 else None
            margins[k] = float(top[1] - top[0]) if top is not None else float("inf")  # drafters.top2_margin
            ids[k] = int(np.argmax(step))
            if k + 1 < depth:
                lg, h = self.mtp_forward(kv, h, [int(ids[k])], start + t - 1 + k + 1)
                step = lg[0]
        return ids, margins

    def mtp_draft_batch(self, kvs: list, hiddens: list, next_ids: list, starts: list, depth: int) -> list:
        """mtp_draft_chain for several sequences (the shared round's ladders, engine.run_drafts): here
        the loop of chains, bitwise by construction."""
        if not len(kvs) == len(hiddens) == len(next_ids) == len(starts):
            raise ValueError("mtp_draft_batch: one MTP KV, row block, id list and start per chain")
        return [self.mtp_draft_chain(kv, h, ids, int(s), depth) for kv, h, ids, s in zip(kvs, hiddens, next_ids, starts)]

    def mtp_forward(self, kv: KVCache, hidden: np.ndarray, next_ids, start: int,
                    logits_rows="all") -> tuple[np.ndarray, np.ndarray]:
        """One MTP layer pass over rows at positions start.. (appends their KV rows).

        Row i pairs the main model's post-norm hidden state at position start+i with
        the token at position start+i+1 and predicts the token after that. Returns
        (logits [R, V] for logits_rows ("all", "last", "none" or row indices), post-mtp.norm
        hidden [T, H]); the hidden feeds the next draft step. Warming rows needs no logits.
        """
        if not self.has_mtp:
            raise RuntimeError("this checkpoint has no MTP head")
        kv.truncate(start)
        e = self._norm(self.embed(next_ids), "mtp.pre_fc_norm_embedding.weight")
        hh = self._norm(hidden.astype(self.dtype), "mtp.pre_fc_norm_hidden.weight")
        x = self._linear(np.concatenate([e, hh], axis=-1), "mtp.fc.weight")
        p = "mtp.layers.0."
        r = x
        y = self._attention(self._norm(x, p + "input_layernorm.weight"), p, kv, start)
        h = self._round(r + y)
        h = self._round(h + self._mlp(self._norm(h, p + "post_attention_layernorm.weight"), p))
        hm = self._norm(h, "mtp.norm.weight")
        return self.logits(hm[select_rows(hm.shape[0], logits_rows)]), hm

    # ------------------------------------------------------------------ state transfer
    # What prefix reuse needs from a model (the fast path has the same methods): save and
    # install the GDN + conv state, rewind a sequence to a position, and move whole
    # prefixes (KV rows included) to and from plain numpy arrays for the disk cache.
    @property
    def state_format(self) -> str:
        """Names what export_prefix's arrays mean (part of the prefix cache's compatibility hash):
        rows in another KV format are another format, and a restore across formats must miss."""
        return "reference" if self.kv_format is None else f"reference-kv={self.kv_format}"

    def save_recurrent(self, state: SequenceState) -> dict[str, np.ndarray]:
        out = {}
        for i, g in state.gdn.items():
            out[f"gdn.{i}.recurrent"] = g.recurrent.copy()
            out[f"gdn.{i}.conv"] = g.conv.copy()
        return out

    def rewind(self, state: SequenceState, position: int, recurrent: dict[str, np.ndarray]) -> None:
        """Cut KV rows back to `position` and install the GDN state saved there."""
        state.position = position
        for kv in state.kv.values():
            kv.truncate(min(kv.length, position))
        if state.mtp_kv is not None:
            # The MTP row of position p pairs hidden p with token p+1: rows up to p-2 stay valid.
            state.mtp_kv.truncate(min(state.mtp_kv.length, max(position - 1, 0)))
        for i in state.gdn:
            state.gdn[i] = GDNState(recurrent[f"gdn.{i}.recurrent"].copy(), recurrent[f"gdn.{i}.conv"].copy())

    def export_prefix(self, state: SequenceState) -> dict[str, np.ndarray]:
        n = state.position
        arrays = self.save_recurrent(state)
        # rows as stored: in a KV format these are the quantized bytes ("kv.3.k.codes", ...)
        for i, kv in state.kv.items():
            for name, a in kv.export_rows(n).items():
                arrays[f"kv.{i}.{name}"] = a
        if state.mtp_kv is not None:
            m = min(state.mtp_kv.length, max(n - 1, 0))
            for name, a in state.mtp_kv.export_rows(m).items():
                arrays[f"mtp.{name}"] = a
        return arrays

    def import_prefix(self, state: SequenceState, arrays: dict[str, np.ndarray], position: int) -> None:
        def rows(prefix: str) -> dict[str, np.ndarray]:
            return {key[len(prefix):]: a for key, a in arrays.items() if key.startswith(prefix)}

        for i, kv in state.kv.items():
            kv.import_rows(rows(f"kv.{i}."))
        if state.mtp_kv is not None:
            state.mtp_kv.truncate(0)
            if rows("mtp."):
                state.mtp_kv.import_rows(rows("mtp."))
        self.rewind(state, position, arrays)


def select_rows(t: int, rows) -> np.ndarray:
    """logits_rows ("all", "last", "none" or row indices) -> indices into T rows (both forward paths)."""
    if isinstance(rows, str):
        if rows == "all":
            return np.arange(t)
        if rows == "last":
            return np.array([t - 1])
        if rows == "none":
            return np.zeros(0, dtype=np.int64)
        raise ValueError(f"logits_rows {rows!r}")
    return np.asarray(rows, dtype=np.int64).reshape(-1)

