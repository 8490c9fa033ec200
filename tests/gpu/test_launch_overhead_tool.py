"""The host-overhead tool (tools/launch_overhead.py) keeps running on a CPU."""

from __future__ import annotations


def test_the_launch_overhead_tool_runs_on_a_cpu():
    """tools/launch_overhead.py builds a device-less Runtime by hand; it broke when Runtime gained a field
    (profile_kernels' _prof) and nothing ran it. It must run and report a positive per-launch cost."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "tools" / "launch_overhead.py"), "--n", "200"], capture_output=True,
                       text=True, cwd=root, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "us per launch" in r.stdout
