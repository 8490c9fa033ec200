"""Fixtures for server tests: the real tokenizer and chat stack, a scripted model side."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # server_harness, scripted_engine, grammars

from server_harness import ServerFactory  # noqa: E402

from q27py import DEFAULT_MODEL_DIR  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    from q27py.tokenizer import Tokenizer

    return Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)


@pytest.fixture
def make_server(tokenizer):
    factory = ServerFactory(tokenizer)
    yield factory
    factory.close()
