"""`q27py bench`: the CLI selects what its help promises (issue 13 item 10)."""

import argparse
import json
import subprocess
import sys

from q27py.commands import bench


def _args(*argv):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_no_suite_runs_the_random_weights_bench(monkeypatch):
    """The help calls the random-weights bench the default: `q27py bench` with no suite runs it."""
    import q27py.bench.random_weights as rw

    made = []

    class FakeBench:
        def __init__(self, tier, seed, log):
            made.append((tier, seed))
            self.verify = lambda ctx=2048, widths=(1,): None

        def run(self, **kw):
            return {"ran": True, **{k: list(v) for k, v in kw.items()}}

    monkeypatch.setattr(rw, "Bench", FakeBench)
    assert bench.run(_args("--quick")) == 0
    assert made == [("q4s", 0)]
    assert bench.suite(_args()) == "random-weights"


def test_shortbench_honours_device_cpu():
    proc = subprocess.run([sys.executable, "-m", "q27py", "bench", "shortbench", "--device", "cpu", "--tokens", "3",
                           "--json"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [r["prompt"] for r in out["prompts"]] == ["code", "prose", "explain", "math", "list"]
    assert all(r["generated"] == 3 for r in out["prompts"])


def test_load_traces_drive_the_draft_widths_unless_asked_not_to(monkeypatch):
    """`bench load --random-weights 27b --traces ...` gives the engine's decoder the records' draft widths
    (bench/trace_accept.py TracePlanner); `--engine-draft-widths` leaves its own planner (acceptance forced
    alone). The 27B model is stood in for by the bundled CPU model: only the wiring is under test."""
    import types

    import q27py.bench.load as load_bench
    import q27py.gpu.forward as gpu_forward
    import q27py.gpu.weights as gpu_weights
    from q27py import DEFAULT_MODEL_DIR
    from q27py.bench.spec_replay import TRACES
    from q27py.bench.trace_accept import TraceAcceptance
    from q27py.model.fastcpu import FastCPUModel

    cpu = FastCPUModel.load(DEFAULT_MODEL_DIR)

    def fake_fast_model(weights, **kw):
        cpu.enable_graphs = lambda **budgets: None
        cpu.rt = types.SimpleNamespace(warm_all=lambda: None)
        return cpu

    seen = []
    monkeypatch.setattr(gpu_weights, "random_weights", lambda *a: None)
    monkeypatch.setattr(gpu_forward, "FastModel", fake_fast_model)
    monkeypatch.setattr(gpu_forward, "configure_memory", lambda model, cfg: None)
    monkeypatch.setattr(gpu_forward, "graph_budgets", lambda model, cfg: {})
    monkeypatch.setattr(load_bench, "run_load", lambda engine, *a, **kw: seen.append(engine) or {})
    base = ("load", "--random-weights", "27b", "--no-mixed", "--max-slots", "1", "--traces", str(TRACES))
    bench._load(_args(*base), print)
    bench._load(_args(*base, "--engine-draft-widths"), print)
    driven, own = seen
    assert isinstance(driven.model, TraceAcceptance) and driven.model.recorded_widths
    assert driven.decoder.planner_factory == driven.model.planner
    assert isinstance(own.model, TraceAcceptance) and not own.model.recorded_widths
    assert own.decoder.planner_factory is None
