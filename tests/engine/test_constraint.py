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


# -- the fast mask paths (issue 16: cold masks) -------------------------------------------------
# Each fast path (first-byte pruning, loop tables over the whole vocabulary, loop-state reuse
# below the root, the short-side TokenMask build) must give exactly the brute-force mask.

CODEX_SHELL = {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}},
                                                "workdir": {"type": "string"}, "timeout_ms": {"type": "integer"}},
               "required": ["command"]}


def _cases(rng):
    yield "json:Workflow", json_grammar(CORPUS["cc:Workflow"]), [
        dumps_variants(instance(rng, CORPUS["cc:Workflow"]), rng) for _ in range(2)]
    yield "json:update_goal", json_grammar(CORPUS["codex:update_goal"]), [
        '{"status": "active", "note": "a \\"quoted\\" \\u00e9 note\\n"}', '{"status":"blocked","note":null}']
    yield "json:any", json_grammar(None), ['{"a": [1, -2.5e3, true, null, {"b": "x"}], "c": {}}']
    tools = {"apply_patch": CORPUS["codex:apply_patch"], "shell": CODEX_SHELL,
             "exec_command": CORPUS["codex:exec_command"]}
    yield "xml:codex", tool_call_grammar(tools), [
        render_call("shell", {"command": ["bash", "-lc", "ls </dev/null"], "timeout_ms": 5}),
        render_call("apply_patch", {"input": "*** Begin Patch\n-<div>\n+</div>\n*** End Patch\n"})]
    yield "json_dialect", tool_call_grammar({"Read": CORPUS["cc:Read"]}, dialect="json"), [
        '<tool_call>\n{"name": "Read", "arguments": {"file_path": "/a b", "limit": 3}}\n</tool_call>']


@pytest.mark.parametrize("case", range(5))
def test_every_state_mask_equals_brute_force(tok, vocab, case):
    """All states along realistic outputs, for JSON schemas (nested arrays, anyOf, escapes, any
    JSON), Codex's tools as XML calls and the JSON call dialect."""
    rng = random.Random(case)
    name, grammar, texts = list(_cases(rng))[case]
    stops = frozenset(tok.eos_ids)
    c = CompiledConstraint(grammar, vocab)
    states = sorted({s for text in texts for s in states_along(c, tok, text)})
    for sid in states[:40] if len(states) > 40 else states:
        got = np.flatnonzero(c.allowed(sid, stops).dense(c.vocab.vocab_size)).tolist()
        assert got == brute_force(c, tok, sid, stops), (name, sid)


def test_first_bytes_cover_every_live_byte(tok, vocab):
    """first_bytes() may be a superset, never miss a byte: the walk only steps those."""
    rng = random.Random(7)
    for _, grammar, texts in _cases(rng):
        c = CompiledConstraint(grammar, vocab)
        for text in texts:
            sid = c.start
            for b in text.encode():
                live = {x for x in range(256) if c.step(sid, x) != DEAD}
                assert live <= c.first_bytes(sid), (grammar.key[:40], text)
                sid = c.step(sid, b)
                assert sid != DEAD


def test_loop_classes_map_states_to_themselves(tok, vocab):
    c = CompiledConstraint(tool_call_grammar({"Bash": CORPUS["cc:Bash"]}), vocab)
    j = CompiledConstraint(json_grammar(CORPUS["cc:Bash"]), vocab)
    found = 0
    for cc, text in ((c, render_call("Bash", {"command": "a <b> c"})), (j, '{"command": "a <b> c"}')):
        for sid in states_along(cc, tok, text):
            loop = cc._loop_class(sid)
            if loop is not None:
                found += 1
                assert all(cc.step(sid, b) == sid for b in loop)
    assert found >= 2


def test_loop_table_suffixes(vocab):
    """LoopTable: `good` marks exactly the tokens without an outside byte; each other token's
    suffix starts at its first outside byte."""
    from q27py.engine.grammar import common_loop_classes

    for loop in common_loop_classes():
        tab = vocab.loop_table(loop)
        for k in range(0, len(vocab), 997):
            t = vocab.toks[k]
            outside = [i for i, b in enumerate(t) if b not in loop]
            assert bool(tab.good[k]) == (not outside)
            if outside:
                j = int(np.flatnonzero(tab.bad_pos == k)[0])
                assert tab.suffixes.toks[tab.bad_suffix[j]] == t[outside[0]:]


def test_mask_build_paths_agree(tok, vocab, monkeypatch):
    """The short-side id lists and the dense fallback build the same TokenMask."""
    from q27py.engine import constraint as C

    text = '{"command": "ls -la", "timeout": 5}'
    c = CompiledConstraint(json_grammar(CORPUS["cc:Bash"]), vocab)
    stops = frozenset(tok.eos_ids)
    fast = [c.allowed(s, stops).dense(vocab.vocab_size) for s in states_along(c, tok, text)]
    monkeypatch.setattr(C, "SHORT_SIDE", 0)
    c2 = CompiledConstraint(json_grammar(CORPUS["cc:Bash"]), vocab)
    for s, want in zip(states_along(c2, tok, text), fast):
        assert np.array_equal(c2.allowed(s, stops).dense(vocab.vocab_size), want)


# -- device bitmask packing (cuda/sampling.cu top2_partial_masked reads this layout) ------------


def test_pack_bits_layout():
    from q27py.engine.constraint import pack_bits

    rng = np.random.default_rng(0)
    for n in (1, 31, 32, 33, 1000, 248320):
        keep = rng.random(n) < 0.3
        words = pack_bits(keep)
        assert words.dtype == np.uint32 and words.shape == ((n + 31) // 32,)
        i = np.arange(n)
        bits = (words[i >> 5] >> (i & 31).astype(np.uint32)) & 1  # the kernel's read
        assert np.array_equal(bits.astype(bool), keep)
        pad = np.arange(n, words.shape[0] * 32)
        assert not ((words[pad >> 5] >> (pad & 31).astype(np.uint32)) & 1).any()


def test_masked_argmax_is_the_host_masked_pick(tok, vocab):
    """The kernel's spec (masked_argmax over packed words) equals TokenMask.greedy -- the host
    constrained greedy pick -- for allow-list and refuse-list masks, ties included."""
    from q27py.engine.constraint import masked_argmax

    c = CompiledConstraint(tool_call_grammar({"Bash": CORPUS["cc:Bash"]}), vocab)
    sids = states_along(c, tok, render_call("Bash", {"command": "ls", "timeout": 5}))
    rng = np.random.default_rng(1)
    masks = [c.allowed(s, frozenset(tok.eos_ids)) for s in sids]
    assert any(m.allow for m in masks) and any(not m.allow for m in masks)
    for m in masks:
        for _ in range(3):
            x = rng.integers(-3, 3, vocab.vocab_size).astype(np.float32)  # many ties
            assert masked_argmax(x, m.packed(vocab.vocab_size)) == m.greedy(x)
