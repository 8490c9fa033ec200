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
    assert apply_env(Q27Config(), {"Q27_PREFILL_WEIGHT_CACHE_GB": "Auto"}).engine.prefill_weight_cache_gb == "auto"
    assert Q27Config().engine.prefill_weight_cache_gb == "auto"  # sized with the slots by default
    assert blas.weight_cache_budget("auto", 10**12) == 0  # direct builds: off until configure_memory sizes it
    with pytest.raises(ValueError):
        apply_env(Q27Config(), {"Q27_PREFILL_WEIGHT_CACHE_GB": "-3"})
    for bad in (-1, "lots", True):
        e = Q27Config().engine
        e.prefill_weight_cache_gb = bad
        with pytest.raises(ConfigError):
            e.check_batching()


# ---------------------------------------------------------------- "auto": sized with the slots
GIB = 1 << 30


def _sized(free: int, expansions: int, monkeypatch, **engine):
    """size_context_to_memory on a stand-in 27B (bf16 KV, the real plan_slots) with `free` bytes free
    and `expansions` bytes of bf16 expansions; returns (slot plan, the cache budget set)."""
    from types import SimpleNamespace

    from q27py.config import EngineConfig
    from q27py.gpu import forward
    from q27py.model import kvformat as F
    from q27py.model.config import qwen36_27b_config

    monkeypatch.setattr(blas, "_WEIGHT_CACHE", None)  # restored after the test
    monkeypatch.setattr(blas, "_WEIGHT_CACHE_SET", True)
    monkeypatch.setattr(forward, "expansions_bytes", lambda _w: expansions)
    cp = SimpleNamespace(get_default_memory_pool=lambda: SimpleNamespace(free_all_blocks=lambda: None),
                         cuda=SimpleNamespace(runtime=SimpleNamespace(memGetInfo=lambda: (free, 141 * GIB))))
    kv = F.bytes_per_token("bf16", F.Q27B_KV_LAYERS, F.Q27B_KV_HEADS, F.Q27B_HEAD_DIM)
    cfg = qwen36_27b_config()
    model = SimpleNamespace(rt=SimpleNamespace(cp=cp), kv_name="bf16", max_pos=cfg.max_position_embeddings, cfg=cfg,
                            has_mtp=True, max_batch=16, verify_lanes=0, mtp_batch_lanes=0, w=None,
                            memory_per_sequence=lambda positions: (150 << 20) + positions * kv)
    forward.configure_memory(model, EngineConfig(**engine))
    cache = blas.weight_cache()
    return model.slot_plan, (cache.budget if cache is not None else 0)


def test_auto_cache_takes_only_the_extra_slots(monkeypatch):
    """A card with room: the cache gets every expansion, the window and the kept states
    (max(max_sequences, the floor)) stay what they are without it; only extra slots give way."""
    off, none = _sized(140 * GIB, 54 * GIB, monkeypatch, prefill_weight_cache_gb=0)
    auto, budget = _sized(140 * GIB, 54 * GIB, monkeypatch)
    assert none == 0 and budget == 54 * GIB
    assert auto.budget.window == off.budget.window
    assert 4 <= auto.slots < off.slots  # EngineConfig.max_sequences = 4 states kept
    assert auto.budget.reserved_bytes > off.budget.reserved_bytes


def test_auto_cache_is_the_remainder_or_nothing(monkeypatch):
    """Where all of it does not fit, the cache is exactly what the kept states leave (the window
    unchanged); a card with no room past them gets no more than the window's rounding left, and the plan it had."""
    off, _ = _sized(80 * GIB, 54 * GIB, monkeypatch, prefill_weight_cache_gb=0)
    part, budget = _sized(80 * GIB, 54 * GIB, monkeypatch)
    assert 0 < budget < 54 * GIB
    assert part.budget.window == off.budget.window and part.slots == 4
    small_off, _ = _sized(12 * GIB, 54 * GIB, monkeypatch, prefill_weight_cache_gb=0)
    small, budget = _sized(12 * GIB, 54 * GIB, monkeypatch)
    # what is left is the window's alignment slack at most (under one 1,024-position step per state)
    assert budget < 4 * 1024 * small.budget.bytes_per_token
    assert small.budget.window == small_off.budget.window and small.slots == small_off.slots


def test_auto_cache_beside_fixed_slots_and_window(monkeypatch):
    """Both --max-context and --max-slots fixed: no sizing, the cache takes what the fixed states leave."""
    from q27py.model.kvbudget import batch_graph_reserve

    from q27py.config import EngineConfig
    from q27py.gpu import forward
    from types import SimpleNamespace

    monkeypatch.setattr(blas, "_WEIGHT_CACHE", None)
    monkeypatch.setattr(blas, "_WEIGHT_CACHE_SET", True)
    monkeypatch.setattr(forward, "expansions_bytes", lambda _w: 54 * GIB)
    free = 100 * GIB
    cp = SimpleNamespace(get_default_memory_pool=lambda: SimpleNamespace(free_all_blocks=lambda: None),
                         cuda=SimpleNamespace(runtime=SimpleNamespace(memGetInfo=lambda: (free, 141 * GIB))))
    from q27py.model.config import qwen36_27b_config

    model = SimpleNamespace(rt=SimpleNamespace(cp=cp), max_pos=32768, cfg=qwen36_27b_config(), has_mtp=True,
                            max_batch=16, verify_lanes=0, mtp_batch_lanes=0, w=None, memory_per_sequence=lambda positions: 8 * GIB)
    e = EngineConfig(max_context=32768, max_slots=6)
    forward.configure_memory(model, e)
    want = free - 6 * (8 * GIB + forward.graph_bytes_per_state(model, e)) - batch_graph_reserve(16) - e.kv_safety_margin_bytes
    assert blas.weight_cache().budget == want
    e = EngineConfig(max_context=32768, max_slots=16)  # 16 states of 8 GiB leave nothing
    forward.configure_memory(model, e)
    assert blas.weight_cache() is None


