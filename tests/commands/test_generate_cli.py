"""`q27py generate` end to end on the bundled model: the JSON contract and greedy exactness."""

import json
import subprocess
import sys

import pytest




def _run(*args):
    proc = subprocess.run([sys.executable, "-m", "q27py", "generate", *args], capture_output=True, text=True, timeout=300)
    return proc


def test_json_contract_and_golden_text(fixtures_dir):
    # The transformers golden is of q36-tiny-code (no longer bundled; read from ../shared/models).
    # generate runs the default CPU path (the fast one), so this also holds it to transformers.
    gold = json.loads((fixtures_dir / "golden" / "q36-tiny-code" / "golden.json").read_text())
    model = fixtures_dir.parent / "models" / "q36-tiny-code"
    if not model.is_dir():
        pytest.skip(f"{model} not found")
    proc = _run("--model", str(model), "--prompt", gold["prompt_text"], "-n", "16", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"tokens", "text", "stats"}
    for key in ("prompt_tokens", "generated_tokens", "seconds", "tokens_per_s"):
        assert key in out["stats"]
    assert out["stats"]["generated_tokens"] == len(out["tokens"]) == 16
    assert gold["decoded_text"].startswith(out["text"])


def test_prompt_ids_and_bad_input():
    ok = _run("--prompt-ids", "1,2,3", "-n", "3", "--json")
    assert ok.returncode == 0 and len(json.loads(ok.stdout)["tokens"]) == 3
    bad = _run("--prompt-ids", "1,x", "-n", "3")
    assert bad.returncode == 1 and "comma-separated" in bad.stderr and "Traceback" not in bad.stderr
    oob = _run("--prompt-ids", "99999999", "-n", "3")
    assert oob.returncode == 1 and "outside the vocabulary" in oob.stderr


def test_broken_model_dir_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    proc = _run("--model", str(tmp_path), "--prompt", "hi")
    assert proc.returncode == 1 and "config.json" in proc.stderr and "Traceback" not in proc.stderr
