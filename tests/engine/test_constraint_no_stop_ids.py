"""A constrained request with no end ids (GenerationRequest.stop_ids empty, which the engine API
allows) ends cleanly when its document is complete.

The bug: CompiledConstraint.allowed adds the end ids to an accepting state's mask; with none
to add, a complete document followed by its trailing-whitespace allowance (MAX_WS bytes)
reaches a state that allows nothing, and the next pick took numpy's argmax of an empty
sequence (ValueError) in both decoders. Now TokenPicker.finished ends the run there
(finish_reason "stop", the document delivered), speculative lanes stop short of it
(TokenPicker.viable), and speculative output stays plain output, token for token.
"""

import json

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.config import Q27Config, SpecConfig
from q27py.engine.api import GenerationRequest, OutputConstraint, SamplingParams
from q27py.engine.constraint import CompiledConstraint, ConstraintRun, VocabIndex
from q27py.engine.decoder import DecodeStats, Decoder
from q27py.engine.engine import LocalEngine
from q27py.engine.grammar import MAX_WS, json_grammar
from q27py.engine.sampling import TokenPicker
from q27py.engine.spec import SpecDecoder
from q27py.model.reference import ReferenceModel
from q27py.model.tiny import make_tiny
from q27py.tokenizer import Tokenizer

# A schema the bundled model closes quickly ({"a": false}), so the trailing whitespace runs out
# well within the budget: the state past it allows nothing without an end id.
SHORT = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def bundled():
    return ReferenceModel.load(DEFAULT_MODEL_DIR), Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)


def _generate(parts, spec: bool, stop_ids):
    cfg = Q27Config()
    cfg.spec.enabled = spec
    engine = LocalEngine(cfg, *parts)
    tok = parts[1]
    request = GenerationRequest(prompt_ids=tok.encode("Answer in JSON:"), max_tokens=MAX_TOKENS,
                                sampling=SamplingParams(), stop_ids=frozenset(stop_ids),
                                constraint=OutputConstraint(kind="json_schema", schema=SHORT))
    chunks = list(engine.generate(request))
    return [t for c in chunks for t in c.token_ids], chunks[-1]


def test_engine_ends_a_complete_document_without_end_ids(bundled):
    plain, last = _generate(bundled, spec=False, stop_ids=())
    spec, spec_last = _generate(bundled, spec=True, stop_ids=())
    assert spec == plain  # the speculative decoder ends after the same token
    assert last.finish_reason == "stop" and spec_last.finish_reason == "stop"
    assert last.stats["generated_tokens"] == len(plain) < MAX_TOKENS  # ended by the document, not the budget
    text = bundled[1].decode(plain)
    assert json.loads(text) == {"a": False}, text
    # Ended exactly where nothing more could follow: the trailing whitespace allowance is used up.
    assert len(text) - len(text.rstrip()) == MAX_WS


def test_engine_with_end_ids_still_emits_one(bundled):
    # The usual request (the server's) is unchanged: the end id closes it.
    tok = bundled[1]
    out, last = _generate(bundled, spec=False, stop_ids=tok.eos_ids)
    assert last.finish_reason == "stop" and out[-1] in tok.eos_ids
    assert json.loads(tok.decode(out[:-1])) == {"a": False}


# --- the decoders directly, sampling on a random model -----------------------------------------

@pytest.fixture(scope="module")
def random_tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny") / "rand"
    make_tiny(d, vocab="first2048", seed=3)
    model, tok = ReferenceModel.load(d), Tokenizer.from_model_dir(d)
    return model, tok, CompiledConstraint(json_grammar(None), VocabIndex.from_tokenizer(tok, model.cfg.vocab_size))


def _run(setup, seed: int, spec: bool, max_tokens: int):
    model, tok, compiled = setup
    ids = tok.encode("Answer in JSON:")
    sampling = SamplingParams(temperature=1.0, seed=seed)
    picker = TokenPicker(sampling, ids, ConstraintRun(compiled, tok.token_bytes, frozenset()), max_tokens=max_tokens)
    dec = SpecDecoder(model, SpecConfig(max_verify_width=6, max_depth=3, suffix_min_match=2)) if spec else Decoder(model)
    out = []
    for chunk in dec.run(model.new_state(), ids, max_tokens, sampling, frozenset(), None, DecodeStats(), picker=picker):
        out.extend(chunk)
    return out, picker


