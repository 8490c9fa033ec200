"""nvcc builds of the cuda/ sources exactly as NVRTC sees them (common.cuh spliced, the constants
table as -D), for the CPU-side compile and spill checks of tests/gpu (no GPU needed)."""

from __future__ import annotations

import re
import shutil
import subprocess

from q27py.gpu.runtime import compile_options, source_text

NVCC = shutil.which("nvcc")


def build(tmp_path, name: str, arch: str, extra=()) -> tuple[int, str]:
    """(return code, ptxas -v output) of building cuda/<name>.cu for arch."""
    src = tmp_path / f"{name}.cu"
    src.write_text(source_text(name), encoding="utf-8")
    r = subprocess.run([NVCC, *compile_options(), *extra, f"-arch={arch}", "-cubin", "-Xptxas", "-v",
                        "-o", str(tmp_path / f"{name}_{arch}.cubin"), str(src)], capture_output=True, text=True)
    return r.returncode, r.stderr


def build_with(tmp_path, name: str, extra) -> subprocess.CompletedProcess:
    """nvcc -cubin -Xptxas -v of cuda/<name>.cu with `extra` naming the target (e.g. -gencode for an "a"
    arch, or -DQ27_ARCH_SPECIFIC with a plain -arch to see the #error guard)."""
    src = tmp_path / f"{name}.cu"
    src.write_text(source_text(name), encoding="utf-8")
    return subprocess.run([NVCC, *compile_options(), *extra, "-cubin", "-Xptxas", "-v", "-o",
                           str(tmp_path / f"{name}.cubin"), str(src)], capture_output=True, text=True)


def ptxas_report(text: str) -> dict[str, tuple[int, int]]:
    """kernel -> (registers, spill bytes stored + loaded) from ptxas -v output."""
    out, cur, spill = {}, None, 0
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spill = int(m.group(1)) + int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m and cur:
            out[cur] = (int(m.group(1)), spill)
    return out
