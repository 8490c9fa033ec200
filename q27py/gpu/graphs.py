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
    def __init__(self, model, capture_after: int = 1):
        self.model = model
        self.capture_after = capture_after
        self.graphs: dict = {}
        self.seen: dict = {}
        self.captures = 0
        self.replays = 0
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
        took = self._run(self.graphs, self.seen, full, enqueue)
        if took is not None:
            self.bytes_by_state[state.id] = self.bytes_by_state.get(state.id, 0) + took

    def run_model(self, key, enqueue) -> None:
        """run() for a step whose launches read no sequence state's pointers (they come from device
        buffers the host rewrites per call): one graph per key for every set of states."""
        took = self._run(self.model_graphs, self.model_seen, tuple(key), enqueue, model=True)
        if took is not None:
            self.model_bytes += took

    def _run(self, graphs: dict, seen: dict, full, enqueue, model: bool = False) -> int | None:
        """Eager the first capture_after times a key is seen, then captured and replayed. Returns the
        device bytes a capture took (None when nothing was captured)."""
        g = graphs.get(full)
        took = None
        if g is None:
            n = seen.get(full, 0)
            seen[full] = n + 1
            if n < self.capture_after:
                enqueue()
                return None
            free0 = _free_bytes()
            g = self._capture(enqueue)
            took = max(0, free0 - _free_bytes())
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

    def graphs_per_state(self) -> dict[int, int]:
        """Captured graphs held per state id."""
        out: dict[int, int] = {}
        for k in self.graphs:
            out[k[0]] = out.get(k[0], 0) + 1
        return out


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
