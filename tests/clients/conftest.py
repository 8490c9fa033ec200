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


class RecordingEngine:
    """The real LocalEngine, plus a record of what it was asked and what it said (for asserts)."""

    def __init__(self, engine):
        self._engine = engine
        self.turns: list[dict] = []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _record(self, request, chunks):
        turn = {"prompt": self._engine.tokenizer.decode(request.prompt_ids), "output": "",
                "max_tokens": request.max_tokens, "finish": None}
        self.turns.append(turn)
        ids: list[int] = []
        for chunk in chunks:
            # the engine speaks token ids only (engine/api.py): the record decodes them itself
            ids.extend(chunk.token_ids)
            turn["output"] = self._engine.tokenizer.decode(ids)
            turn["finish"] = chunk.finish_reason or turn["finish"]
            yield chunk

    def generate(self, request):
        return self._record(request, self._engine.generate(request))

    def steps(self, request, pace=None):
        # the server's slot scheduler (engine/scheduler.py) drives requests through steps(), not
        # generate(): without this the record missed every served turn. The scheduler's pace (prefill
        # piece size, shared rounds) is read by the engine's stepper, so it is passed through; a
        # shared round's lane chunk carries no tokens and records nothing.
        return self._record(request, self._engine.steps(request, pace))


@pytest.fixture(scope="session")
def real_server():
    """`q27py serve`'s own config and app (CPU defaults and limits, the bundled model, the fast
    CPU path) in this process, so tests can see the prompts the engine got."""
    import argparse

    from server_harness import LiveServer

    from q27py.commands import serve
    from q27py.engine.engine import LocalEngine

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    cfg = serve.build_config(parser.parse_args([]), environ={})
    engine = RecordingEngine(LocalEngine.load(cfg))
    app = serve.build_app(cfg, engine)
    bridge = app.service.bridge
    live = LiveServer(app.http_server(serve.limits_for(cfg)), on_start=bridge.start, on_stop=bridge.stop)
    live.engine = engine
    with live:
        yield live
