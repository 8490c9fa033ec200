"""A dropped LocalEngine is freed at once, not when the cycle collector next runs.

Why: on cuda an engine's sequences hold device snapshots (~150 MB each on the 27B) counted against the model's
device snapshot budget (FastModel.device_snapshot_bytes), which every engine over that model shares. The engine
sat in a reference cycle (its constraint cache's vocabulary factory closed over the engine), so a dropped one --
`bench replay`'s cold engines -- kept its snapshots counted until a collection, and the next engine's checkpoints
went to host copies. Failed before the fix: the weak reference was still alive after `del`.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.config import Q27Config
from q27py.engine.api import GenerationRequest
from q27py.engine.engine import LocalEngine
from q27py.model.fastcpu import FastCPUModel
from q27py.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def parts():
    return FastCPUModel.load(DEFAULT_MODEL_DIR), Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)


def test_a_dropped_engine_is_freed_without_the_cycle_collector(parts):
    model, tok = parts
    gc.collect()
    gc.disable()
    try:
        engine = LocalEngine(Q27Config(), model, tok)
        req = GenerationRequest(prompt_ids=list(range(100, 180)), max_tokens=2, stop_ids=frozenset(), stable_len=60)
        chunks = list(engine.generate(req))
        assert sum(len(c.token_ids) for c in chunks) == 2
        ref = weakref.ref(engine)
        del engine, chunks
        assert ref() is None
    finally:
        gc.enable()
