"""blas.ExpansionCache's bookkeeping on the CPU (stand-in allocation and expansion): admission in
first-use order until the budget is full, hits without a second expansion, bytes freed with the
matrix, a failed allocation stopping admission; and the config / budget plumbing. The device bits
are tests/gpu/test_prefill_blas.py::test_resident_expansions_give_the_same_bits."""

import gc
from types import SimpleNamespace

import numpy as np
import pytest

from q27py.config import ConfigError, Q27Config, apply_env
from q27py.gpu import blas


class Mat:
    def __init__(self, row_tiles, kpad):
        self.shape = SimpleNamespace(row_tiles=row_tiles, kpad=kpad)


def make(budget, fail_after=None):
    expanded, allocs = [], []

    def alloc(n):
        if fail_after is not None and len(allocs) >= fail_after:
            return None
        allocs.append(n)
        return np.zeros(n // 2, np.uint16)

    def expand(m, out):
        expanded.append(id(m))  # ids only: a list of the matrices would keep them alive
        out[:] = id(m) & 0xFFFF

    return blas.ExpansionCache(budget, alloc=alloc, expand=expand), expanded, allocs


def test_admits_until_full_and_hits_without_expanding_again():
    a, b, c = Mat(2, 64), Mat(4, 64), Mat(1, 64)  # 4096, 8192, 2048 bytes
    cache, expanded, _ = make(4096 + 8192)
    wa, wb = cache.get(a), cache.get(b)
    assert wa is not None and wb is not None and cache.used == 12288
    assert cache.get(c) is None  # no room left: the scratch route
    assert cache.get(a) is wa and cache.get(b) is wb  # resident: the same buffer, no new expansion
    assert expanded == [id(a), id(b)] and (cache.hits, cache.misses) == (2, 3) and len(cache) == 2


def test_a_freed_matrix_frees_its_bytes():
    cache, _, _ = make(10**6)
    a = Mat(2, 64)
    cache.get(a)
    assert cache.used == 4096
    del a
    gc.collect()
    assert cache.used == 0 and len(cache) == 0


def test_a_failed_allocation_stops_admission():
    cache, expanded, allocs = make(10**6, fail_after=1)
    a, b, c = Mat(1, 64), Mat(1, 64), Mat(1, 64)
    assert cache.get(a) is not None
    assert cache.get(b) is None and cache.full
    assert cache.get(c) is None and len(allocs) == 1  # no further attempt once full
    assert cache.get(a) is not None  # what is resident still serves


def test_budget_and_config():
    assert blas.weight_cache_budget(0, 10**12) == 0
    assert blas.weight_cache_budget(2.0, 10**12) == 2 << 30
    assert blas.weight_cache_budget(100.0, 5 << 30) == 5 << 30  # never more than every expansion
    cfg = apply_env(Q27Config(), {"Q27_PREFILL_WEIGHT_CACHE_GB": "54"})
    assert cfg.engine.prefill_weight_cache_gb == 54.0
    assert Q27Config().engine.prefill_weight_cache_gb == 0.0  # off by default
    for bad in (-1, "lots", True):
        e = Q27Config().engine
        e.prefill_weight_cache_gb = bad
        with pytest.raises(ConfigError):
            e.check_batching()
