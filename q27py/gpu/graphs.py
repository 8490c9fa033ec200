"""CUDA graphs for the fixed-shape steps: decode, each verify width, each MTP draft width, commit.

A step is captured the second time its key is seen (the first run is eager, so every kernel
is compiled and has run once before capture) and replayed from then on. Graphs bake in
device pointers, so keys include the sequence state; everything that changes between
replays (token ids, positions, the accepted count) lives in small device buffers the host
rewrites before the launch, and the kernels read it from there.

Model-level steps (run_model: FastModel.decode_batch) hold no state pointer at all -- each lane's
state addresses are in the lane table the host writes before the launch -- so they are keyed by
shape alone (("batch", lanes, layer strides)) and one capture serves any set of states. They are
kept apart from the per-state graphs (never dropped with a state, not counted in bytes_by_state).
"""

from __future__ import annotations

from q27py.gpu.runtime import Runtime, pdl_mode


class GraphCache:
    """Captured CUDA graphs of the model's steps, per sequence state (run) and model-level (run_model).

    state_budget / model_budget: the device bytes the memory plan set aside for one state's graphs
    (forward.graph_bytes_per_state) and for the model-level ones (forward.batch_graph_bytes), or None (no
    limit: benches that size nothing). Why: the keys are open-ended (a state's verify widths, logits-row
    sets, MTP chain shapes), and the window and slots were sized assuming the graphs stay within what was
    reserved; a key first seen once its owner's graphs already hold their budget runs eagerly instead of
    being captured (same launches, same bits; counted in `over_budget`), so the graphs stay within their
    reserve plus at most one graph (~0.75 MiB on the 27B; the plan's safety margin holds that) and never take
    the memory the KV rows were promised. A capture that itself fails for memory is dropped the same way."""

    def __init__(self, model, capture_after: int = 1, state_budget: int | None = None,
                 model_budget: int | None = None, free_bytes=None):
        self.model = model
        self.capture_after = capture_after
        self.state_budget = state_budget
        self.model_budget = model_budget
        self.over_budget = 0  # steps run eagerly because their owner's graphs were at their budget
        self._free_bytes = free_bytes or _free_bytes  # a seam for the CPU tests (no device to ask)
        self.graphs: dict = {}
        self.seen: dict = {}
        self.captures = 0
        self.replays = 0
        # keys run eagerly because they were new (their first capture_after sightings): with captures, what a
        # timed window paid for shapes it had not seen before (the load bench reports both per run)
        self.first_runs = 0
        # device bytes each state's captures took (cudaMemGetInfo before and after instantiate +
        # upload): what EngineConfig.graph_bytes_per_state assumes, measured (the load bench reports it)
        self.bytes_by_state: dict[int, int] = {}
        # model-level graphs (run_model), their first-seen counts, and the device bytes they took
        self.model_graphs: dict = {}
        self.model_seen: dict = {}
        self.model_bytes = 0
        self.model_replays = 0

    def run(self, state, key, enqueue) -> None:
        """Run `enqueue` (which only launches kernels on model.stream) through a graph when possible."""
        full = (state.id,) + tuple(key)
        full_up = self.state_budget is not None and self.bytes_by_state.get(state.id, 0) >= self.state_budget
        took = self._run(self.graphs, self.seen, full, enqueue, at_budget=full_up)
        if took is not None:
            self.bytes_by_state[state.id] = self.bytes_by_state.get(state.id, 0) + took

    def run_model(self, key, enqueue) -> None:
        """run() for a step whose launches read no sequence state's pointers (they come from device
        buffers the host rewrites per call): one graph per key for every set of states."""
        full_up = self.model_budget is not None and self.model_bytes >= self.model_budget
        took = self._run(self.model_graphs, self.model_seen, tuple(key), enqueue, model=True, at_budget=full_up)
        if took is not None:
            self.model_bytes += took

    def _run(self, graphs: dict, seen: dict, full, enqueue, model: bool = False, at_budget: bool = False) -> int | None:
        """Eager the first capture_after times a key is seen, then captured and replayed; eager for good
        when the key is new and its owner's graphs are at their budget (at_budget), or when its capture
        runs out of device memory. Returns the device bytes a capture took (None when nothing was captured)."""
        g = graphs.get(full)
        took = None
        if g is None:
            n = seen.get(full, 0)
            seen[full] = n + 1
            if n < self.capture_after:
                self.first_runs += 1
                enqueue()
                return None
            if at_budget:
                self.over_budget += 1
                enqueue()
                return None
            free0 = self._free_bytes()
            try:
                g = self._capture(enqueue)
            except Exception as exc:  # noqa: BLE001 -- only an allocation failure is absorbed
                if not _out_of_memory(exc):
                    raise
                self.over_budget += 1
                enqueue()  # the captured launches never ran
                return None
            took = max(0, free0 - self._free_bytes())
            graphs[full] = g
            self.captures += 1
        g.launch(self.model.stream)
        self.replays += 1
        if model:
            self.model_replays += 1
        return took

    def _capture(self, enqueue):
        return capture(enqueue, self.model.stream)

    def drop_state(self, state) -> None:
        self.drop_id(state.id)

    def drop_id(self, state_id: int) -> None:
        """Release every graph captured for a sequence state (it was replaced or freed): graphs
        bake in that state's pointers and would otherwise be kept for the process lifetime."""
        for k in [k for k in self.graphs if k[0] == state_id]:
            del self.graphs[k]
        for k in [k for k in self.seen if k[0] == state_id]:
            del self.seen[k]
        self.bytes_by_state.pop(state_id, None)

    def largest_state(self) -> tuple[int | None, int | None]:
        """(the most device bytes any one state's graphs took, the most graphs any one state holds); None, None
        before any state captured (the load and replay benches report them)."""
        counts = self.graphs_per_state()
        return (max(self.bytes_by_state.values()) if self.bytes_by_state else None,
                max(counts.values()) if counts else None)

    def graphs_per_state(self) -> dict[int, int]:
        """Captured graphs held per state id."""
        out: dict[int, int] = {}
        for k in self.graphs:
            out[k[0]] = out.get(k[0], 0) + 1
        return out


def _out_of_memory(exc: BaseException) -> bool:
    """Whether a capture failed for device memory (CuPy's pool or the driver / runtime saying so)."""
    if type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return "out of memory" in text.lower() or "cudaErrorMemoryAllocation" in text or "CUDA_ERROR_OUT_OF_MEMORY" in text


def _free_bytes() -> int:
    """Free device memory (captures are rare: one driver call each side costs nothing per replay).
    The driver counts in pages (2 MiB), so one small graph may read 0; a state's sum is what counts."""
    return int(Runtime.get().cp.cuda.runtime.memGetInfo()[0])


def capture(fn, stream=None, pdl: bool | None = None):
    """Capture fn()'s launches on `stream` into a graph (the model's steps; benchmarks time replays
    of these). pdl: launch the kernels with programmatic dependent launch (None: EngineConfig.pdl,
    env Q27_PDL, is not "off"; ignored below sm_90)."""
    rt = Runtime.get()
    stream = stream or rt.cp.cuda.get_current_stream()
    use_pdl = pdl_mode() != "off" if pdl is None else pdl
    with stream, rt.pdl_capture(use_pdl):
        stream.begin_capture()
        try:
            fn()
        finally:
            graph = stream.end_capture()
    graph.upload(stream)
    return graph
