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


# -- masks composed from frame masks (issue 16: cold masks under 0.3 ms per step) --------------
# A stack topped by a leaf frame takes that frame's mask (shared by every stack it tops, and by
# every grammar on the vocabulary) plus the tokens that leave it mid-token and that the stack
# below reads. Each piece must give exactly the brute-force mask, and the old whole-trie walk
# (frames=False) stays as a second, independent check.

def _many_string_params():
    # Several string parameters in several tools: every value is the same raw-text frame under a
    # different stack (other parameters used, another call count, another tool).
    S = {"type": "string"}
    return {"A": {"type": "object", "properties": {"x": S, "yy": S, "n": {"type": "integer"}}, "required": ["x"]},
            "B": {"type": "object", "properties": {"p": S, "q": S, "flag": {"type": "boolean"}}, "required": []}}


def test_shared_frame_masks_equal_brute_force(tok, vocab):
    tools = _many_string_params()
    c = CompiledConstraint(tool_call_grammar(tools), vocab)
    c.precompute()
    stops = frozenset(tok.eos_ids)
    text = "\n".join([render_call("A", {"x": "a </b> c", "yy": 'say "hi"\\n', "n": 42}),
                      render_call("B", {"q": "</parameter", "p": "x<", "flag": False}),
                      render_call("A", {"x": "</function", "n": -3})])
    sids = states_along(c, tok, text)
    # The same top frame under different stacks: the raw-text body of five values, one mask.
    raw_tops = {c._sets[s] for s in sids if all(type(st[-1][0]).__name__ == "RawText" and st[-1][1] == b""
                                                  for st in c._sets[s])}
    assert len(raw_tops) >= 5
    raw_keys = [k for k in vocab.frames if k[0][0] == "RawText" and k[1] == b""]
    assert len(raw_keys) == 1
    for sid in sorted(set(sids)):
        got = np.flatnonzero(c.allowed(sid, stops).dense(vocab.vocab_size)).tolist()
        assert got == brute_force(c, tok, sid, stops), sid


@pytest.mark.parametrize("case", range(5))
def test_frame_masks_equal_the_plain_walk(tok, vocab, case):
    """frames=True (composed) and frames=False (a whole-trie walk per state) give the same mask in
    every state along the outputs of every case (cheaper than brute force, so all states)."""
    rng = random.Random(100 + case)
    name, grammar, texts = list(_cases(rng))[case]
    stops = frozenset(tok.eos_ids)
    fast = CompiledConstraint(grammar, vocab)
    plain = CompiledConstraint(grammar, vocab, frames=False)
    for text in texts:
        for a, b in zip(states_along(fast, tok, text), states_along(plain, tok, text)):
            assert np.array_equal(fast.allowed(a, stops).dense(vocab.vocab_size),
                                  plain.allowed(b, stops).dense(vocab.vocab_size)), name


def test_frame_mask_exits_are_exact(tok, vocab):
    """A leaf frame's mask: `inside` is the lone frame's brute-force mask; the listed exits are
    exactly the (token, remainder) pairs where the lone frame may be finished before the token's
    last byte, for tokens the lone frame does not keep."""
    from q27py.engine.grammar import PARAM_CLOSE, FUNC_CLOSE, Num, RawText, Str

    c = CompiledConstraint(json_grammar(None), vocab)
    for node, local in ((Str(), 1), (Str(), 2), (RawText(PARAM_CLOSE, (FUNC_CLOSE,)), b"</parameter"),
                        (Num(False), 3), (Num(True), 0)):
        fm = c._frame(node, node.signature(), local)
        lone = c._intern(frozenset([((node, local),)]))
        inside = fm.inside.bool(len(vocab))
        want_exits = set()
        for p, t in enumerate(vocab.toks):
            kept = c.step_bytes(lone, t) != DEAD
            assert bool(inside[p]) == kept, (node.signature(), local, t)
            if kept:
                continue
            s = lone
            for j in range(len(t) - 1):
                s = c.step(s, t[j])
                if s == DEAD:
                    break
                if c.accepts(s):
                    want_exits.add((p, t[j + 1:]))
        got = set() if fm.rems is None else {(int(p), fm.rems.toks[int(r)]) for p, r in zip(fm.ex_pos, fm.ex_rem)}
        assert got == want_exits, (node.signature(), local)
    assert any(c._frame(n, n.signature(), 1).rems is not None for n in (Str(),))  # string closers do leave


