"""tools/device_wave.sh, the device calls' stage runner: it parses, and every stage name is one case label. A second
`h200)` label (2026-12-07, thirteenth session) was shadowed by the first: the call ran an older stage's probes on an
H100 instead of the new stage, ~3 minutes of the session's 30 of device time."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

WAVE = Path(__file__).resolve().parents[1] / "tools" / "device_wave.sh"


def test_stage_names_are_unique():
    labels = re.findall(r"^    ([A-Za-z0-9_|]+)\)", WAVE.read_text(), flags=re.M)
    names = [n for label in labels for n in label.split("|")]
    assert len(names) > 10
    dup = [n for n, c in Counter(names).items() if c > 1]
    assert not dup, f"stage names given twice (the later one never runs): {dup}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_wave_parses():
    r = subprocess.run(["bash", "-n", str(WAVE)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
