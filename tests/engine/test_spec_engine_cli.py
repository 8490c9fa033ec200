"""Speculation through LocalEngine and `q27py generate` (flags -> SpecConfig / SamplingParams, stats keys)."""

import json

import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.cli import main
from q27py.config import Q27Config
from q27py.engine.api import GenerationRequest
from q27py.engine.decoder import Decoder
from q27py.engine.engine import LocalEngine
from q27py.engine.spec import SpecDecoder
from q27py.model.reference import ReferenceModel
from q27py.tokenizer import Tokenizer

PROMPT = "x = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2"


@pytest.fixture(scope="module")
def parts():
    return ReferenceModel.load(DEFAULT_MODEL_DIR), Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)


def _engine(parts, **spec):
    cfg = Q27Config()
    for k, v in spec.items():
        setattr(cfg.spec, k, v)
    return LocalEngine(cfg, *parts)


def _collect(engine, request):
    chunks = list(engine.generate(request))
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1]


def test_engine_picks_the_decoder_from_the_config(parts):
    assert isinstance(_engine(parts).decoder, SpecDecoder)  # the bundled model has an MTP head
    assert isinstance(_engine(parts, enabled=False).decoder, Decoder)
    model, tok = parts
    no_mtp = ReferenceModel.load(DEFAULT_MODEL_DIR)
    no_mtp.has_mtp = False
    assert isinstance(LocalEngine(Q27Config(), no_mtp, tok).decoder, Decoder)


def test_stop_string_inside_a_speculative_round(parts):
    model, tok = parts
    ids = tok.encode(PROMPT)
    spec = _engine(parts, trace=True)
    full_tokens, full_text, _ = _collect(spec, GenerationRequest(ids, 20))
    # ", 3, 1, 2, 3, ..." : stop at the second "1," - committed inside one wide suffix round.
    stop = "1, 2, 3, 1"
    assert stop in full_text
    tokens, text, last = _collect(spec, GenerationRequest(ids, 20, stop_strings=(stop,)))
    assert last.finish_reason == "stop_string"
    assert text == full_text[: full_text.index(stop)]
    plain_tokens, plain_text, plain_last = _collect(_engine(parts, enabled=False), GenerationRequest(ids, 20, stop_strings=(stop,)))
    assert plain_text == text and plain_last.finish_reason == "stop_string"
    assert last.stats["rounds"] < plain_last.stats["rounds"]
    assert sum(r["accepted"] for r in last.stats["trace"]) == last.stats["generated_tokens"] == len(tokens)


def _generate(capsys, *args):
    assert main(["generate", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_flags_and_stats_keys(capsys):
    ids = "87,283,498,16,11,220,17,11,220,18,11,220,16,11,220,17,11,220,18,11,220,16,11,220,17"
    spec = _generate(capsys, "--prompt-ids", ids, "-n", "16", "--trace")
    plain = _generate(capsys, "--prompt-ids", ids, "-n", "16", "--no-spec", "--trace")
    assert spec["tokens"] == plain["tokens"]
    s = spec["stats"]
    assert s["rounds"] == len(s["trace"]) and sum(r["accepted"] for r in s["trace"]) == 16
    assert s["tokens_per_round"] == pytest.approx(16 / s["rounds"]) and s["tokens_per_round"] > 1.5
    assert {r["source"] for r in s["trace"]} <= {"mtp", "suffix", "none"}
    # the contract keys, plus the round's verify lanes and MTP passes (added for the trace replay bench)
    assert all(set(r) == {"source", "drafts", "accepted", "lanes", "mtp_steps"} for r in s["trace"])
    assert all(r["lanes"] == (len(r["drafts"]) + 1 if i else 0) for i, r in enumerate(s["trace"]))
    assert plain["stats"]["tokens_per_round"] == 1.0 and plain["stats"]["rounds"] == 16
    no_trace = _generate(capsys, "--prompt-ids", ids, "-n", "4")
    assert "trace" not in no_trace["stats"] and "rounds" in no_trace["stats"]
    mtp_only = _generate(capsys, "--prompt-ids", ids, "-n", "16", "--no-suffix", "--max-depth", "2", "--trace")
    assert mtp_only["tokens"] == plain["tokens"]
    assert all(r["source"] != "suffix" and len(r["drafts"]) <= 2 for r in mtp_only["stats"]["trace"])


def test_generate_sampling_flags_same_seed_same_output(capsys):
    args = ["--prompt", "def mean(values):\n", "-n", "12", "--temperature", "0.9", "--top-p", "0.95",
            "--top-k", "50", "--min-p", "0.02", "--seed", "7"]
    a = _generate(capsys, *args)
    b = _generate(capsys, *args, "--no-spec")
    c = _generate(capsys, *args, "--max-depth", "1", "--no-suffix")
    assert a["tokens"] == b["tokens"] == c["tokens"]


def test_generate_rejects_bad_settings(capsys):
    assert main(["generate", "--prompt", "x", "--max-depth", "9"]) == 1
    assert "max_depth" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--top-p", "0"]) == 1
    assert "top_p" in capsys.readouterr().err