def test_expand_is_the_byte_independent_step():
    """Node.expand(local) must equal step(local, b) for every byte b where it is not None (the
    mask code pushes those frames ahead of the byte)."""
    rng = random.Random(3)
    grammars = [g for _, g, _ in _cases(rng)] + [tool_call_grammar(_many_string_params())]
    checked = 0
    for g in grammars:
        seen, todo = set(), [g.root]
        while todo:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            locals_ = {node.init}  # and the locals one byte away
            for b in range(256):
                for act in node.step(node.init, b):
                    if act[0] == 0:  # CONT
                        locals_.add(act[1])
            for lo in locals_:
                exp = node.expand(lo)
                if exp is not None:
                    checked += 1
                    for b in range(256):
                        assert node.step(lo, b) == exp, (type(node).__name__, lo, b)
            for value in vars(node).values():
                items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
                for it in items:
                    if isinstance(it, tuple) and len(it) == 2:
                        it = it[1]
                    if hasattr(it, "step") and hasattr(it, "init"):
                        todo.append(it)
    assert checked >= 10
    # XmlParams / XmlCalls expand only their byte-independent phases (a value or a call about to start).
    from q27py.engine.grammar import XmlParams

    xp = XmlParams(["k"], [json_grammar(None).root], [])
    assert xp.expand((0, 0, b"")) is None and xp.expand((3, 1, 0)) == xp.step((3, 1, 0), 65)


def test_frames_many_exits_fall_back_to_the_walk(tok, monkeypatch):
    """A frame that too many tokens leave is walked per stack (FRAME_EXITS_MAX): with the bound at
    0 every leaf frame takes that path, loop frames included, and masks stay exact."""
    from q27py.engine import constraint as C

    monkeypatch.setattr(C, "FRAME_EXITS_MAX", 0)
    fresh = VocabIndex.from_tokenizer(tok, tok.vocab_size, warm=False)
    c = CompiledConstraint(json_grammar(CORPUS["cc:Bash"]), fresh)
    stops = frozenset(tok.eos_ids)
    sids = states_along(c, tok, '{"command": "ls \\"a b\\"", "timeout": 5, "run_in_background": true}')
    for sid in sorted(set(sids)):
        got = np.flatnonzero(c.allowed(sid, stops).dense(fresh.vocab_size)).tolist()
        assert got == brute_force(c, tok, sid, stops), sid
    assert any(fm.inside is None for fm in fresh.frames.values())


def test_compile_precomputes_the_start_and_the_grammar_leaves(tok, vocab):
    """ConstraintCache.get compiles a new grammar before decoding: its leaves' frame masks (an
    enum's values here) and the start state's mask parts are ready before the first step."""
    from q27py.engine.constraint import ConstraintCache

    cache = ConstraintCache(lambda: vocab)
    schema = {"type": "object", "properties": {"mode": {"enum": ["alpha-mode", "beta-mode"]}}, "required": ["mode"]}
    c = cache.get(json_grammar(schema))
    assert c.start in c._sid_parts
    assert any(k[0][0] == "LitSet" and b'"alpha-mode"' in k[0][1] for k in vocab.frames)
    assert c.compile_s > 0
    assert cache.get(json_grammar(schema)) is c  # compiled once per grammar
    stops = frozenset(tok.eos_ids)
    for sid in states_along(c, tok, '{"mode": "beta-mode"}'):
        got = np.flatnonzero(c.allowed(sid, stops).dense(vocab.vocab_size)).tolist()
        assert got == brute_force(c, tok, sid, stops)


def test_ws_run_contract():
    """Node.ws_run: a whitespace byte takes the frame to count + 1 (refused at the bound), every
    other byte acts as at count 0, and can_end does not depend on the count."""
    from q27py.engine.grammar import MAX_WS, WS, Arr, ObjectNode, Ws, any_value

    obj = ObjectNode([("a", any_value(1)), ("b", Arr(any_value(1)))], ["a"], None)
    arr = Arr(any_value(1), 1, 3)
    checked = 0
    for node, locals_ in ((obj, [(1, 0, n) for n in range(MAX_WS + 1)] + [(6, 1, n) for n in (0, 5, MAX_WS)]
                           + [(7, 1, 3), (4, 2, (1, 4)), (5, 0, (0, MAX_WS)), (5, 1, (1, 2))]),
                          (arr, [(p, c, w) for p in (1, 2, 3) for c in (0, 1, 3) for w in (0, 7, MAX_WS)]),
                          (Ws(), list(range(MAX_WS + 1)))):
        for local in locals_:
            run = node.ws_run(local)
            assert run is not None, (type(node).__name__, local)
            count, bound, local0 = run
            assert node.can_end(local) == node.can_end(local0)
            for b in range(256):
                got = node.step(local, b)
                if b in WS:
                    if count < bound:
                        assert len(got) == 1 and got[0][0] == 0 and node.ws_run(got[0][1])[::2] == (count + 1, local0)
                    else:
                        assert got == []
                else:
                    assert got == node.step(local0, b), (type(node).__name__, local, b)
                checked += 1
    assert checked > 10000
    assert obj.ws_run((0, 0, 0)) is None and obj.ws_run((2, 0, b"")) is None and arr.ws_run((0, 0, 0)) is None


