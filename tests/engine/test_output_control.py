"""Constrained decoding, logprobs and penalties through both decoders on real forward passes.

- every finished output under a JSON-schema or tool-call constraint is valid (independent
  validator / the call parser), on random tiny checkpoints (the worst case: the model has no
  idea of JSON) and on the bundled trained model, with speculation on and off;
- speculative output == plain output under constraints and penalties, token for token;
- logprobs equal the log-softmax of the reference model's own logits at each position, and are
  the same with speculation on;
- penalize() equals a plain per-token reference implementation.
"""

import json
import random

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.chat.stream import parse_output
from q27py.config import SpecConfig
from q27py.engine.api import SamplingParams
from q27py.engine.constraint import CompiledConstraint, ConstraintRun, VocabIndex
from q27py.engine.decoder import DecodeStats, Decoder
from q27py.engine.grammar import json_grammar, tool_call_grammar
from q27py.engine.sampling import TokenPicker, penalize
from q27py.engine.spec import SpecDecoder
from q27py.model.reference import ReferenceModel
from q27py.model.tiny import make_tiny
from q27py.tokenizer import Tokenizer
from tool_schemas import CORPUS, generated_tool_schema, valid

SPEC = SpecConfig(max_verify_width=6, max_depth=3, suffix_min_match=2)


class Setup:
    def __init__(self, model_dir):
        self.model = ReferenceModel.load(model_dir)
        self.tok = Tokenizer.from_model_dir(model_dir)
        self.vocab = VocabIndex.from_tokenizer(self.tok, self.model.cfg.vocab_size)
        self.stops = frozenset(self.tok.eos_ids)
        self.compiled = {}

    def run(self, grammar, prompt, max_tokens, sampling, spec: bool, logprobs=None, after_think=False,
            device_masks=False, model=None):
        c = None
        if grammar is not None:
            c = self.compiled.get(grammar.key)
            if c is None:
                c = self.compiled[grammar.key] = CompiledConstraint(grammar, self.vocab)
        ids = self.tok.encode(prompt)
        run = ConstraintRun(c, self.tok.token_bytes, self.stops, after_think=after_think) if grammar else None
        picker = TokenPicker(sampling, ids, run, logprobs, max_tokens=max_tokens, device_masks=device_masks)
        model = model or self.model
        dec = SpecDecoder(model, SPEC) if spec else Decoder(model)
        out = []
        for chunk in dec.run(model.new_state(), ids, max_tokens, sampling, self.stops, None, DecodeStats(),
                             picker=picker):
            out.extend(chunk)
        return out, picker


@pytest.fixture(scope="module")
def random_tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "rand"
    make_tiny(d, vocab="first2048", seed=3)
    return Setup(d)


@pytest.fixture(scope="module")
def bundled():
    return Setup(DEFAULT_MODEL_DIR)


def finished(setup, out):
    return bool(out) and out[-1] in setup.stops


def text_of(setup, out):
    return setup.tok.decode([t for t in out if t not in setup.stops])


GENERATED = {f"gen{i}": generated_tool_schema(random.Random(100 + i)) for i in range(4)}
JSON_CASES = sorted(CORPUS) + sorted(GENERATED) + [None]  # every corpus schema, generated ones, any object
SEEDS = 2


@pytest.mark.parametrize("name", JSON_CASES)
def test_random_model_json_outputs_are_valid_and_spec_exact(random_tiny, name):
    schema = {**CORPUS, **GENERATED}[name] if name else None
    g = json_grammar(schema)
    done = 0
    for seed in range(SEEDS):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        plain, _ = random_tiny.run(g, "Answer in JSON:", 80, sampling, spec=False)
        spec, _ = random_tiny.run(g, "Answer in JSON:", 80, sampling, spec=True)
        assert spec == plain
        text = text_of(random_tiny, plain)
        if finished(random_tiny, plain):
            done += 1
            value = json.loads(text)
            assert valid(value, schema) if schema else isinstance(value, dict), text
        else:
            assert g.viable(text.encode()), text  # cut by max_tokens: still a prefix of a valid document
    # The budget rule (TokenPicker: close along a shortest completion when the budget binds)
    # finishes every document within max_tokens, even on a random model.
    assert done == SEEDS


