"""Issue 13.4: prefill checks the cancel flag between chunks, and CPU chunks are small."""

import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.config import Q27Config
from q27py.engine.api import GenerationRequest
from q27py.engine.engine import LocalEngine
from q27py.model.reference import ReferenceModel
from q27py.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def parts():
    return ReferenceModel.load(DEFAULT_MODEL_DIR), Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)


@pytest.mark.parametrize("spec", [True, False])
def test_cancel_during_prefill_stops_after_the_current_chunk(parts, spec):
    model, tok = parts
    cfg = Q27Config()
    cfg.spec.enabled = spec
    cfg.engine.prefill_chunk = 32
    cfg.engine.checkpoint_every = 0
    engine = LocalEngine(cfg, model, tok)
    request = GenerationRequest(prompt_ids=tok.encode("word " * 200)[:200], max_tokens=4)
    calls = []
    forward = model.forward

    def counting_forward(state, ids, *args, **kwargs):
        calls.append(len(ids))
        request.cancel.set()  # the client goes away while the first chunk runs
        return forward(state, ids, *args, **kwargs)

    model.forward = counting_forward
    try:
        chunks = list(engine.generate(request))
    finally:
        del model.forward
    assert calls == [32]  # one chunk ran, the other five were never started
    assert chunks[-1].finish_reason == "cancelled"
    assert [t for c in chunks for t in c.token_ids] == []
    # the engine is free and healthy afterwards: the same prompt runs to the end
    again = list(engine.generate(GenerationRequest(prompt_ids=request.prompt_ids, max_tokens=4)))
    assert again[-1].finish_reason == "length" and again[-1].stats["cached_tokens"] == 0


def test_cpu_prefill_chunks_are_small(parts):
    model, tok = parts
    cfg = Q27Config()
    assert cfg.engine.device == "cpu" and cfg.engine.prefill_chunk > cfg.engine.cpu_prefill_chunk
    assert LocalEngine(cfg, model, tok).decoder.prefill_chunk == cfg.engine.cpu_prefill_chunk
