"""Constrained decoding on the CUDA fast path (issue 16): the same TokenPicker over the fast
model's logits. Outputs under a JSON-schema or tool-call constraint are valid, speculation keeps
them token-identical, and with a constraint the picker reads the logits rows (a constrained pick
never takes the device-argmax shortcut, whose row may be refused)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from q27py import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))


@pytest.fixture(scope="module")
def gpu_setup():
    from test_output_control import Setup

    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint

    s = Setup(DEFAULT_MODEL_DIR)
    s.model = FastModel(from_checkpoint(Checkpoint.open(DEFAULT_MODEL_DIR), "bf16", progress=False), max_context=1024,
                        kv_dtype="f32", chunk=64)
    s.model.enable_graphs()
    return s


@pytest.mark.parametrize("name", ["cc:Title", "cc:Bash", "codex:exec_command", None])
def test_fast_path_json_outputs_are_valid_and_spec_exact(gpu_setup, name):
    from test_output_control import finished, text_of
    from tool_schemas import CORPUS, valid

    from q27py.engine.api import SamplingParams
    from q27py.engine.grammar import json_grammar

    if name is not None and name not in CORPUS:
        pytest.skip(f"{name} not in the corpus")
    schema = CORPUS[name] if name else None
    g = json_grammar(schema)
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=4)):
        plain, _ = gpu_setup.run(g, "Answer in JSON:", 80, sampling, spec=False)
        spec, _ = gpu_setup.run(g, "Answer in JSON:", 80, sampling, spec=True)
        assert spec == plain
        text = text_of(gpu_setup, plain)
        assert finished(gpu_setup, plain), text
        value = json.loads(text)
        assert valid(value, schema) if schema else isinstance(value, dict), text


def test_fast_path_forced_tool_call(gpu_setup):
    from test_output_control import finished, text_of
    from tool_schemas import CORPUS, valid

    from q27py.chat.stream import parse_output
    from q27py.engine.api import SamplingParams
    from q27py.engine.grammar import tool_call_grammar

    tools = {"Bash": CORPUS["cc:Bash"], "Read": CORPUS["cc:Read"]}
    g = tool_call_grammar(tools)
    plain, _ = gpu_setup.run(g, "call a tool", 90, SamplingParams(), spec=False)
    spec, _ = gpu_setup.run(g, "call a tool", 90, SamplingParams(), spec=True)
    assert spec == plain
    text = text_of(gpu_setup, plain)
    assert finished(gpu_setup, plain) and g.matches(text.encode()), text
    calls = parse_output(text, tools).tool_calls
    assert calls and all(valid(c["arguments"], tools[c["name"]]) for c in calls)
