"""Host cost of one eager kernel launch through Runtime.launch, on any machine (no GPU): the wrapper
and a typical 16-argument tuple (i32 / i64 scalars, pointers, a null), with a stub standing in for
CuPy's kernel call, so CuPy's own marshalling is not counted.

    PYTHONPATH=. python3 tools/launch_overhead.py [--n 200000]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from q27py.gpu.runtime import Runtime, i32, i64

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200000)
    n = ap.parse_args().n
    rt = object.__new__(Runtime)  # no device: only the fields launch() reads
    rt._functions, rt._modules, rt._shared_set = {}, {}, {}
    rt.launches, rt._tally, rt._pdl_capture, rt._pdl_launcher, rt.cc = 0, None, False, None, (9, 0)
    rt._prof = None  # no profile_kernels session
    rt._functions[("gdn", "k")] = lambda grid, block, args, shared_mem=0: None
    saved, Runtime._instance = Runtime._instance, rt
    a = object()  # stands in for a device array

    def args():
        return (a, i64(0), a, i64(0), a, i64(0), a, i32(6144), i32(16), i32(48), i32(128), i32(128), i32(1), None,
                i32(1), i32(0))

    def call():
        Runtime.get().launch("gdn", "k", (192, 1), 128, args())

    try:
        t_all = timeit.timeit(call, number=n) / n * 1e6
        t_args = timeit.timeit(args, number=n) / n * 1e6
    finally:
        Runtime._instance = saved
    print(f"launch wrapper + arguments: {t_all:.2f} us per launch (arguments alone {t_args:.2f} us)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
