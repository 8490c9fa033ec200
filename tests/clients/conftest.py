"""Real-client tests: the official SDKs and the Claude Code / Codex CLIs against a live server.

The clients are external test tools that .ci/run installs (pip: anthropic,
openai; npm: pinned @anthropic-ai/claude-code and @openai/codex into
$Q27_E2E_CLIENTS); each test skips cleanly when its client is absent. The
model side is the test-only ScriptedEngine from tests/server.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))

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
