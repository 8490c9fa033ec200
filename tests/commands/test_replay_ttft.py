"""`q27py bench replay`: time to first token is when the first token's chunk comes out (issue 14), as a
streaming client gets it, not the end of the max_tokens=1 request (which also holds the work the
engine does after that token: the prompt's MTP warm-up held back for it, putting the state at rest)."""

import time

import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.bench.replay import first_token, run_replay
from q27py.config import Q27Config
from q27py.engine.api import GenerationChunk
from q27py.engine.engine import LocalEngine
from q27py.model.fastcpu import FastCPUModel
from q27py.tokenizer import Tokenizer

AFTER = 0.3  # seconds of engine work after the first token


class AfterTheToken:
    """An engine whose request yields its token, then works AFTER seconds before it ends."""

    def generate(self, request):
        yield GenerationChunk([])  # a prefill piece
        yield GenerationChunk([7])
        time.sleep(AFTER)
        yield GenerationChunk([], finish_reason="length", stats={"cached_tokens": 3})


def test_ttft_is_the_first_tokens_chunk_and_complete_is_the_request():
    r = first_token(AfterTheToken(), list(range(10)), 4)
    assert r["prompt_tokens"] == 10 and r["cached_tokens"] == 3
    assert r["ttft_s"] < AFTER / 2 <= AFTER <= r["complete_s"]


class Cyclic(AfterTheToken):
    """An engine in a reference cycle, as LocalEngine is: dropping the last reference frees nothing."""

    def __init__(self):
        self.me = self


def test_a_cold_engine_is_collected_before_the_next_turn():
    """bench replay's cold engines hold device snapshots counted against the model's budget: each is collected
    when its turn ends, not whenever the cycle collector next runs (failed before: the replay dropped it only)."""
    import gc
    import weakref

    made = []

    def make():
        e = Cyclic()
        made.append(weakref.ref(e))
        return e

    gc.disable()  # no collection but the one cold_first_token runs
    try:
        from q27py.bench.replay import cold_first_token

        r = cold_first_token(make, list(range(10)), 4)
        assert r["prompt_tokens"] == 10
        assert len(made) == 1 and made[0]() is None
    finally:
        gc.enable()


@pytest.fixture(scope="module")
def parts():
    return FastCPUModel.load(DEFAULT_MODEL_DIR), Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)


class SlowWarmup:
    """The model, with every MTP warm-up pass (logits_rows "none") made `delay` seconds slower."""

    def __init__(self, inner, delay):
        self._m, self.delay, self.warmups = inner, delay, 0

    def __getattr__(self, name):
        return getattr(self._m, name)

    def mtp_forward(self, kv, hidden, next_ids, start, logits_rows="all"):
        if isinstance(logits_rows, str) and logits_rows == "none":
            self.warmups += 1
            time.sleep(self.delay)
        return self._m.mtp_forward(kv, hidden, next_ids, start, logits_rows)


def test_the_prompts_mtp_warmup_is_not_in_ttft(parts):
    fast, tok = parts
    model = SlowWarmup(fast, 0.1)
    cfg = Q27Config()
    cfg.spec.enabled = True
    cfg.engine.checkpoint_every = 0
    engine = LocalEngine(cfg, model, tok)
    ids = (tok.encode("def parse(line):\n    return line.split(',')\n") * 100)[:1000]  # four CPU pieces
    r = first_token(engine, ids, len(ids))
    assert model.warmups == 4  # one per prompt piece, all after the token
    assert r["complete_s"] - r["ttft_s"] >= 4 * 0.1
    # the state is at rest for the next turn: it resumes the live sequence and drafts with the ladder
    (seq,) = engine.prefix.slots
    assert seq.state.mtp_kv.length == seq.state.position - 1


def test_replay_rows_keep_their_keys_and_add_the_completion(parts):
    fast, tok = parts
    cfg = Q27Config()
    result = run_replay(lambda: LocalEngine(cfg, fast, tok), tok, system_tokens=600, turns=2,
                        cold_at_tokens=10 ** 9, log=lambda *a: None)
    for row in result["turns"]:
        assert {"turn", "prompt_tokens", "cached_tokens", "ttft_s", "complete_s", "cold_ttft_s",
                "cold_complete_s"} <= set(row)
        assert 0 < row["ttft_s"] <= row["complete_s"] and 0 < row["cold_ttft_s"] <= row["cold_complete_s"]
    assert {"turns", "token_weighted_reuse", "prompt_tokens_total", "reused_tokens_total", "warm_ttft_mean_s",
            "turn_at_target", "prefix"} <= set(result)
    assert result["turns"][1]["cached_tokens"] > 0
