"""A repacked .q27 file on the CPU path: a plain message that .q27 files need --device cuda
(issue 13 item 10), not "not a directory"."""

import subprocess
import sys

from q27py import DEFAULT_MODEL_DIR


def test_q27_file_on_cpu_says_it_needs_cuda(tmp_path):
    from q27py.gpu.q27pack import write
    from q27py.io.checkpoint import Checkpoint

    out = tmp_path / "tiny.q8.q27"
    write(out, Checkpoint.open(DEFAULT_MODEL_DIR), "q8", progress=False)
    proc = subprocess.run([sys.executable, "-m", "q27py", "generate", "--model", str(out), "--device", "cpu",
                           "--prompt", "hi", "-n", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert ".q27 files need --device cuda" in proc.stderr and "not a directory" not in proc.stderr
    assert "Traceback" not in proc.stderr