def test_random_model_tool_calls_are_valid_and_spec_exact(random_tiny):
    rng = random.Random(5)
    tools = {k.split(":", 1)[1]: v for k, v in CORPUS.items()}  # every client tool of the corpus at once
    tools.update({"gen": {"type": "object", "properties": {"n": {"type": "integer"}, "on": {"type": "boolean"},
                                                            "mode": {"enum": ["a", "b"]}}, "required": ["n"]},
                  "gen2": generated_tool_schema(rng)})
    for names in (None, ["gen"], ["ReportFindings"]):
        g = tool_call_grammar(tools, names)
        for seed in range(3):
            sampling = SamplingParams(temperature=1.0, seed=seed)
            plain, _ = random_tiny.run(g, "call a tool", 90, sampling, spec=False)
            spec, _ = random_tiny.run(g, "call a tool", 90, sampling, spec=True)
            assert spec == plain
            text = text_of(random_tiny, plain)
            assert finished(random_tiny, plain), text
            if finished(random_tiny, plain):
                assert g.matches(text.encode())
                calls = parse_output(text, tools).tool_calls
                assert calls and all(c["name"] in (names or tools) for c in calls)
                for c in calls:
                    assert valid(c["arguments"], tools[c["name"]]), c
            else:
                assert g.viable(text.encode()), text


def test_bundled_model_calls_a_tool_greedily(bundled):
    tools = {"Bash": CORPUS["cc:Bash"], "Read": CORPUS["cc:Read"]}
    prompt = ("<|im_start|>system\n# Tools\n\n<tools>\n" + "\n".join(json.dumps({"name": n, "parameters": s}) for n, s in tools.items())
              + "\n</tools><|im_end|>\n<|im_start|>user\nList the files here.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    g = tool_call_grammar(tools)
    plain, _ = bundled.run(g, prompt, 60, SamplingParams(), spec=False)
    spec, _ = bundled.run(g, prompt, 60, SamplingParams(), spec=True)
    assert spec == plain
    text = text_of(bundled, plain)
    assert g.viable(text.encode()) and text.lstrip().startswith("<tool_call>")
    if finished(bundled, plain):
        calls = parse_output(text, tools).tool_calls
        assert calls and valid(calls[0]["arguments"], tools[calls[0]["name"]])


def test_bundled_model_json_title_after_free_thinking(bundled):
    schema = CORPUS["cc:Title"]
    g = json_grammar(schema)
    prompt = "<|im_start|>user\nGive this chat a title as JSON.<|im_end|>\n<|im_start|>assistant\n<think>\n"
    out, _ = bundled.run(g, prompt, 70, SamplingParams(temperature=0.7, seed=1), spec=True, after_think=True)
    plain, _ = bundled.run(g, prompt, 70, SamplingParams(temperature=0.7, seed=1), spec=False, after_think=True)
    assert out == plain
    text = text_of(bundled, out)
    if "</think>" in text:
        answer = text.split("</think>", 1)[1]
        assert g.viable(answer.encode())
        if finished(bundled, out):
            assert valid(json.loads(answer), schema)


# --- logprobs ---------------------------------------------------------------------------

def test_logprobs_are_the_reference_models_and_spec_exact(bundled):
    prompt = "def fib(n):\n    "
    sampling = SamplingParams(temperature=0.8, seed=2)
    out, picker = bundled.run(None, prompt, 14, sampling, spec=False, logprobs=3)
    out2, picker2 = bundled.run(None, prompt, 14, sampling, spec=True, logprobs=3)
    assert out == out2
    assert [(r.token, r.logprob, r.top) for r in picker.logprobs] == [(r.token, r.logprob, r.top) for r in picker2.logprobs]
    # Recompute independently: one forward over prompt + output, log-softmax per row.
    ids = bundled.tok.encode(prompt)
    state = bundled.model.new_state()
    rows = []
    for t in ids + out[:-1]:
        rows.append(np.asarray(bundled.model.forward(state, [t]).logits[-1], dtype=np.float64))
    rows = rows[len(ids) - 1:]
    assert len(rows) == len(out) == len(picker.logprobs)
    for row, tok, rec in zip(rows, out, picker.logprobs):
        lp = row - row.max() - np.log(np.exp(row - row.max()).sum())
        assert rec.token == tok
        assert rec.logprob == pytest.approx(lp[tok], abs=1e-9)
        assert [i for i, _ in rec.top] == list(np.argsort(-lp, kind="stable")[:3])


# --- penalties --------------------------------------------------------------------------

def reference_penalties(logits, params, prompt, output):
    """Token by token, the textbook definitions."""
    x = [float(v) for v in logits]
    seen = set(prompt) | set(output)
    for t in seen:
        if params.repetition_penalty != 1.0:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return np.asarray(x, dtype=np.float32)


def test_penalize_matches_the_reference_definition():
    rng = np.random.default_rng(0)
    for k in range(20):
        params = SamplingParams(repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])),
                                presence_penalty=float(rng.uniform(-1, 1)), frequency_penalty=float(rng.uniform(-1, 1)))
        logits = rng.normal(0, 3, 64).astype(np.float32)
        prompt = rng.integers(0, 64, 10).tolist()
        output = rng.integers(0, 64, 15).tolist()
        counts = {t: output.count(t) for t in set(output)}
        got = penalize(logits, params, counts, set(prompt) | set(output) if params.repetition_penalty != 1.0 else set())
        np.testing.assert_allclose(got, reference_penalties(logits, params, prompt, output), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("sampling", [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(frequency_penalty=0.8, presence_penalty=0.5),
    SamplingParams(temperature=0.9, seed=4, frequency_penalty=0.5, repetition_penalty=1.1),
])
def test_speculation_stays_exact_under_penalties(bundled, sampling):
    prompt = "x = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2"
    plain, _ = bundled.run(None, prompt, 24, sampling, spec=False)
    spec, _ = bundled.run(None, prompt, 24, sampling, spec=True)
    unpenalized, _ = bundled.run(None, prompt, 24, SamplingParams(temperature=sampling.temperature, seed=sampling.seed),
                                 spec=False)
    assert spec == plain
    assert plain != unpenalized  # the penalties did change the output


# -- device-masked picks (EngineConfig.device_masks), with the device emulated in numpy ----------


class _DeviceLikeOutput:
    """A reference forward output with the fast path's device picks, computed by the kernels' numpy
    spec (engine.constraint.masked_argmax); every read of the logits rows is counted."""

    def __init__(self, out, log):
        self._out, self._log = out, log

    def __getattr__(self, name):
        return getattr(self._out, name)

    @property
    def logits(self):
        self._log["logits_reads"] += 1
        return self._out.logits

    def greedy_ids(self):
        return np.argmax(self._out.logits, axis=1)

    def masked_greedy_ids(self, picks, words):
        from q27py.engine.constraint import masked_argmax

        self._log["masked_launches"] += 1
        return np.asarray([masked_argmax(self._out.logits[p], w) for p, w in zip(picks, words)])


class _DeviceLikeModel:
    def __init__(self, model):
        self._model = model
        self.log = {"logits_reads": 0, "masked_launches": 0}

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, *args, **kwargs):
        return _DeviceLikeOutput(self._model.forward(*args, **kwargs), self.log)


