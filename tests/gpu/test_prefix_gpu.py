"""Prefix reuse on the fast path: rewind / export / import of device state, and warm == cold greedy."""

from __future__ import annotations

import numpy as np
import pytest


pytestmark = pytest.mark.gpu


def _engine(**engine):
    from q27py.config import Q27Config
    from q27py.engine.engine import LocalEngine

    cfg = Q27Config()
    cfg.engine.device = "cuda"
    cfg.engine.checkpoint_every = 64
    for k, v in engine.items():
        setattr(cfg.engine, k, v)
    return LocalEngine.load(cfg)


@pytest.fixture(scope="module")
def model():
    """The bundled model on the fast path (one load for the state tests)."""
    from q27py.config import Q27Config
    from q27py.gpu.forward import load_fast_model

    cfg = Q27Config()
    cfg.engine.device = "cuda"
    return load_fast_model(cfg)


def test_rewind_and_import_reproduce_logits_bitwise(model):
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 16000, 100).tolist(), rng.integers(0, 16000, 7).tolist()
    st = model.new_state()
    model.forward(st, a)
    saved = model.save_recurrent(st)
    exported = model.export_prefix(st)
    want = model.forward(st, b).logits
    model.rewind(st, len(a), saved)
    assert np.array_equal(model.forward(st, b).logits, want)
    other = model.new_state()
    model.import_prefix(other, exported, len(a))
    assert np.array_equal(model.forward(other, b).logits, want)


def test_rewind_from_a_host_snapshot_is_bitwise(model, monkeypatch):
    """Past the device snapshot budget the snapshot is a HostSnapshot (pinned buffers filled by copies queued on
    the model's stream, the host not waiting): the forward after it may overwrite the state at once, and a rewind
    to it still reproduces the logits bit for bit."""
    from q27py.gpu.forward import HostSnapshot

    monkeypatch.setattr(model, "device_snapshot_bytes", 0)
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 16000, 120).tolist(), rng.integers(0, 16000, 9).tolist()
    st = model.new_state()
    model.forward(st, a)
    saved = model.save_recurrent(st)
    assert isinstance(saved, HostSnapshot)
    want = model.forward(st, b).logits
    model.forward(st, b)  # more state updates queued behind the copies
    model.rewind(st, len(a), saved)
    assert np.array_equal(model.forward(st, b).logits, want)


def test_a_reset_state_gives_a_fresh_states_logits_bitwise(model):
    """model.reset_state (the prefix cache reuses an evicted sequence's memory): after a long prompt and
    a verify, the reset state prefills and decodes another prompt -- shorter, so stale KV rows lie past
    its end -- exactly as a new state does (logits, hidden rows, MTP rows)."""
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 16000, 300).tolist(), rng.integers(0, 16000, 90).tolist()
    used = model.new_state()
    model.forward(used, a)
    out = model.forward(used, [5, 6, 7], verify=True)
    model.commit(used, out.trace, 2)
    model.reset_state(used)
    fresh = model.new_state()
    for ids in (b, [11], [12]):
        got = model.forward(used, ids)
        got = (got.logits, got.hidden)  # read before the next forward reuses the scratch (FastOutput's contract)
        want = model.forward(fresh, ids)
        assert np.array_equal(got[0], want.logits) and np.array_equal(got[1], want.hidden)
    assert used.position == fresh.position == len(b) + 2
    if model.has_mtp:
        h = np.zeros((1, model.cfg.hidden_size), np.float32)
        lg1, _ = model.mtp_forward(used.mtp_kv, h, [3], 0)
        lg2, _ = model.mtp_forward(fresh.mtp_kv, h, [3], 0)
        assert np.array_equal(lg1, lg2)


def test_warm_engine_equals_cold_engine_over_turns(tmp_path):
    from q27py.chat.render import render_messages
    from q27py.engine.api import GenerationRequest

    warm = _engine(prefix_cache_dir=tmp_path)
    warm.prefix.disk.min_tokens = 1
    msgs = [{"role": "system", "content": "You are a coding agent. " * 30}, {"role": "user", "content": "Fix utils.py"}]
    cached = []
    for turn in range(3):
        r = render_messages(msgs, enable_thinking=False, preserve_thinking=True)
        head = warm.tokenizer.encode(r.text[: r.stable_len])
        ids = head + warm.tokenizer.encode(r.text[r.stable_len :])
        outs = []
        for eng in (warm, _engine()):
            toks, stats = [], None
            for chunk in eng.generate(GenerationRequest(prompt_ids=ids, max_tokens=12, stable_len=len(head))):
                toks += chunk.token_ids
                stats = chunk.stats or stats
            outs.append(toks)
            if eng is warm:
                cached.append(stats["cached_tokens"])
        assert outs[0] == outs[1]
        msgs += [{"role": "assistant", "content": warm.tokenizer.decode(outs[0])}, {"role": "user", "content": f"step {turn}"}]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    warm.prefix.disk.flush()
    assert list(tmp_path.glob("*.q27p"))