def test_sampled_json_objects_without_end_ids_are_spec_exact(random_tiny):
    tok = random_tiny[1]
    ended = 0
    for seed in range(3):
        plain, picker = _run(random_tiny, seed, spec=False, max_tokens=120)
        spec, spec_picker = _run(random_tiny, seed, spec=True, max_tokens=120)
        assert spec == plain
        assert picker.finished == spec_picker.finished
        text = tok.decode(plain)
        if picker.finished:
            ended += 1
            assert isinstance(json.loads(text), dict), text
            assert len(plain) < 120
        else:
            assert len(plain) == 120 and json_grammar(None).viable(text.encode()), text
    assert ended  # the case the bug crashed on was reached


# --- TokenPicker on hand-made states ------------------------------------------------------------

def _picker(setup, text: str, stop_ids=frozenset(), max_tokens=None):
    """A greedy picker with the tokens of `text` committed (one token per byte: exact state control)."""
    model, tok, compiled = setup
    picker = TokenPicker(SamplingParams(), (), ConstraintRun(compiled, tok.token_bytes, stop_ids),
                         max_tokens=max_tokens)
    picker.commit(_byte_tokens(tok, text))
    return picker


def _byte_tokens(tok, text: str) -> list[int]:
    out = []
    for ch in text:
        ids = tok.encode(ch)
        assert len(ids) == 1 and tok.token_bytes(ids[0]) == ch.encode()
        out.extend(ids)
    return out


def test_finished_only_when_nothing_can_follow(random_tiny):
    tok = random_tiny[1]
    assert not _picker(random_tiny, "{}").finished  # trailing whitespace may still come
    assert not _picker(random_tiny, "{}" + " " * (MAX_WS - 1)).finished
    assert _picker(random_tiny, "{}" + " " * MAX_WS).finished
    # With an end id the same state allows it: the run ends by emitting it, as before.
    assert not _picker(random_tiny, "{}" + " " * MAX_WS, stop_ids=frozenset(tok.eos_ids)).finished


def test_viable_drafts_stop_short_of_the_end(random_tiny):
    tok = random_tiny[1]
    picker = _picker(random_tiny, "{}" + " " * (MAX_WS - 2))
    space = _byte_tokens(tok, " ")
    # The second space ends the output: it stays out of the drafts, so no verify lane sits past
    # the end (the lane before it chooses that space itself when the model agrees).
    assert picker.viable(space * 3) == space
    # A pick where nothing is allowed is a decoder bug: a clear error, not numpy's.
    done = _picker(random_tiny, "{}" + " " * MAX_WS)
    with pytest.raises(RuntimeError, match="allows no token"):
        done.pick(np.zeros(random_tiny[0].cfg.vocab_size, dtype=np.float32), 0)


def test_budget_rule_counts_an_end_id_only_when_there_is_one(random_tiny):
    """Two tokens left before `}` closes the object, and the row prefers a space: without an end
    id the space still fits (space, then `}` on the last token); with one, `}` comes now so the
    end id fits after it."""
    model, tok, _ = random_tiny
    prefix = '{"a":1'
    space, close = _byte_tokens(tok, " ")[0], _byte_tokens(tok, "}")[0]
    row = np.zeros(model.cfg.vocab_size, dtype=np.float32)
    row[space], row[close] = 2.0, 1.0
    budget = len(prefix) + 2
    free = _picker(random_tiny, prefix, max_tokens=budget)
    assert free.pick(row, 0) == space
    free.commit([space])
    assert free.pick(row, 1) == close
    ends = _picker(random_tiny, prefix, stop_ids=frozenset(tok.eos_ids), max_tokens=budget)
    assert ends.pick(row, 0) == close
