"""Runtime.profile_kernels' bookkeeping on the CPU (a stand-in CuPy whose events carry known
timestamps): each label gets the interval that ends at its own event, the first one measured from
the entry event; labels are summed per kernel; marks count as labels; nothing is recorded outside
the block, inside a graph capture or on another stream; one synchronize at exit. The device side
is tools/prefill_profile.py."""

from types import SimpleNamespace

import numpy as np
import pytest

from q27py.gpu import blas
from q27py.gpu import runtime as R


class Stream:
    def __init__(self, ptr, capturing=False):
        self.ptr, self.capturing = ptr, capturing

    def is_capturing(self):
        return self.capturing


class FakeCuda:
    """Events take their timestamps (ms) from `times` in record order."""

    def __init__(self, times):
        self.times = list(times)
        self.recorded, self.syncs = [], 0
        self.current = Stream(7)
        cuda = self

        class Event:
            def record(self, stream):
                self.t = cuda.times.pop(0)
                cuda.recorded.append(stream.ptr)

            def synchronize(self):
                cuda.syncs += 1

        self.Event = Event

    def get_current_stream(self):
        return self.current

    @staticmethod
    def get_elapsed_time(a, b):
        return b.t - a.t


def make_runtime(monkeypatch, times):
    cuda = FakeCuda(times)
    rt = object.__new__(R.Runtime)  # no device: only what launch() touches
    rt.cp = SimpleNamespace(cuda=cuda)
    rt._prof, rt._tally, rt._pdl_capture, rt.launches, rt._shared_set = None, None, False, 0, {}
    rt._functions = {(m, k): (lambda *a, **kw: None) for m, k in [("norm", "rmsnorm"), ("gemv", "gemv_q4"),
                                                                  ("gdn", "gdn_step")]}
    monkeypatch.setattr(R.Runtime, "_instance", rt)  # the module-level profile_mark finds it
    return rt, cuda


def test_intervals_end_at_their_own_event_and_sum_per_label(monkeypatch):
    # entry 0; rmsnorm ends 1; gemv 3; rmsnorm 6; mark 10; gdn 11; exit 15
    rt, cuda = make_runtime(monkeypatch, [0.0, 1.0, 3.0, 6.0, 10.0, 11.0, 15.0])
    rt.launch("norm", "rmsnorm", 1, 32, ())
    rt.profile_mark("cublas:gemm_bf16")  # outside: nothing
    assert cuda.recorded == [] and rt._prof is None
    with rt.profile_kernels() as prof:
        rt.launch("norm", "rmsnorm", 1, 32, ())
        rt.launch("gemv", "gemv_q4", 4, 128, ())
        rt.launch("norm", "rmsnorm", 1, 32, ())
        R.profile_mark("cublas:gemm_bf16", 2.0e9)  # the route blas.py takes
        rt.launch("gdn", "gdn_step", 2, 64, ())
        rt.launch("gdn", "gdn_step", 0, 64, ())  # an empty grid launches nothing: no event
    assert prof.result == {
        "norm:rmsnorm": {"count": 2, "ms": 1.0 + 3.0},
        "gemv:gemv_q4": {"count": 1, "ms": 2.0},
        "cublas:gemm_bf16": {"count": 1, "ms": 4.0, "flops": 2.0e9},
        "gdn:gdn_step": {"count": 1, "ms": 1.0},
        R.KernelProfile.TAIL: {"count": 1, "ms": 4.0},
    }
    assert prof.total_ms == 15.0 and sum(r["ms"] for r in prof.result.values()) == 15.0
    assert cuda.syncs == 1 and cuda.times == [] and rt._prof is None
    rt.launch("norm", "rmsnorm", 1, 32, ())  # closed again: nothing
    assert len(cuda.recorded) == 7


def test_captures_and_other_streams_are_not_timed(monkeypatch):
    rt, cuda = make_runtime(monkeypatch, [0.0, 2.0, 5.0])
    main = cuda.current
    with rt.profile_kernels(stream=main) as prof:
        cuda.current = Stream(7, capturing=True)  # a graph capture on the profiled stream
        rt.launch("gemv", "gemv_q4", 4, 128, ())
        cuda.current = Stream(9)  # a side stream
        rt.launch("gdn", "gdn_step", 2, 64, ())
        R.profile_mark("blas:expand")
        cuda.current = main
        rt.launch("norm", "rmsnorm", 1, 32, ())
    assert prof.result == {"norm:rmsnorm": {"count": 1, "ms": 2.0}, R.KernelProfile.TAIL: {"count": 1, "ms": 3.0}}
    assert prof.captured == 1 and prof.off_stream == {"gdn:gdn_step": 1, "blas:expand": 1}
    assert cuda.recorded == [7, 7, 7]


def test_an_error_closes_the_profile_and_nesting_is_refused(monkeypatch):
    rt, cuda = make_runtime(monkeypatch, [0.0, 1.0])
    with pytest.raises(ValueError):
        with rt.profile_kernels() as prof:
            with pytest.raises(RuntimeError):
                with rt.profile_kernels():
                    pass
            raise ValueError
    assert rt._prof is None and prof.result is None and cuda.syncs == 0


def test_blas_marks_its_cupy_expansion(monkeypatch):
    rt, cuda = make_runtime(monkeypatch, [0.0, 4.0, 4.5])
    m = SimpleNamespace(shape=SimpleNamespace(row_tiles=1, kpad=64))
    monkeypatch.setattr(blas.Runtime, "get", staticmethod(lambda: SimpleNamespace(cp=np)))
    monkeypatch.setattr(blas, "dequantize_to_bf16", lambda mat, out=None: np.zeros(16 * 64, np.uint16))
    out = np.zeros(2 * 16 * 64, np.uint16)
    with rt.profile_kernels() as prof:
        blas._expand_f32(m, out)
    assert prof.result["blas:expand"] == {"count": 1, "ms": 4.0}


def test_prefill_profile_families_cover_the_wgmma_modules():
    """tools/prefill_profile.py put the sm_90a modules' kernels under "other" (device run m1: the 8K
    prefill's attention family read 10.5 ms of the ~40 the v3 kernel took, and its TFLOP/s counted
    the combine alone)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "tools" / "prefill_profile.py"
    spec = importlib.util.spec_from_file_location("prefill_profile", path)
    pp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pp)
    assert pp.family("attention_prefill3:attn_prefill3_bf16_d256_ws") == "attention"
    assert "attention_prefill3" in pp.ATTN_PREFILL_MODULES
    assert pp.family("gemv_wg:gemv8w_q4_n8") == "gemm" and pp.family("norm:gated_rmsnorm") == "gdn"
    assert pp.family("norm:rmsnorm_rows_wide") == "norm" and pp.family("sampling:top2_final") == "other"
