"""The canonical gate runner (gates/run.py) on the bundled model: repeatable to the bit, and
equal to the recorded canonical for this GPU arch when one is recorded."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

GATES_DIR = Path(__file__).resolve().parents[2] / "gates"


def load_runner():
    spec = importlib.util.spec_from_file_location("gate_runner", GATES_DIR / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_gate_repeatable_and_canonical():
    from q27py.gpu.runtime import Runtime

    run = load_runner()
    gate = next(g for g in run.GATES if g["name"] == f"{run.BUNDLED}/bf16")
    first = run.greedy_ids(gate)
    assert len(first) == run.TOKENS
    assert run.greedy_ids(gate) == first
    canon = json.loads((GATES_DIR / "canonical.json").read_text())
    want = canon.get(f"{gate['name']}@{Runtime.get().arch}", {}).get("md5")
    if want is not None:
        assert run.md5_of(first) == want
