"""Fixtures the engine tests share: the bundled model's tokenizer and its fast CPU model (module scope:
each test module loads its own, as before)."""

from __future__ import annotations

import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.model.fastcpu import FastCPUModel
from q27py.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def fast():
    return FastCPUModel.load(DEFAULT_MODEL_DIR)