def test_model_weights_list_every_prefill_matrix():
    """ModelWeights.matrices(): what load_fast_model sizes the cache from (before, it called a method
    ModelWeights did not have, so every CUDA load died with an AttributeError: run f3)."""
    from types import SimpleNamespace

    from q27py.gpu import forward
    from q27py.gpu import layout as L
    from q27py.gpu.weights import AttnW, GdnW, LayerW, ModelWeights, MtpW

    def mat(rows, fmt=L.FMT_Q4):
        return SimpleNamespace(shape=SimpleNamespace(fmt=fmt, group=L.DEFAULT_GROUP[fmt], row_tiles=rows // 16, kpad=64))

    def attn_layer():
        return LayerW("full_attention", None, None, mat(32), mat(16), attn=AttnW(mat(16), mat(32), mat(16), None, None))

    gdn = LayerW("linear_attention", None, None, mat(32), mat(16),
                 gdn=GdnW(mat(48), mat(16, L.FMT_BF16), mat(16), None, None, None, None))
    w = ModelWeights(None, "q4s", None, None, mat(64), [gdn, attn_layer()], MtpW(mat(16, L.FMT_Q8), None, None, None, attn_layer()))
    mats = w.matrices()
    assert len(mats) == 5 + 5 + 1 + 5 and all(m is not w.lm_head for m in mats)
    # the bf16 gate matrix stays on the GEMV: no expansion for it
    want = sum(m.shape.row_tiles * 16 * 64 * 2 for m in mats if m.shape.fmt != L.FMT_BF16)
    assert forward.expansions_bytes(w) == want == (32 + 16 + 48 + 16) * 128 + 2 * (32 + 16 + 16 + 32 + 16) * 128 + 16 * 128


def test_fp32_copies_ride_the_same_cache(monkeypatch):
    """prefill_gemm_f32's weights (blas.weights_f32): the bf16 bits widened exactly to fp32, made once
    and kept in an ExpansionCache sized by their own bytes, or made in the scratch each call when no
    allocation succeeds. numpy stands in for CuPy (same slicing and view semantics)."""
    from q27py.gpu import layout as L

    rng = np.random.default_rng(3)
    m = Mat(2, 64)
    m.shape.fmt, m.mode = L.FMT_BF16, 0
    bits = L.bf16_bits(rng.standard_normal((32, 64)).astype(np.float32)).reshape(-1)
    calls = []

    def dequant(mat, out=None):
        calls.append(mat)
        return bits.copy()

    class Scratch:
        def get(self, name, nbytes):
            return np.zeros(nbytes // 2 + 8, np.uint16)

    monkeypatch.setattr(blas, "dequantize_to_bf16", dequant)
    monkeypatch.setattr(blas, "_SCRATCH", Scratch())
    monkeypatch.setattr(blas.Runtime, "get", staticmethod(lambda: SimpleNamespace(cp=np)))
    want = L.bf16_to_f32(bits.reshape(32, 64))
    for room in (True, False):
        cache = blas.ExpansionCache(1 << 40, alloc=(lambda n: np.zeros(n // 2 + 8, np.uint16)) if room else (lambda n: None),
                                    expand=blas._expand_f32, size=blas._f32_bytes)
        monkeypatch.setattr(blas, "_F32_CACHE", cache)
        calls.clear()
        for _ in range(2):
            w = blas.weights_f32(m)
            assert w.dtype == np.float32 and w.shape == (32, 64)
            np.testing.assert_array_equal(w, want)
        assert len(calls) == (1 if room else 2)
        assert cache.used == (32 * 64 * 4 if room else 0)


def test_serves_predicts_get_without_side_effects(monkeypatch):
    """The resident route's choice (blas.resident_route) asks serves(), which must say what get()
    would do (held, or admitted now) and change nothing: the route of a 32-127-token chunk then does
    not depend on which requests ran before while the cache has room."""
    a, b, c = Mat(2, 64), Mat(4, 64), Mat(1, 64)  # 4096, 8192, 2048 bytes
    cache, expanded, _ = make(4096 + 8192)
    assert cache.serves(a) and cache.serves(b) and cache.serves(c)
    assert expanded == [] and cache.used == 0 and (cache.hits, cache.misses) == (0, 0)
    cache.get(a), cache.get(b)
    assert cache.serves(a) and not cache.serves(c)  # held / no room left
    monkeypatch.setattr(blas, "_WEIGHT_CACHE", cache)
    monkeypatch.setattr(blas, "_WEIGHT_CACHE_SET", True)
    assert blas.resident_route(a, blas.MIN_TOKENS_RESIDENT) and blas.resident_route(a, blas.MIN_TOKENS - 1)
    assert not blas.resident_route(a, blas.MIN_TOKENS_RESIDENT - 1), "short chunks keep the GEMM kernel"
    assert not blas.resident_route(a, blas.MIN_TOKENS), "long chunks take cuBLAS anyway"
    assert not blas.resident_route(c, 64), "a matrix the cache cannot serve keeps the kernel"
    monkeypatch.setattr(blas, "_WEIGHT_CACHE", None)
    assert not blas.resident_route(a, 64)
