"""The kernel-argument helpers (q27py/gpu/runtime.py i32 / i64): cached numpy scalars give the
values and types np.int32 / np.int64 would, for Python and numpy ints, floats, bools and unhashable
0-d arrays, and overflow still raises."""

import numpy as np
import pytest

from q27py.gpu import runtime as R


@pytest.mark.parametrize("fn, t", [(R.i32, np.int32), (R.i64, np.int64)])
def test_cached_scalars_equal_fresh_ones(fn, t):
    for v in (0, 1, -7, 6144, np.int64(5120), np.int32(3), True, 2.7, np.array(9)):
        got = fn(v)
        assert type(got) is t and got == t(v)
        assert fn(v) == got  # again (from the cache where hashable)
    assert fn(12345) is fn(12345)  # built once
    with pytest.raises(OverflowError):
        R.i32(2**31)


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(R, "_I64", {})
    monkeypatch.setattr(R, "_SCALAR_CACHE_MAX", 8)
    for v in range(100):
        assert R.i64(v) == v
    assert len(R._I64) == 8