def test_whitespace_runs_equal_brute_force(tok, vocab):
    """States inside whitespace runs (indentation up to the bound, blanks before a closer, a
    typed XML value's trailing blanks) take the flattened whitespace walk: exact masks."""
    from q27py.engine.grammar import MAX_WS

    stops = frozenset(tok.eos_ids)
    pad = " " * (MAX_WS - 2)
    cases = [
        (json_grammar(CORPUS["cc:Bash"]), '{\n    "command" :\t"ls",\n' + pad + '"timeout":  5\n\n}  '),
        (json_grammar(CODEX_SHELL), '{ "command" : [ "a" ,\n\t\t"b"' + pad + '] , "timeout_ms" :1 }'),
        (tool_call_grammar({"Read": CORPUS["cc:Read"]}),
         "  " + render_call("Read", {"file_path": "x", "offset": 3}).replace("3\n</parameter>", "3   \n </parameter>")),
    ]
    n = 0
    for grammar, text in cases:
        assert grammar.matches(text.encode()), text
        c = CompiledConstraint(grammar, vocab)
        for sid in sorted(set(states_along(c, tok, text))):
            if c._ws_run(sid) is not None:
                n += 1
            got = np.flatnonzero(c.allowed(sid, stops).dense(vocab.vocab_size)).tolist()
            assert got == brute_force(c, tok, sid, stops), (grammar.key[:30], sid)
    assert n >= 8


def test_masks_of_non_accepting_states_are_shared_across_end_ids(tok, vocab):
    """A state that does not accept keeps one mask for every set of end ids (the start state's,
    made at compile time with none known, serves each request); accepting states and states with
    nothing else allowed still get their own end ids."""
    c = CompiledConstraint(json_grammar(CORPUS["cc:Bash"]), vocab)
    c.precompute()
    other = tok.special_ids["<|im_start|>"]  # a special the grammar never names: allowed only as an end id
    assert other not in tok.eos_ids
    a, b = frozenset(tok.eos_ids), frozenset({other})
    assert c.allowed(c.start, a) is c.allowed(c.start, b) is c.allowed(c.start)
    sids = states_along(c, tok, '{"command": "ls"}')
    end = sids[-1]
    assert c.accepts(end)
    assert all(t in c.allowed(end, a) for t in a) and other in c.allowed(end, b) and other not in c.allowed(end, a)
    for sid in sids:
        for stops in (a, b):
            got = np.flatnonzero(c.allowed(sid, stops).dense(vocab.vocab_size)).tolist()
            assert got == brute_force(c, tok, sid, stops)


def test_posset_from_walk_reads_only_the_written_spans():
    """PosSet.from_walk (a container walk's result read from its spans) equals from_bool, on the
    short path (spans under 1/8 of the vocabulary) and the dense fallback alike."""
    from q27py.engine.constraint import PosSet

    rng = np.random.default_rng(4)
    n = 10000
    for span_len, count in ((40, 5), (900, 3)):  # 200 ids written: short path; 2700: fallback
        acc = np.zeros(n, dtype=bool)
        spans, single = [], rng.choice(n, 7, replace=False).tolist()
        for _ in range(count):
            lo = int(rng.integers(0, n - span_len))
            acc[lo:lo + span_len] |= rng.random(span_len) < 0.5
            spans.append((lo, lo + span_len))
        pure = np.sort(rng.choice(n, 9, replace=False))
        acc[pure] = True
        spans.append(pure)
        want = acc.copy()
        want[single] = True
        got = PosSet.from_walk(acc.copy(), single, spans)
        ref = PosSet.from_bool(want)
        assert np.array_equal(got.bool(n), ref.bool(n)) and got.n == ref.n


def test_prepare_builds_the_index_then_calls_on_ready(vocab):
    """serve passes gc.freeze as on_ready: it must run after the index exists (so the index's
    objects are frozen out of the cyclic collector), in the foreground and background modes."""
    import threading

    from q27py.engine.constraint import ConstraintCache

    for background in (False, True):
        cache = ConstraintCache(lambda: vocab)
        seen, done = [], threading.Event()

        def ready(cache=cache, seen=seen, done=done):
            seen.append(cache._vocab is not None)
            done.set()

        cache.prepare(background=background, on_ready=ready)
        assert done.wait(120)
        assert seen == [True]