@pytest.mark.parametrize("spec", [False, True])
def test_device_masked_picks_equal_host_picks(bundled, spec):
    """With device_masks on, a constrained greedy decode picks through masked_greedy_ids (one
    launch per verify round: TokenPicker.prefetch) and reads no forward's logits rows, and its tokens are
    the host path's, for a JSON schema, a forced tool call and a tight token budget (the closing
    rule picks through a second mask)."""
    tools = {"Bash": CORPUS["cc:Bash"], "Read": CORPUS["cc:Read"]}
    for grammar, budget in ((json_grammar(CORPUS["cc:Bash"]), 40), (tool_call_grammar(tools), 60),
                            (json_grammar(CORPUS["cc:Title"]), 9)):
        host, _ = bundled.run(grammar, "Answer:", budget, SamplingParams(), spec=spec)
        fake = _DeviceLikeModel(bundled.model)
        dev, _ = bundled.run(grammar, "Answer:", budget, SamplingParams(), spec=spec, device_masks=True, model=fake)
        assert dev == host
        assert fake.log["masked_launches"] > 0
        # (one read: the prefill's last row, which the decoders' first pick takes on the host)
        assert fake.log["logits_reads"] <= 1, "a device-masked pick read a logits row"


def test_device_masks_leave_other_picks_on_the_host(bundled):
    """Penalties and logprobs need the row: those picks keep the host path (device_maskable False)."""
    g = json_grammar(CORPUS["cc:Title"])
    for sampling, logprobs in ((SamplingParams(frequency_penalty=0.5), None), (SamplingParams(), 2),
                               (SamplingParams(temperature=0.8, seed=1), None)):
        host, _ = bundled.run(g, "Answer:", 12, sampling, spec=True, logprobs=logprobs)
        fake = _DeviceLikeModel(bundled.model)
        dev, _ = bundled.run(g, "Answer:", 12, sampling, spec=True, logprobs=logprobs, device_masks=True, model=fake)
        assert dev == host and fake.log["masked_launches"] == 0
