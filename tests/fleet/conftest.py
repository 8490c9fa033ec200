"""Fleet tests: metrics, the dashboard (unit + a real headless Chromium), replicas behind a router.

The router (vllm-router) and Chromium are external test tools that .ci/run
installs; the tests that need them skip cleanly when they are absent. The
scripted engine and live-server harness come from tests/server.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[0] / "server"))
sys.path.insert(0, str(HERE))

from server_harness import ServerFactory  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    from q27py import DEFAULT_MODEL_DIR
    from q27py.tokenizer import Tokenizer

    return Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)


@pytest.fixture
def make_server(tokenizer):
    factory = ServerFactory(tokenizer)
    yield factory
    factory.close()
