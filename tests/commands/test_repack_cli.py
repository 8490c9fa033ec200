"""`q27py repack` writes one .q27 file plus the tokenizer files the engine reads beside it."""

import subprocess
import sys

from q27py import DEFAULT_MODEL_DIR
from q27py.io.q27file import Q27File
from q27py.tokenizer import Tokenizer


def test_repack_writes_container_and_tokenizer_files(tmp_path):
    out = tmp_path / "m" / "tiny.q8.q27"
    out.parent.mkdir()
    proc = subprocess.run([sys.executable, "-m", "q27py", "repack", str(DEFAULT_MODEL_DIR), str(out), "--tier", "q8"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    f = Q27File(out)
    assert f.header["tier"] == "q8" and f.config.hidden_size == 256
    for name in ("tokenizer.json", "generation_config.json"):
        assert (out.parent / name).read_bytes() == (DEFAULT_MODEL_DIR / name).read_bytes()
    assert Tokenizer.from_model_dir(out.parent).eos_ids == [16386, 16384]
    # a second repack into the same folder is fine (same tokenizer); a different one is refused
    (out.parent / "tokenizer_config.json").write_text("{}")
    again = subprocess.run([sys.executable, "-m", "q27py", "repack", str(DEFAULT_MODEL_DIR), str(out.with_suffix(".b.q27")),
                            "--tier", "q8"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 1 and "differs" in again.stderr
