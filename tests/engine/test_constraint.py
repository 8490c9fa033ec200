"""Token masks from the vocabulary trie equal a brute-force check of every token, state by state."""

import random

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.engine.constraint import DEAD, CompiledConstraint, ConstraintRun, VocabIndex
from q27py.engine.grammar import json_grammar, tool_call_grammar
from q27py.tokenizer import Tokenizer
from tool_schemas import CORPUS, dumps_variants, instance
from test_grammar import render_call


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def vocab(tok):
    return VocabIndex.from_tokenizer(tok, tok.vocab_size + 40)  # model rows past the tokenizer: never allowed


def brute_force(c: CompiledConstraint, tok, sid, stops):
    out = []
    for t in range(c.vocab.vocab_size):
        if t in stops:
            if c.accepts(sid):
                out.append(t)
            continue
        if c.advance(sid, t, tok.token_bytes) != DEAD:
            out.append(t)
    return out


def states_along(c, tok, text):
    sid, seen = c.start, [c.start]
    for t in tok.encode(text):
        sid = c.advance(sid, t, tok.token_bytes)
        assert sid != DEAD, text
        seen.append(sid)
    return seen


@pytest.mark.parametrize("which", ["json", "xml"])
def test_trie_masks_equal_brute_force(tok, vocab, which):
    rng = random.Random(which)
    stops = frozenset(tok.eos_ids)
    if which == "json":
        schema = CORPUS["cc:ReportFindings"]
        c = CompiledConstraint(json_grammar(schema), vocab)
        texts = [dumps_variants(instance(rng, schema), rng) for _ in range(3)]
    else:
        tools = {"Bash": CORPUS["cc:Bash"], "Edit": CORPUS["cc:Edit"]}
        c = CompiledConstraint(tool_call_grammar(tools), vocab)
        texts = [render_call("Bash", {"command": 'grep -n "x" a.py </div>', "timeout": 5}),
                 render_call("Edit", {"file_path": "a", "old_string": "x\\y", "new_string": "<p>", "replace_all": True})]
    states = sorted({s for text in texts for s in states_along(c, tok, text)})
    assert len(states) > 20
    for sid in rng.sample(states, 12):
        got = np.flatnonzero(c.allowed(sid, stops).dense(c.vocab.vocab_size)).tolist()
        assert got == brute_force(c, tok, sid, stops), sid
    if which == "xml":
        special = tok.special_ids["<tool_call>"]
        assert special in c.allowed(c.start)  # the call opener as the model's own token
        assert tok.special_ids["<|im_start|>"] not in c.allowed(c.start)


def test_masks_are_cached_per_state(tok, vocab):
    c = CompiledConstraint(json_grammar(CORPUS["cc:Bash"]), vocab)
    text = '{"command": "' + "word " * 40 + '"}'
    for _ in range(2):
        for sid in states_along(c, tok, text):
            c.allowed(sid)
    assert c.stats["mask_hits"] > c.stats["mask_misses"]


def test_think_block_is_free_then_the_grammar_starts(tok, vocab):
    c = CompiledConstraint(json_grammar(None), vocab)
    run = ConstraintRun(c, tok.token_bytes, frozenset(tok.eos_ids), after_think=True)
    state = run.state
    assert run.allowed(state) is None
    for t in tok.encode("I think {not json here</think>\n\n{}"):
        assert run.permits(state, t)
        state = run.next_state(state, t)
        assert state is not None
    assert not isinstance(state, tuple) and c.accepts(state)
    assert all(t in run.allowed(state) for t in tok.eos_ids)
