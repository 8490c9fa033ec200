"""NVRTC builds of the cuda/ sources on a machine without a GPU, through libnvrtc by ctypes (the pinned
nvidia-cuda-nvrtc wheel .ci/run installs as a test tool; no CuPy, no cuda-python): the compiler the runtime
uses on the device, which rejects some C++ that nvcc's checks (nvcc_build.py) let through."""

from __future__ import annotations

import ctypes
import importlib.util
from pathlib import Path

from q27py.gpu.runtime import compile_options, source_text


def find_libnvrtc() -> Path | None:
    """libnvrtc.so from the installed nvidia-cuda-nvrtc wheel (nvidia/cu13/lib or nvidia/cuda_nvrtc/lib), or None."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        for sub in ("cu13/lib", "cuda_nvrtc/lib"):
            for lib in sorted(Path(root, sub).glob("libnvrtc.so*")):
                if "builtins" not in lib.name and ".alt." not in lib.name:
                    return lib
    return None


def load() -> ctypes.CDLL:
    """libnvrtc, its builtins library loaded first (global symbols): dlopen finds it beside libnvrtc only through
    the library path, which a wheel's directory is not on."""
    lib = find_libnvrtc()
    for b in sorted(lib.parent.glob("libnvrtc-builtins.so*")):
        if ".alt." not in b.name:
            ctypes.CDLL(str(b), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(lib))


def compile_module(lib: ctypes.CDLL, name: str, arch: str, extra: tuple[str, ...] = ()) -> tuple[bool, str]:
    """(compiled, log) of cuda/<name>.cu for arch with the runtime's options (compile_options) and its
    NVRTC flags (runtime.nvrtc_cubin's), plus extra."""
    prog = ctypes.c_void_p()
    src = source_text(name).encode()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, f"{name}.cu".encode(), 0, None, None)
    assert rc == 0, f"nvrtcCreateProgram: {rc}"
    try:
        opts = [o.encode() for o in (*compile_options(), *extra, "-ftz=true", "-default-device",
                                     f"--gpu-architecture={arch}")]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, log)
        return rc == 0, log.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
