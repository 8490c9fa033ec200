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


SM90A = ("-DQ27_ARCH_SPECIFIC", "-gencode=arch=compute_90a,code=sm_90a")  # what runtime.ARCH_SPECIFIC builds


def sm90a_report(tmp_path, name: str) -> dict[str, tuple[int, int]]:
    """ptxas_report of cuda/<name>.cu's sm_90a build, after checking that it builds and that ptxas kept
    every wgmma asynchronous (no C7510 "wgmma serialized": a wait after every wgmma)."""
    r = build_with(tmp_path, name, SM90A)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "C7510" not in r.stderr and "serialized" not in r.stderr, r.stderr[-2000:]
    return ptxas_report(r.stderr)


def assert_refused_without_sm90a(tmp_path, name: str, portable_arch: str) -> None:
    """runtime._arch_module relies on this: a compile that lost the "a" target fails (the #error guard)
    instead of trapping later, while the portable build (entry points that trap) still compiles."""
    r = build_with(tmp_path, name, ("-DQ27_ARCH_SPECIFIC", "-arch=sm_90"))
    assert r.returncode != 0 and "sm_90a" in r.stderr
    r = build_with(tmp_path, name, (f"-arch={portable_arch}",))
    assert r.returncode == 0, r.stderr[-2000:]
