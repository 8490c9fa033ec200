"""Prefix reuse end to end: greedy output after any restore equals a cold run, token for token.

Multi-turn agent sessions with tool calls on the bundled trained model: each turn's
prompt is rendered, split-encoded at the stable boundary (as the server does), and
generated once by a warm engine (reusing earlier turns) and once by a cold one.
"""

import json

import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.chat.render import encode_rendered, render_messages
from q27py.config import Q27Config
from q27py.engine.api import GenerationRequest
from q27py.engine.engine import LocalEngine
from q27py.model.reference import ReferenceModel
from q27py.tokenizer import Tokenizer

TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command and return its output.",
          "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
SYSTEM = "You are a coding agent. Work in the repository; use the bash tool to inspect files. " * 12


@pytest.fixture(scope="module")
def parts():
    return ReferenceModel.load(DEFAULT_MODEL_DIR), Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)


def _engine(parts, **engine_overrides):
    cfg = Q27Config()
    cfg.engine.checkpoint_every = 64
    for k, v in engine_overrides.items():
        setattr(cfg.engine, k, v)
    model, tok = parts
    return LocalEngine(cfg, model, tok)


def _prompt(tok, messages):
    """(ids, boundaries): encoded as the server does, the boundaries as token offsets."""
    r = render_messages(messages, TOOLS, enable_thinking=False, preserve_thinking=True)
    ids, system, stable = encode_rendered(tok, r)
    return ids, {"stable_len": stable, "system_len": system or None}


def _run(engine, ids, bounds, n=6):
    req = GenerationRequest(prompt_ids=ids, max_tokens=n, stop_ids=frozenset(), **bounds)
    tokens, stats = [], None
    for chunk in engine.generate(req):
        tokens += chunk.token_ids
        stats = chunk.stats or stats
    return tokens, stats


def _session(turns):
    """A Claude-Code-shaped history growing by tool calls and results."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Find the bug in utils.py and fix it."}]
    yield list(msgs)
    for i in range(turns):
        msgs.append({"role": "assistant", "content": "",
                     "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": f"sed -n {i*10},{i*10+9}p utils.py"}}}]})
        msgs.append({"role": "tool", "content": "\n".join(f"def f{i}_{j}(x):\n    return x + {j}" for j in range(6))})
        yield list(msgs)


def test_multi_turn_warm_equals_cold_and_reuses(parts):
    _, tok = parts
    warm = _engine(parts)
    reused_total = prompt_total = 0
    for messages in _session(4):
        ids, stable = _prompt(tok, messages)
        got, stats = _run(warm, ids, stable)
        want, cold_stats = _run(_engine(parts), ids, stable)
        assert got == want
        assert cold_stats["cached_tokens"] == 0
        reused_total += stats["cached_tokens"]
        prompt_total += len(ids)
    # every turn after the first restores at least the previous turn's stable boundary
    assert reused_total / prompt_total > 0.6


def test_edited_history_rewinds_to_a_checkpoint(parts):
    _, tok = parts
    warm = _engine(parts)
    turns = list(_session(3))
    ids, stable = _prompt(tok, turns[-1])
    _run(warm, ids, stable)
    # edit the second tool result: reuse must stop at a checkpoint before the edit
    edited = json.loads(json.dumps(turns[-1]))
    edited[3]["content"] = "no such file"
    ids2, stable2 = _prompt(tok, edited)
    got, stats = _run(warm, ids2, stable2)
    want, _ = _run(_engine(parts), ids2, stable2)
    assert got == want
    first_diff = next(i for i, (a, b) in enumerate(zip(ids, ids2)) if a != b)
    assert 0 < stats["cached_tokens"] <= first_diff
    # and the old, longer conversation still restores correctly afterwards (aliasing rule)
    got3, _ = _run(warm, ids, stable)
    want3, _ = _run(_engine(parts), ids, stable)
    assert got3 == want3


def test_shared_system_block_hits_for_a_new_conversation(parts):
    _, tok = parts
    warm = _engine(parts, checkpoint_every=0)  # only the system-block snapshot can serve the hit
    ids, stable = _prompt(tok, next(_session(0)))
    _run(warm, ids, stable)
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write tests for parser.py please."}]
    ids2, stable2 = _prompt(tok, other)
    got, stats = _run(warm, ids2, stable2)
    assert stats["cached_tokens"] >= len(tok.encode("<|im_start|>system\n")) + 100
    assert got == _run(_engine(parts), ids2, stable2)[0]


def test_disk_cache_survives_a_restart(parts, tmp_path):
    _, tok = parts
    turns = list(_session(2))
    first = _engine(parts, prefix_cache_dir=tmp_path)
    first.prefix.disk.min_tokens = 1
    ids, stable = _prompt(tok, turns[1])
    _run(first, ids, stable)
    first.prefix.disk.flush()
    assert list(tmp_path.glob("*.q27p"))
    # a new engine (a restart): nothing in memory, the disk entry restores the prefix
    second = _engine(parts, prefix_cache_dir=tmp_path)
    ids2, stable2 = _prompt(tok, turns[2])
    got, stats = _run(second, ids2, stable2)
    assert stats["cached_tokens"] >= stable["stable_len"]
    assert got == _run(_engine(parts), ids2, stable2)[0]
    # a corrupted entry is ignored, and the output is still right
    for f in tmp_path.glob("*.q27p"):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    third = _engine(parts, prefix_cache_dir=tmp_path)
    got3, stats3 = _run(third, ids2, stable2)
    assert stats3["cached_tokens"] == 0 and got3 == got
