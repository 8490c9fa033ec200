"""make-tiny writes checkpoints our own loader (and its validation) accepts, with the fixture tokenizers."""

import json

import numpy as np
import pytest

from q27py.cli import main
from q27py.model.checkpoint import Checkpoint
from q27py.model.reference import ReferenceModel
from q27py.model.tiny import load_full_tokenizer_json, prefix_tokenizer_json


@pytest.fixture(scope="module")
def full_tok():
    return load_full_tokenizer_json()


@pytest.mark.parametrize("name,n", [("qwen36-first2048", 2048), ("qwen36-first16384", 16384)])
def test_prefix_tokenizers_equal_fixtures(fixtures_dir, full_tok, name, n):
    want = json.loads((fixtures_dir / "tokenizers" / name / "tokenizer.json").read_text())
    assert prefix_tokenizer_json(full_tok, n) == want


@pytest.mark.parametrize("layout,tied", [("text", False), ("multimodal", True)])
def test_make_tiny_round_trip(tmp_path, layout, tied):
    out = tmp_path / "tiny"
    args = ["make-tiny", str(out), "--seed", "3", "--layout", layout] + (["--tied"] if tied else [])
    assert main(args) == 0
    ck = Checkpoint.open(out)
    assert ck.has_mtp and ck.config.tie_word_embeddings == tied
    assert ck.config.vocab_size == 2112  # 2048 ranks + 33 specials, padded to 64
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2050, 2048]
    model = ReferenceModel(ck)
    st = model.new_state()
    logits = model.forward(st, [1, 2, 3, 4, 5]).logits
    assert logits.shape == (5, 2112) and np.isfinite(logits).all()


def test_seed_changes_weights(tmp_path):
    main(["make-tiny", str(tmp_path / "a"), "--seed", "1"])
    main(["make-tiny", str(tmp_path / "b"), "--seed", "2"])
    main(["make-tiny", str(tmp_path / "c"), "--seed", "1"])
    a, b, c = (Checkpoint.open(tmp_path / x).get("layers.0.mlp.up_proj.weight") for x in "abc")
    assert not np.array_equal(a, b) and np.array_equal(a, c)
