"""model/interface.py: every forward model the engine drives carries the whole interface, and the
engine reads it unguarded (no getattr / hasattr probing of the model, no per-sequence side dict)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.model.interface import ATTRIBUTES, METHODS, ForwardModel

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind", ["reference", "fastcpu"])
def test_cpu_models_carry_the_interface(kind):
    from q27py.model.fastcpu import FastCPUModel
    from q27py.model.reference import ReferenceModel

    model = (ReferenceModel if kind == "reference" else FastCPUModel).load(DEFAULT_MODEL_DIR)
    for name in ATTRIBUTES:
        assert hasattr(model, name), name
    for name in METHODS:
        assert callable(getattr(model, name)), name
    assert model.drafts_on_device is False and model.chunk is None and model.max_batch > 0
    st = model.new_state()
    assert st.hidden_last is None and st.suffix_index is None


def test_fast_model_carries_the_interface():
    """Without a GPU: the class has every method, and its constructor sets every attribute it does not
    define at class level (read from the source, as FastModel cannot be built here)."""
    from q27py.gpu.forward import FastModel, FastState

    for name in METHODS + ("mtp_draft_chain",):
        assert callable(getattr(FastModel, name)), name
    assert FastModel.drafts_on_device is True
    init = inspect.getsource(FastModel.__init__)
    for name in ATTRIBUTES:
        if not hasattr(FastModel, name):
            assert re.search(rf"self\.{name}\s*(:[^=]+)?=", init), name
    state_init = inspect.getsource(FastState)
    assert "self.hidden_last" in state_init and "self.suffix_index" in state_init


def test_protocol_lists_match():
    declared = set(ForwardModel.__annotations__)
    assert declared == set(ATTRIBUTES)
    for name in METHODS + ("mtp_draft_chain",):
        assert callable(getattr(ForwardModel, name)), name


def test_engine_never_probes_the_model():
    probe = re.compile(r"(getattr|hasattr)\((self\.)?model\b|\.extra\[|\.extra\.get\(")
    bad = []
    for path in sorted((ROOT / "q27py" / "engine").glob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if probe.search(line):
                bad.append(f"{path.name}:{n}: {line.strip()}")
    assert not bad, bad
