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

import ctypes
import os
import re
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
KERNEL_FILES = ("gemv", "gemv2", "gemv_wg", "gemv_dp", "gemm", "dequant", "chain", "quant", "embed", "norm", "conv", "gdn", "gdn_decode", "gdn_chunk", "gdn_chunk2", "rope", "attention",
                "attention_prefill", "attention_prefill2", "attention_prefill3", "sampling", "probe", "kv_rotated")
# Modules with an architecture-specific build on some cards: there they compile for the "a" target
# (sm_90a: wgmma, setmaxnreg), whose instructions the plain sm_90 target rejects; the source's entry
# points trap in any other build, and kernels.py only launches them where this table gives a target.
ARCH_SPECIFIC = {"attention_prefill3": {(9, 0): "sm_90a"}, "gemv_wg": {(9, 0): "sm_90a"}}


class GpuUnavailable(Q27Error):
    """No usable CUDA device (no cupy, no GPU, or compute capability below sm_80)."""


# Kernel scalar arguments. An eager prefill forward makes ~2,750 launches of ~16 arguments each, and
# a numpy scalar costs ~0.4 us to build, so the values (dimensions, strides, offsets: a few hundred
# distinct ones) are kept once built -- numpy scalars are immutable, so sharing them is safe.
_SCALAR_CACHE_MAX = 1 << 14
_NULL = np.uint64(0)  # a null pointer argument
_I32: dict = {}
_I64: dict = {}


def _scalar(cache: dict, make, v):
    try:
        s = cache.get(v)
    except TypeError:  # an unhashable value (a 0-d array): built each time
        return make(v)
    if s is None:
        s = make(v)
        if len(cache) < _SCALAR_CACHE_MAX:
            cache[v] = s
    return s


def i32(v) -> np.int32:
    # the cache hit inline (a dict lookup, no further call): every eager launch converts ~5 of these
    try:
        return _I32[v]
    except (KeyError, TypeError):
        return _scalar(_I32, np.int32, v)


def i64(v) -> np.int64:
    try:
        return _I64[v]
    except (KeyError, TypeError):
        return _scalar(_I64, np.int64, v)


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
    on-disk cache key covers the options, so a changed constant recompiles. PDL_EARLY follows
    the engine's pdl mode (EngineConfig.pdl), read once per process."""
    from q27py.gpu.constants import defines

    early = "-DPDL_EARLY=1" if pdl_mode() == "early" else "-DPDL_EARLY=0"
    return ("--std=c++17",) + tuple(early if d.startswith("-DPDL_EARLY=") else d for d in defines())


# ---------------------------------------------------------------- programmatic dependent launch
PDL_MODES = ("off", "on", "early")
# Modules every kernel of which starts with pdl_entry() (or, the GEMVs, waits in gemv_loop after
# its weight prefetch): only these may be launched with the attribute (tests/gpu/test_pdl.py
# checks the sources). The rest (prefill-only kernels, packing) launch plainly.
PDL_MODULES = frozenset({"attention", "chain", "conv", "embed", "gdn", "gdn_decode", "gemv", "gemv2", "gemv_wg", "gemv_dp", "kv_rotated",
                         "norm", "rope", "sampling"})
_PDL_MODE: str | None = None


def pdl_mode() -> str:
    """EngineConfig.pdl (env Q27_PDL), read once; set_pdl_mode before the first compile changes it."""
    global _PDL_MODE
    if _PDL_MODE is None:
        from q27py.config import engine_env

        set_pdl_mode(engine_env().pdl)
    return _PDL_MODE


def set_pdl_mode(name: str) -> None:
    global _PDL_MODE
    if name not in PDL_MODES:
        raise ValueError(f"unknown pdl mode {name!r} (choose from {', '.join(PDL_MODES)})")
    _PDL_MODE = name


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, pad to 8, 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig (cuda.h)
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("nattrs", ctypes.c_uint)]


