"""Prefix reuse for a hybrid model: live sequences, GDN snapshots, and a token-verified disk cache.

Attention KV rows are an append-only log addressed by position: any prefix of them
is reusable by cutting the log back. Gated DeltaNet state is an order-dependent
summary that can only be resumed where it was saved. So reuse is designed in:

- Every live sequence remembers its tokens and keeps GDN snapshots (recurrent +
  conv state, plus the post-norm hidden of the last token, which the MTP head needs
  to warm its next row) at chosen positions: the renderer's stable boundary (end of
  the last complete turn: what the next request re-sends), the end of the shared
  system+tools block, and every `checkpoint_every` positions (an absolute grid). A grid
  checkpoint that would cut a prefill piece shorter than `checkpoint_min_piece` tokens
  is taken at the nearest piece boundary instead (the resume point, the prompt's end,
  or a system / stable mark): see `PrefixCache.snapshot_positions`.
- A new request restores, across all live sequences, the longest snapshot whose
  tokens are a prefix of its prompt, cuts KV rows back to it, and prefills only the
  rest. Snapshots past the restore point are dropped: their KV rows get overwritten.
- The opt-in disk cache stores whole prefixes (tokens + KV rows + GDN state). Its
  file names are hashes, never trusted: the stored token vector is compared element
  by element, and a compatibility hash (model bytes, dims, format) plus checksums over
  the header and every array make foreign, stale, truncated or bit-flipped files
  invisible. The entry bytes are q27py/io/prefix_entry.py's; this module is the policy
  (which entries exist, LRU by mtime, when to write). Any failure of the disk tier means
  "ignore the entry, log it, serve cold": the cache directory can neither stop startup
  (unreadable, read-only, a FIFO named like an entry) nor fail a request.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from q27py.engine.decoder import chunk_cuts
from q27py.io import prefix_entry
from q27py.io.blobfile import BlobFileError, open_regular
from q27py.io.prefix_entry import FORMAT_VERSION, ForeignEntry

log = logging.getLogger("q27py.prefix")


DISK_KINDS = ("stable", "system")  # the snapshots also written to the disk tier (when it is on)
BOUNDARY_KINDS = ("stable", "system")  # the marks the caller places; prefill's chunk grid restarts there


@dataclass
class Snapshot:
    position: int
    recurrent: dict[str, np.ndarray]  # the model's save_recurrent(): GDN + conv state, host memory
    hidden_last: np.ndarray | None  # post-norm hidden at position-1 (MTP warm-up); None at position 0
    kind: str  # "stable" | "system" | "checkpoint" | "disk"


@dataclass
class LiveSequence:
    """One slot: a model state, the tokens whose KV rows it holds, and its snapshots."""

    state: object  # the model's per-sequence state (reference SequenceState or the fast path's)
    tokens: list[int] = field(default_factory=list)
    snapshots: dict[int, Snapshot] = field(default_factory=dict)
    last_used: float = 0.0
    busy: bool = False

    def restorable(self, prompt: list[int]) -> int:
        """The longest position this slot can resume `prompt` from (0 = nothing)."""
        common = common_prefix(self.tokens, prompt)
        # At least one prompt token must be prefilled, to produce the next-token logits.
        limit = min(common, len(prompt) - 1)
        best = max((p for p in self.snapshots if p <= limit), default=0)
        if self.resumable_end() and self.state.position <= limit:
            best = max(best, self.state.position)  # continue the live state where it stands
        return best

    def resumable_end(self) -> bool:
        """The live state can continue from its own end (no snapshot needed)."""
        return (self.state.position > 0 and self.state.position == len(self.tokens)
                and self.state.hidden_last is not None)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


def take_snapshot(model, state, kind: str) -> Snapshot:
    hidden = state.hidden_last
    return Snapshot(state.position, model.save_recurrent(state),
                    None if hidden is None else np.array(hidden, dtype=np.float32, copy=True).reshape(-1), kind)


def restore_snapshot(model, seq: LiveSequence, snap: Snapshot) -> None:
    """Rewind seq to snap.position: cut KV rows, install the GDN state, forget what lay beyond.

    Snapshots past the restore point are dropped: the prefill that follows overwrites
    their KV rows, so they could never be used again (the alias rule).
    """
    model.rewind(seq.state, snap.position, snap.recurrent)
    seq.state.hidden_last = None if snap.hidden_last is None else snap.hidden_last.copy()
    del seq.tokens[snap.position:]
    seq.snapshots = {p: s for p, s in seq.snapshots.items() if p <= snap.position}


class PrefixCache:
    """The live sequences and their snapshots (host memory), plus the optional disk tier."""

    def __init__(self, model, max_sequences: int = 4, checkpoint_every: int = 4096,
                 max_snapshots: int = 16, disk: "DiskCache | None" = None, checkpoint_min_piece: int = 128):
        self.model = model
        self.max_sequences = max(1, max_sequences)
        self.checkpoint_every = checkpoint_every
        self.checkpoint_min_piece = checkpoint_min_piece  # EngineConfig.checkpoint_min_piece (0 = no snapping)
        self.max_snapshots = max_snapshots
        self.disk = disk
        self.slots: list[LiveSequence] = []
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0

    def acquire(self, prompt: list[int]) -> tuple[LiveSequence, int]:
        """A slot for `prompt`, rewound to the longest reusable prefix; returns (slot, reused tokens)."""
        best, best_pos = None, 0
        for seq in self.slots:
            if seq.busy:
                continue
            pos = seq.restorable(prompt)
            if pos > best_pos or best is None or (pos == best_pos and seq.last_used < best.last_used and best_pos == 0):
                best, best_pos = seq, pos
        if best_pos > 0:
            if not (best.resumable_end() and best_pos == best.state.position):
                restore_snapshot(self.model, best, best.snapshots[best_pos])
            seq = best
        else:
            seq = self._fresh_slot(best)
        if self.disk is not None:
            disk_pos = self.disk.lookup_length(prompt)
            if disk_pos > best_pos and disk_pos <= len(prompt) - 1:
                if self.disk.load_into(self.model, seq, prompt[:disk_pos]):
                    best_pos = disk_pos
                else:  # untouched, or started over when an entry did not fit the state
                    best_pos = seq.state.position
        seq.busy = True
        seq.last_used = time.monotonic()
        if best_pos:
            self.hits += 1
            self.reused_tokens += best_pos
        else:
            self.misses += 1
        return seq, best_pos

    def _fresh_slot(self, candidate: LiveSequence | None) -> LiveSequence:
        # an idle sequence holding nothing (reserved at load, or reset) first, then a new one, then the
        # least recently used idle one
        empty = next((s for s in self.slots if not s.busy and not s.tokens and s.state.position == 0), None)
        if empty is not None:
            self.model.reset_state(empty.state)  # cheap (no allocation), and whatever it held is gone
            empty.snapshots = {}
            return empty
        if len(self.slots) < self.max_sequences:
            seq = LiveSequence(self.model.new_state())
            self.slots.append(seq)
            return seq
        idle = [s for s in self.slots if not s.busy]
        victim = min(idle, key=lambda s: s.last_used) if idle else None
        if victim is None:
            return LiveSequence(self.model.new_state())  # every slot busy: a temporary one
        # its state reused in place: a new one would allocate (and zero) a whole KV cache inside this
        # request's time to first token (device run m5: 54-107 ms of a cold 25K turn)
        self.model.reset_state(victim.state)
        victim.tokens, victim.snapshots = [], {}
        return victim

    def reserve(self, n: int) -> None:
        """Allocate up to n idle sequences now (at load), so a first request's time to first token
        holds no state allocation, and a card too small for them fails at start, not mid-request."""
        while len(self.slots) < min(n, self.max_sequences):
            self.slots.append(LiveSequence(self.model.new_state()))

    def release(self, seq: LiveSequence, tokens: list[int], healthy: bool = True) -> None:
        """The request is over: `tokens` are what the state now holds (prompt + output committed)."""
        seq.busy = False
        seq.last_used = time.monotonic()
        if healthy and len(tokens) == seq.state.position:
            seq.tokens = list(tokens)
        else:  # state and tokens disagree (an error mid-forward): never resume from it
            seq.state = self.model.new_state()
            seq.tokens, seq.snapshots = [], {}

    def snapshot_positions(self, start: int, prompt: list[int], stable_len: int | None, system_len: int | None,
                           taken=(), chunk: int = 0) -> dict[int, str]:
        """Where, in the prefill of prompt[start:], to stop and save GDN state: position -> kind.

        The boundary marks ("system": the end of the shared system+tools block, "stable": the end
        of the last complete turn) sit exactly where the caller says. "checkpoint" marks sit on the
        grid of multiples of checkpoint_every, except that a grid point p closer than
        m = checkpoint_min_piece to another piece boundary -- the resume point `start`, the
        prompt's end, or a boundary mark -- would cut a piece shorter than m (on cuda such a piece
        misses the cuBLAS GEMM route and costs a host sync), so its snapshot is taken at the
        nearest of those boundaries instead (ties: the earlier one), still within m of p:
          - at `start`: the restored state itself, before the first forward (prefill_steps runs a
            break at its start position first); not at 0 (a fresh state needs no snapshot), nor
            where `taken` (the positions the sequence already holds snapshots at) has one;
          - at the prompt's end: the state after the last piece (unless a stable mark is there);
          - at a boundary mark: that mark's own snapshot serves; nothing is added;
          - at a chunk cut (chunk > 0: prefill_steps cuts every `chunk` tokens from `start`, the grid
            starting over at each boundary mark, decoder.chunk_cuts): the state after the piece that ends
            there (a mark on an existing cut adds no cut).
        m = 0 keeps every grid point. Grid points are checkpoint_every apart, so only a grid
        finer than m leaves pieces shorter than m between two checkpoints.
        """
        end = len(prompt)
        marks: dict[int, str] = {}
        if system_len and start < system_len < end:
            marks[system_len] = "system"
        if stable_len and start < stable_len <= end:
            marks[stable_len] = "stable"
        if self.checkpoint_every <= 0:
            return marks
        m = max(0, int(self.checkpoint_min_piece))
        cuts = chunk_cuts(start, end, chunk, marks) if chunk > 0 else ()  # prefill_steps' grid
        edges = sorted({start, end, *marks, *cuts})  # the boundaries a checkpoint may snap to
        first = (start // self.checkpoint_every + 1) * self.checkpoint_every
        for p in range(first, end, self.checkpoint_every):
            to = min(edges, key=lambda e: (abs(e - p), e))
            if abs(to - p) >= m:
                to = p  # far enough from every boundary: cut on the grid
            elif to == start and (start == 0 or start in taken):
                continue  # nothing to save at a fresh state, or the snapshot is already there
            marks.setdefault(to, "checkpoint")  # a boundary mark at `to` is that snapshot already
        return marks

    def save(self, seq: LiveSequence, kind: str) -> None:
        snap = take_snapshot(self.model, seq.state, kind)
        seq.snapshots[snap.position] = snap
        if len(seq.snapshots) > self.max_snapshots:
            # Keep boundaries; drop the oldest plain checkpoint first.
            order = sorted(seq.snapshots.values(), key=lambda s: (s.kind != "checkpoint", s.position))
            del seq.snapshots[order[0].position]
        if self.exports_mtp(kind):
            self.disk.store_async(self.model, seq)

    def exports_mtp(self, kind: str) -> bool:
        """Whether save(seq, kind) reads the state's MTP rows: the disk entry written for a boundary
        snapshot holds them (export_prefix); a live snapshot holds the GDN state and hidden_last only
        (the MTP KV, like attention KV, stays in the state and is cut back on restore)."""
        return self.disk is not None and kind in DISK_KINDS

    def usage(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "reused_tokens": self.reused_tokens,
                "live_sequences": len(self.slots), "max_sequences": self.max_sequences,
                "snapshots": sum(len(s.snapshots) for s in self.slots)}


# --------------------------------------------------------------------------- disk tier


def compat_hash(model_dir: Path, model_cfg, tier: str | None, state_format: str) -> str:
    """Identity of everything a stored state depends on: foreign entries hash differently."""
    h = hashlib.sha256()
    h.update(f"q27-prefix-v{FORMAT_VERSION}|tier={tier}|state={state_format}|".encode())
    h.update(json.dumps(model_cfg.to_hf_dict(), sort_keys=True).encode())
    source = Path(model_dir)  # a checkpoint directory or a repacked .q27 file
    for p in [source] if source.is_file() else sorted(source.glob("*.safetensors")):
        size = p.stat().st_size
        h.update(f"{p.name}:{size}|".encode())
        with open(p, "rb") as f:  # header + first and last MiB: changes with any retrain or repack
            h.update(f.read(1 << 20))
            f.seek(max(0, size - (1 << 20)))
            h.update(f.read(1 << 20))
    return h.hexdigest()[:32]


def _key(tokens: list[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype=np.int32).tobytes()).hexdigest()


def _identity(st: os.stat_result) -> tuple:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class DiskCache:
    """Persistent prefix entries: <key>.q27p files, atomic writes from a background thread, LRU by mtime."""

    def __init__(self, directory: Path, compat: str, max_bytes: int = 8 << 30, min_tokens: int = 256):
        self.dir = Path(directory)
        self.compat = compat
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.lengths: dict[int, int] = {}  # prefix length -> entries with that length
        self._refused: dict[str, tuple] = {}  # key -> identity of the file refused (re-read only if it changes)
        self._template: dict[str, tuple[str, tuple[int, ...]]] | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=4)
        self.hits = 0
        self.rejected = 0
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # the entries already there (if any) can still be read
            log.warning("prefix cache: cannot create %s (%s); new entries will not be written", self.dir, exc)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="q27-prefix-writer", daemon=True)
        self._writer.start()

    def _scan(self) -> None:
        """Index the entries' lengths from their headers; nothing here may block or raise."""
        try:
            names = sorted(os.listdir(self.dir))
        except OSError as exc:
            log.warning("prefix cache: cannot list %s (%s); starting with an empty disk tier", self.dir, exc)
            return
        for name in names:
            path = self.dir / name
            if name.endswith(".tmp"):  # a crash mid-write leaves these; never read them
                try:
                    path.unlink()
                except OSError as exc:
                    log.warning("prefix cache: cannot remove leftover %s (%s)", name, exc)
                continue
            if not name.endswith(".q27p"):
                continue
            try:
                n = prefix_entry.read_header(path, self.compat)
            except ForeignEntry:
                # another model, tier or format: never used, and said once at startup
                log.info("prefix cache: ignoring %s (written for another model or format)", name)
                continue
            except Exception as exc:  # damaged, unreadable, not a regular file: ignored, never fatal
                log.warning("prefix cache: ignoring %s (%s)", name, exc)
                continue
            self.lengths[n] = self.lengths.get(n, 0) + 1

    # ---- reading
    def lookup_length(self, prompt: list[int]) -> int:
        """Longest stored prefix length whose entry exists for this prompt (token-verified on load)."""
        for n in sorted(self.lengths, reverse=True):
            if n < len(prompt):
                key = _key(prompt[:n])
                try:
                    st = os.stat(self.dir / f"{key}.q27p")
                except OSError:
                    continue
                if self._refused.get(key) != _identity(st):
                    return n
        return 0

    def load_into(self, model, seq: LiveSequence, tokens: list[int]) -> bool:
        """Install the stored prefix `tokens` into seq; False (logged) if the entry cannot be used.

        The entry is verified whole before the state is touched; if it still does not fit
        the state, seq is started over (position 0) and the caller serves the request cold.
        """
        key = _key(tokens)
        path = self.dir / f"{key}.q27p"
        try:
            f, _ = open_regular(path, path.name)
            with f:
                ident = _identity(os.fstat(f.fileno()))
                if self._refused.get(key) == ident:
                    return False
                data = f.read()
            arrays = prefix_entry.decode(data, self.compat, path.name)
            stored = arrays.pop("tokens")
            # Never trust the key: the whole token vector must match.
            if not np.array_equal(stored, np.asarray(tokens, dtype=np.int32)):
                raise BlobFileError(f"{path.name}: token vector differs from the prompt prefix")
            hidden = arrays.pop("hidden_last", None)
            self._check_fits(model, seq, arrays, len(tokens), path.name)
        except (OSError, ValueError) as exc:  # BlobFileError is a ValueError
            self._refuse(key, path, exc)
            return False
        try:
            model.import_prefix(seq.state, arrays, len(tokens))
            seq.state.hidden_last = hidden
            seq.tokens = list(tokens)
            seq.snapshots = {len(tokens): take_snapshot(model, seq.state, "disk")}
        except Exception as exc:  # half-installed: start the slot over, serve cold
            seq.state = model.new_state()
            seq.tokens, seq.snapshots = [], {}
            self._refuse(key, path, f"does not fit the model state ({exc!r})")
            return False
        try:
            os.utime(path)  # LRU by mtime
        except OSError as exc:  # a read-only directory: the entry still serves; eviction order lags
            log.info("prefix cache: cannot touch %s (%s)", path.name, exc)
        self.hits += 1
        return True

    def _refuse(self, key: str, path: Path, why) -> None:
        self.rejected += 1
        log.warning("prefix cache: not using %s (%s)", path.name, why)
        try:
            self._refused[key] = _identity(os.stat(path))
        except OSError:
            self._refused.pop(key, None)

    def _check_fits(self, model, seq: LiveSequence, arrays: dict[str, np.ndarray], n: int, what: str) -> None:
        """Names, dtypes and shapes must be what this model exports (token axis: at most n rows).

        The template is what export_prefix gives for a state at position 0 (zero rows on the
        token axis, so taking it is cheap); until a position-0 state has been seen the
        check is left to import_prefix's own failure path."""
        if self._template is None and seq.state.position == 0:
            self._template = {k: (a.dtype.str, a.shape) for k, a in model.export_prefix(seq.state).items()}
        if self._template is None:
            return
        if set(arrays) != set(self._template):
            raise BlobFileError(f"{what}: arrays {sorted(set(arrays) ^ set(self._template))} do not match the model's")
        for name, a in arrays.items():
            dtype, shape = self._template[name]
            fits = a.dtype.str == dtype and a.ndim == len(shape) and all(
                d == t or (t == 0 and d <= n) for d, t in zip(a.shape, shape))
            if not fits:
                raise BlobFileError(f"{what}: array {name} is {a.dtype.str}{list(a.shape)}, the model's {dtype}{list(shape)}")

    # ---- writing
    def store_async(self, model, seq: LiveSequence) -> None:
        """Queue the sequence's current prefix for writing (copies taken now, written later)."""
        n = seq.state.position
        if n < self.min_tokens or len(seq.tokens) < n:
            return
        arrays = model.export_prefix(seq.state)
        hidden = seq.state.hidden_last
        if hidden is not None:
            arrays["hidden_last"] = np.asarray(hidden, dtype=np.float32).reshape(-1)
        arrays["tokens"] = np.asarray(seq.tokens[:n], dtype=np.int32)
        try:
            self._queue.put_nowait((n, arrays))
        except queue.Full:
            log.info("prefix cache: writer busy, skipping an entry of %d tokens", n)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until queued entries are on disk (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _write_loop(self) -> None:
        while True:
            n, arrays = self._queue.get()
            try:
                self._write(n, arrays)
            except Exception as exc:  # a full disk, a read-only directory: the entry is skipped
                log.warning("prefix cache: write failed (%s)", exc)
            finally:
                self._queue.task_done()

    def _write(self, n: int, arrays: dict[str, np.ndarray]) -> None:
        key = _key(arrays["tokens"].tolist())
        final = self.dir / f"{key}.q27p"
        if final.exists() and self._refused.get(key) is None:
            try:
                os.utime(final)
            except OSError:
                pass
            return
        data = prefix_entry.encode(self.compat, arrays)
        tmp = final.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._refused.pop(key, None)
        self.lengths[n] = self.lengths.get(n, 0) + 1
        self._evict()

    def _evict(self) -> None:
        files = []
        for p in self.dir.glob("*.q27p"):
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        files.sort()
        total = sum(size for _, size, _ in files)
        while files and total > self.max_bytes:
            _, size, victim = files.pop(0)
            total -= size
            try:
                victim.unlink()
            except OSError as exc:
                log.warning("prefix cache: cannot evict %s (%s)", victim.name, exc)
                continue
            log.info("prefix cache: evicted %s", victim.name)
