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