_ATTR_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION (value: x, y, z)
_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class PdlLauncher:
    """cuLaunchKernelEx with programmatic stream serialization and / or thread-block clusters,
    through ctypes on the driver library CuPy already loaded (no other binding needed). Graph
    captures use it for PDL (a captured launch becomes a programmatic edge, CUDA 12.3+), and any
    launch that needs clusters; other eager launches keep CuPy's call (the argument packing here
    costs host time)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self._launch = lib.cuLaunchKernelEx
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                 ctypes.c_void_p]
        self._attrs = (_LaunchAttribute * 2)()  # [programmatic serialization, cluster dims]
        self._attrs[0].id = _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        self._attrs[0].value[0] = 1
        self._attrs[1].id = _ATTR_CLUSTER_DIMENSION

    def launch(self, function_ptr: int, grid, block, args, shared_mem: int, stream_ptr: int, pdl: bool = True,
               cluster: int = 1) -> None:
        """pdl: with programmatic stream serialization; cluster > 1: thread-block clusters of that
        many consecutive CTAs along x (sm_90; the GEMV's DSMEM split-K reduction)."""
        # Each parameter is passed by address; the driver copies sizeof(parameter) bytes from it,
        # so a 64-bit slot read as a 32-bit int (little endian) still gives the value.
        vals = []
        for a in args:
            if isinstance(a, np.generic):
                vals.append(np.array(a))
            elif isinstance(a, (bool, int)):
                vals.append(np.array(a, dtype=np.int64))
            elif isinstance(a, float):
                vals.append(np.array(a, dtype=np.float64))
            else:  # a cupy array: its device address
                vals.append(np.array(a.data.ptr, dtype=np.uint64))
        params = (ctypes.c_void_p * max(1, len(vals)))(*[v.ctypes.data for v in vals])
        cfg = _LaunchConfig()
        cfg.grid[:] = grid + (1,) * (3 - len(grid))
        cfg.block[:] = block + (1,) * (3 - len(block))
        cfg.shared = int(shared_mem)
        cfg.stream = ctypes.c_void_p(int(stream_ptr))
        attrs = []
        if pdl:
            attrs.append(0)
        if cluster > 1:
            self._attrs[1].value[0], self._attrs[1].value[1], self._attrs[1].value[2] = int(cluster), 1, 1
            attrs.append(1)
        # the two attributes sit in one array: point at the first one used (both used: index 0)
        cfg.attrs = ctypes.pointer(self._attrs[attrs[0]]) if attrs else None
        cfg.nattrs = len(attrs)
        rc = self._launch(ctypes.byref(cfg), ctypes.c_void_p(int(function_ptr)), params, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")


_INCLUDE = re.compile(r'^#include "(\w+\.cuh)"[ \t]*$', re.M)


def source_text(name: str, path: Path | None = None) -> str:
    """The kernel source (cuda/<name>.cu, or `path`) with its cuda/*.cuh headers spliced in, each
    once (what NVRTC compiles: it is given one string, no include path)."""
    src = (path or CUDA_DIR / f"{name}.cu").read_text(encoding="utf-8")
    seen: set[str] = set()

    def splice(m: re.Match) -> str:
        if m.group(1) in seen:
            return ""
        seen.add(m.group(1))
        text = (CUDA_DIR / m.group(1)).read_text(encoding="utf-8").replace("#pragma once", "")
        return _INCLUDE.sub(splice, text)

    return _INCLUDE.sub(splice, src)


def nvrtc_cubin(name: str, options: tuple[str, ...], arch: str) -> Path:
    """Compile cuda/<name>.cu for `arch` with cuda-python's NVRTC binding (no CuPy in between: the
    target is exactly `arch`), write the cubin beside CuPy's cache and return its path."""
    import hashlib

    from cuda.bindings import nvrtc

    src = source_text(name)
    opts = tuple(options) + ("-ftz=true", "-default-device", f"--gpu-architecture={arch}")
    key = hashlib.sha256((src + "\0".join(opts)).encode()).hexdigest()[:24]
    out = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache")) / f"q27_{name}_{arch}_{key}.cubin"
    if out.exists():
        return out
    err, prog = nvrtc.nvrtcCreateProgram(src.encode(), f"{name}.cu".encode(), 0, [], [])
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcCreateProgram: {err}")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, n = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * n
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(log.decode(errors="replace")[-2000:])
        _, n = nvrtc.nvrtcGetCUBINSize(prog)
        cubin = b" " * n
        nvrtc.nvrtcGetCUBIN(prog, cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(cubin)
    tmp.replace(out)
    return out


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
        self._pdl_capture = False  # inside pdl_capture(): PDL_MODULES launch through PdlLauncher
        self._pdl_launcher: PdlLauncher | None = None
        self._prof: KernelProfile | None = None  # open profile_kernels(): an event after each eager launch

    @classmethod
    def get(cls) -> "Runtime":
        inst = cls._instance  # every kernel wrapper calls this: no lock once it exists
        if inst is not None:
            return inst
        with cls._lock:
            if cls._instance is None:
                cls._instance = Runtime()
            return cls._instance

    def module(self, name: str):
        mod = self._modules.get(name)
        if mod is None:
            arch = self.arch_target(name)
            if arch is None:
                mod = self.cp.RawModule(code=source_text(name), options=compile_options())
                mod.compile()
            else:
                mod = self._arch_module(name, arch)
            self._modules[name] = mod
        return mod

    def arch_target(self, name: str) -> str | None:
        """The architecture-specific target this card builds module `name` for (ARCH_SPECIFIC), or None."""
        return ARCH_SPECIFIC.get(name, {}).get(self.cc)

    def _arch_module(self, name: str, arch: str):
        """Module `name` built for `arch` (e.g. sm_90a). CuPy appends its own -arch=sm_<cc> after the
        caller's options, so which target wins depends on the NVRTC: the source turns a build that
        lost the "a" features into an #error (Q27_ARCH_SPECIFIC), and then the module is compiled
        through cuda-python's NVRTC binding and loaded as a cubin instead."""
        opts = compile_options() + ("-DQ27_ARCH_SPECIFIC", f"-arch={arch}")
        try:
            mod = self.cp.RawModule(code=source_text(name), options=opts)
            mod.compile()
            return mod
        except Exception as first:  # noqa: BLE001 -- any compile failure: try the direct route
            try:
                path = nvrtc_cubin(name, opts[:-1], arch)
            except Exception as second:  # noqa: BLE001
                raise RuntimeError(f"{name} for {arch}: CuPy ({first}); NVRTC ({second})") from None
            mod = self.cp.RawModule(path=str(path))
            mod.compile()
            return mod

    def fn(self, module: str, kernel: str):
        key = (module, kernel)
        f = self._functions.get(key)
        if f is None:
            f = self.module(module).get_function(kernel)
            self._functions[key] = f
        return f

    def launch(self, module: str, kernel: str, grid, block, args, shared_mem: int = 0, cluster: int = 1) -> None:
        """cluster > 1: launch as thread-block clusters of that many CTAs (sm_90+, grid divisible)."""
        grid = tuple(map(int, grid)) if isinstance(grid, tuple) else (int(grid),)
        block = tuple(map(int, block)) if isinstance(block, tuple) else (int(block),)
        if min(grid) <= 0:
            return
        args = tuple([_NULL if a is None else a for a in args])  # null pointers
        f = self.fn(module, kernel)
        if shared_mem > 48 * 1024:
            self._allow_shared(module, kernel, f, int(shared_mem))
        pdl = self._pdl_capture and module in PDL_MODULES
        if pdl or cluster > 1:
            assert cluster == 1 or (self.cc >= (9, 0) and grid[0] % cluster == 0), (cluster, grid)
            self._pdl().launch(f.kernel.ptr, grid, block, args, int(shared_mem), self.cp.cuda.get_current_stream().ptr,
                               pdl=pdl, cluster=cluster)
        else:
            f(grid, block, args, shared_mem=int(shared_mem))
        self.launches += 1
        if self._tally is not None:
            self._tally[(module, kernel)] += 1
        if self._prof is not None:
            self._prof.record(f"{module}:{kernel}")

    @property
    def pdl_supported(self) -> bool:
        """griddepcontrol needs sm_90; elsewhere the mode is ignored."""
        return self.cc >= (9, 0)

    def _pdl(self) -> PdlLauncher:
        if self._pdl_launcher is None:
            self._pdl_launcher = PdlLauncher()
        return self._pdl_launcher

    @contextmanager
    def pdl_capture(self, on: bool = True):
        """Inside: kernels of PDL_MODULES launch with programmatic dependent launch (GraphCache
        wraps its captures in this when the model's pdl mode is on and the card supports it)."""
        saved, self._pdl_capture = self._pdl_capture, bool(on) and self.pdl_supported
        try:
            yield
        finally:
            self._pdl_capture = saved

    @contextmanager
    def side_branch(self):
        """Forks a second stream from the current one (an event) and joins it back at exit (the current
        stream waits for the side's last launch): under graph capture, a branch of the graph. Yields
        on_side, a context whose launches go to the side stream; launches outside it stay on the current
        stream and run beside the side's (neither waits for the other before the join). For work that reads
        only what was complete at the fork and that nothing launched before the join reads (GemvPlan.run's
        first launch under constants GEMV_BRANCH: the GDN layer's bf16 decay / beta gates beside its q4 qkvz
        launch). The side's launches go without PDL (their dependency is the fork); the join is a full
        dependency. Same kernels, same arguments: the same bits.
        The join is at exit, after the main stream's launches: joining right after the side's launch would
        make the next main launch wait for it, the chain the branch is there to take away."""
        cp = self.cp
        main = cp.cuda.get_current_stream()
        if getattr(self, "_side", None) is None:
            self._side = cp.cuda.Stream(non_blocking=True)
        side = self._side
        fork = cp.cuda.Event(disable_timing=True)
        fork.record(main)
        side.wait_event(fork)

        @contextmanager
        def on_side():
            # Without PDL: with it (measured, docs/PERF.md twelfth session) the side's launch still started ~10 us after
            # the fork's kernel completed, as a captured cross-stream edge is a full one
            saved, self._pdl_capture = self._pdl_capture, False
            try:
                with side:
                    yield
            finally:
                self._pdl_capture = saved

        try:
            yield on_side
        finally:
            join = cp.cuda.Event(disable_timing=True)
            join.record(side)
            main.wait_event(join)

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

    @contextmanager
    def profile_kernels(self, stream=None):
        """Per-kernel device time of eager work: yields a KernelProfile whose .result (filled on exit,
        after one synchronize) maps "module:kernel" (and profile_mark labels) -> {"count", "ms"}, plus
        "flops" where marks gave them. stream: the stream the work runs on (default: the current
        one); the entry event is recorded there and only launches made while it is current are timed."""
        if self._prof is not None:
            raise RuntimeError("profile_kernels() is already open")
        prof = KernelProfile(self.cp, stream if stream is not None else self.cp.cuda.get_current_stream())
        self._prof = prof
        try:
            yield prof
        finally:
            self._prof = None
        prof.finish()

    def profile_mark(self, label: str, flops: float = 0) -> None:
        """Time the work enqueued since the previous event under `label` (cuBLAS calls and other
        non-launch() work) while profile_kernels() is open; a no-op otherwise."""
        if self._prof is not None:
            self._prof.record(label, flops)

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

    def warm_all(self, workers: int | None = None) -> None:
        """Compile every module now (startup), so no compile lands inside a timed region, a capture or
        a request. NVRTC runs outside the GIL, so the modules compile on `workers` threads (default:
        the CPU count, at most 8); a cold start on a fresh machine is the compile (CuPy's disk cache
        keeps the cubins for later processes)."""
        todo = [name for name in KERNEL_FILES if name not in self._modules]
        n = workers if workers is not None else min(8, os.cpu_count() or 1)
        if n <= 1 or len(todo) <= 1:
            for name in todo:
                self.module(name)
            return
        from concurrent.futures import ThreadPoolExecutor

        # the longest sources first, so the pool does not end waiting on one late big compile
        todo.sort(key=lambda name: -len(source_text(name)))
        with ThreadPoolExecutor(max_workers=min(n, len(todo))) as pool:
            for _ in pool.map(self.module, todo):
                pass

    def describe(self) -> dict:
        return {"name": self.name, "arch": self.arch, "sms": self.sm_count, "l2_bytes": self.l2_bytes,
                "total_mem": self.total_mem}


def profile_mark(label: str, flops: float = 0) -> None:
    """Runtime.profile_mark on the process's runtime if one exists (no Runtime.get(): the CPU tests
    stand a fake in for it, and a mark must never build one)."""
    rt = Runtime._instance
    if rt is not None and rt._prof is not None:
        rt._prof.record(label, flops)


class KernelProfile:
    """Runtime.profile_kernels()'s record: events[0] is recorded at entry, events[i + 1] right after
    the work labelled labels[i], so that label's time is elapsed(events[i], events[i + 1]). An
    interval holds whatever the stream ran since the previous event: besides the kernel itself,
    any CuPy op or copy enqueued before it, and idle time where the host fell behind; whatever ran
    after the last event is the "(tail)" entry. Elapsed times are read only in finish()."""

    TAIL = "(tail)"

    def __init__(self, cp, stream):
        self.cp = cp
        self.stream = stream
        self.labels: list[str] = []
        self.events: list = [self._event()]
        self.flops: Counter = Counter()  # label -> FLOPs the marks reported
        self.off_stream: Counter = Counter()  # launches on another stream (a side stream): not timed
        self.captured = 0  # launches recorded into a graph capture: not timed (no eager work)
        self.total_ms = 0.0
        self.result: dict[str, dict] | None = None

    def _event(self):
        ev = self.cp.cuda.Event()
        ev.record(self.stream)
        return ev

    def record(self, label: str, flops: float = 0) -> None:
        cur = self.cp.cuda.get_current_stream()
        if cur.is_capturing():
            self.captured += 1
            return
        if cur.ptr != self.stream.ptr:
            self.off_stream[label] += 1
            return
        self.events.append(self._event())
        self.labels.append(label)
        if flops:
            self.flops[label] += flops

    def finish(self) -> None:
        end = self._event()
        end.synchronize()
        elapsed = self.cp.cuda.get_elapsed_time
        res: dict[str, dict] = {}
        for label, a, b in zip(self.labels + [self.TAIL], self.events, self.events[1:] + [end]):
            r = res.setdefault(label, {"count": 0, "ms": 0.0})
            r["count"] += 1
            r["ms"] += elapsed(a, b)
        for label, f in self.flops.items():
            res[label]["flops"] = f
        self.total_ms = elapsed(self.events[0], end)
        self.result = res
        self.events = []  # the events are spent: give them back


def available() -> bool:
    try:
        Runtime.get()
        return True
    except GpuUnavailable:
        return False
