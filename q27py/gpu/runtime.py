"""CUDA runtime: compile the kernels in cuda/ for this device (CuPy RawModule), cache them,
and launch them with explicitly typed arguments.

Sources are compiled by NVRTC for the card's own compute capability (CuPy picks the arch).
The shared header cuda/common.cuh is spliced into each source before compiling, so CuPy's
on-disk cache key covers it. The kernels need sm_80+ (bf16 mma.sync, cvt.bf16x2); on an
older card `Runtime()` raises with the reason, and callers keep the reference path.

Typed arguments: CuPy passes a Python int as a 64-bit value, which silently corrupts an
`int` parameter, so every scalar goes through i32/i64/f32/u64 and every pointer through
`ptr` (a cupy array, None -> 0, or an integer address).
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from q27py.errors import Q27Error

def _find_cuda_dir() -> Path:
    """The kernel sources: cuda/ beside the package in a source tree or editable install,
    else share/q27py/cuda under the installation prefix (setup.cfg data_files)."""
    import sys

    for candidate in (Path(__file__).resolve().parents[2] / "cuda", Path(sys.prefix) / "share" / "q27py" / "cuda"):
        if (candidate / "common.cuh").exists():
            return candidate
    return Path(__file__).resolve().parents[2] / "cuda"


CUDA_DIR = _find_cuda_dir()
MIN_CC = (8, 0)
KERNEL_FILES = ("gemv", "gemv2", "gemm", "dequant", "chain", "quant", "embed", "norm", "conv", "gdn", "gdn_decode", "gdn_chunk", "gdn_chunk2", "rope", "attention",
                "attention_prefill", "attention_prefill2", "sampling", "probe", "kv_rotated")


class GpuUnavailable(Q27Error):
    """No usable CUDA device (no cupy, no GPU, or compute capability below sm_80)."""


def i32(v) -> np.int32:
    return np.int32(v)


def i64(v) -> np.int64:
    return np.int64(v)


def f32(v) -> np.float32:
    return np.float32(v)


def u64(v) -> np.uint64:
    return np.uint64(v)


def ptr(a, offset_bytes: int = 0) -> np.uint64:
    """Device address of a cupy array (plus a byte offset); None -> null."""
    if a is None:
        return np.uint64(0)
    if isinstance(a, (int, np.integer)):
        return np.uint64(int(a) + offset_bytes)
    return np.uint64(a.data.ptr + offset_bytes)


def compile_options() -> tuple[str, ...]:
    """What every kernel module is compiled with: C++17 and the shared constants table as -D
    defines (q27py/gpu/constants.py), so kernels and Python read one set of numbers. CuPy's
    on-disk cache key covers the options, so a changed constant recompiles."""
    from q27py.gpu.constants import defines

    return ("--std=c++17",) + defines()


def source_text(name: str) -> str:
    """The kernel source with cuda/common.cuh spliced in (what NVRTC compiles)."""
    src = (CUDA_DIR / f"{name}.cu").read_text(encoding="utf-8")
    header = (CUDA_DIR / "common.cuh").read_text(encoding="utf-8").replace("#pragma once", "")
    return src.replace('#include "common.cuh"', header)


class Runtime:
    """One per process: the device, its properties, and the compiled modules."""

    _instance: "Runtime | None" = None
    _lock = threading.Lock()

    def __init__(self):
        try:
            import cupy as cp
        except Exception as exc:  # ImportError, or a CUDA library load failure
            raise GpuUnavailable(f"cupy is not importable ({exc})") from None
        try:
            n = cp.cuda.runtime.getDeviceCount()
        except Exception as exc:
            raise GpuUnavailable(f"no CUDA device ({exc})") from None
        if n == 0:
            raise GpuUnavailable("no CUDA device")
        self.cp = cp
        self.device = cp.cuda.Device()
        props = cp.cuda.runtime.getDeviceProperties(self.device.id)
        self.name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.cc = (int(props["major"]), int(props["minor"]))
        if self.cc < MIN_CC:
            raise GpuUnavailable(
                f"{self.name} is sm_{self.cc[0]}{self.cc[1]}; the fast path needs sm_80+ (bf16 tensor cores)"
            )
        self.sm_count = int(props["multiProcessorCount"])
        self.l2_bytes = int(props["l2CacheSize"])
        self.total_mem = int(props["totalGlobalMem"])
        # the most dynamic shared memory one block may opt into (sizes the GDN chunk kernel)
        self.smem_optin = int(props.get("sharedMemPerBlockOptin", 48 * 1024))
        self.arch = f"sm_{self.cc[0]}{self.cc[1]}"
        self._modules: dict[str, object] = {}
        self._functions: dict[tuple[str, str], object] = {}
        self._shared_set: dict[tuple[str, str], int] = {}
        self.launches = 0  # kernels this process launched through launch() (eager or into a capture)
        self._tally: Counter | None = None  # (module, kernel) -> launches while count_launches() is open

    @classmethod
    def get(cls) -> "Runtime":
        with cls._lock:
            if cls._instance is None:
                cls._instance = Runtime()
            return cls._instance

    def module(self, name: str):
        mod = self._modules.get(name)
        if mod is None:
            mod = self.cp.RawModule(code=source_text(name), options=compile_options())
            mod.compile()
            self._modules[name] = mod
        return mod

    def fn(self, module: str, kernel: str):
        key = (module, kernel)
        f = self._functions.get(key)
        if f is None:
            f = self.module(module).get_function(kernel)
            self._functions[key] = f
        return f

    def launch(self, module: str, kernel: str, grid, block, args, shared_mem: int = 0) -> None:
        grid = tuple(int(g) for g in (grid if isinstance(grid, tuple) else (grid,)))
        block = tuple(int(b) for b in (block if isinstance(block, tuple) else (block,)))
        if min(grid) <= 0:
            return
        args = tuple(np.uint64(0) if a is None else a for a in args)  # null pointers
        f = self.fn(module, kernel)
        if shared_mem > 48 * 1024:
            self._allow_shared(module, kernel, f, int(shared_mem))
        f(grid, block, args, shared_mem=int(shared_mem))
        self.launches += 1
        if self._tally is not None:
            self._tally[(module, kernel)] += 1

    @contextmanager
    def count_launches(self):
        """Yields a Counter of (module, kernel) -> launches made inside the block, eager or recorded
        into a graph capture (a captured step's launches are its graph's kernel nodes). Every
        kernel in cuda/ goes through launch(); cuBLAS calls (the prefill route) are not counted."""
        saved, self._tally = self._tally, Counter()
        try:
            yield self._tally
        finally:
            inner, self._tally = self._tally, saved
            if saved is not None:
                saved.update(inner)

    def _allow_shared(self, module: str, kernel: str, f, nbytes: int) -> None:
        """Raise the kernel's dynamic shared-memory limit above the 48 KB default (once)."""
        key = (module, kernel)
        if self._shared_set.get(key, 0) >= nbytes:
            return
        try:
            f.max_dynamic_shared_size_bytes = nbytes
        except AttributeError:  # older CuPy: set the attribute through the driver
            self.cp.cuda.driver.funcSetAttribute(f.kernel.ptr, 8, nbytes)  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._shared_set[key] = nbytes

    def warm_all(self) -> None:
        """Compile every module now (startup), so no compile lands inside a timed region or a capture."""
        for name in KERNEL_FILES:
            self.module(name)

    def describe(self) -> dict:
        return {"name": self.name, "arch": self.arch, "sms": self.sm_count, "l2_bytes": self.l2_bytes,
                "total_mem": self.total_mem}


def available() -> bool:
    try:
        Runtime.get()
        return True
    except GpuUnavailable:
        return False
