"""The chunked (WY / UT) gated delta rule against the token-by-token reference (ops.gdn_recurrent).

Tolerance: the chunked form in fp32 against the recurrence in fp64 stays within the same
relative L2 error as the fp32 recurrence itself (both ~1e-6); the bar is 1e-5 relative on
outputs and on the final state, for chunk sizes 16/32/64, ragged first and last chunks and
strong decays (log-space cumulative sums, so e^{G_i - G_m} never overflows).
"""

from __future__ import annotations

import numpy as np
import pytest

from q27py.model import ops
from q27py.model.gdn_chunked import chunk_spans, gdn_chunked, gdn_chunked_wy


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def inputs(rng, t, h=2, hv=6, dk=32, dv=16, decay="normal"):
    q = ops.l2norm(rng.standard_normal((t, h, dk))) * dk ** -0.5
    k = ops.l2norm(rng.standard_normal((t, h, dk)))
    v = rng.standard_normal((t, hv, dv))
    if decay == "strong":  # some heads forget almost everything per token, some barely decay
        g = -np.exp(rng.standard_normal((t, hv)) * 2.0 + 1.0)
        g[:, 0] = -1e-4
    elif decay == "none":
        g = np.zeros((t, hv))
    else:
        g = -np.exp(rng.standard_normal((t, hv)) * 0.5) * 0.3
    beta = 1 / (1 + np.exp(-rng.standard_normal((t, hv))))
    s0 = rng.standard_normal((hv, dk, dv)) * 0.3
    return q, k, v, g, beta, s0


def f32(*xs):
    return [x.astype(np.float32) for x in xs]


def test_chunk_spans_align_to_absolute_positions():
    assert chunk_spans(0, 130, 64) == [(0, 64), (64, 64), (128, 2)]
    assert chunk_spans(5, 130, 64) == [(0, 59), (59, 64), (123, 7)]
    assert chunk_spans(64, 10, 64) == [(0, 10)]
    assert chunk_spans(63, 1, 64) == [(0, 1)]
    assert chunk_spans(0, 0, 64) == []
    for pos0 in (0, 1, 63, 64, 100):
        spans = chunk_spans(pos0, 300, 64)
        assert sum(n for _, n in spans) == 300
        assert all((pos0 + s) % 64 == 0 for s, _ in spans[1:])


@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("t,pos0", [(1, 0), (63, 0), (64, 0), (65, 0), (200, 0), (200, 37), (130, 64)])
@pytest.mark.parametrize("decay", ["normal", "strong", "none"])
def test_chunked_equals_recurrent(chunk, t, pos0, decay):
    rng = np.random.default_rng(1000 * chunk + t + pos0)
    q, k, v, g, beta, s0 = inputs(rng, t, decay=decay)
    o64, s64 = ops.gdn_recurrent(q, k, v, g, beta, s0)  # float64: the truth
    o32, s32 = ops.gdn_recurrent(*f32(q, k, v, g, beta, s0))
    oc, sc = gdn_chunked(*f32(q, k, v, g, beta, s0), chunk=chunk, pos0=pos0)
    assert oc.dtype == np.float32 and sc.dtype == np.float32
    assert oc.shape == o64.shape and sc.shape == s64.shape
    assert rel(oc, o64) < 1e-5 and rel(sc, s64) < 1e-5
    # the same tolerance class as the fp32 recurrence itself
    assert rel(oc, o64) < 10 * rel(o32, o64) + 1e-6
    # in float64 the two forms agree to rounding
    oc64, sc64 = gdn_chunked(q, k, v, g, beta, s0, chunk=chunk, pos0=pos0)
    assert rel(oc64, o64) < 1e-12 and rel(sc64, s64) < 1e-12


def test_input_state_is_not_modified():
    rng = np.random.default_rng(3)
    q, k, v, g, beta, s0 = f32(*inputs(rng, 70))
    keep = s0.copy()
    gdn_chunked(q, k, v, g, beta, s0)
    np.testing.assert_array_equal(s0, keep)


def test_pieces_split_at_chunk_boundaries_are_bitwise_one_run():
    """Why chunks align to absolute positions: a prefill split into pieces at multiples of C (a
    restore from a snapshot taken there) computes the very same chunks, so the same bits."""
    rng = np.random.default_rng(4)
    q, k, v, g, beta, s0 = f32(*inputs(rng, 300))
    o_all, s_all = gdn_chunked(q, k, v, g, beta, s0, chunk=64, pos0=0)
    o1, s1 = gdn_chunked(q[:128], k[:128], v[:128], g[:128], beta[:128], s0, chunk=64, pos0=0)
    o2, s2 = gdn_chunked(q[128:], k[128:], v[128:], g[128:], beta[128:], s1, chunk=64, pos0=128)
    np.testing.assert_array_equal(np.concatenate([o1, o2]), o_all)
    np.testing.assert_array_equal(s2, s_all)
    # a split inside a chunk (restore at an arbitrary position) differs only at rounding level
    o1, s1 = gdn_chunked(q[:100], k[:100], v[:100], g[:100], beta[:100], s0, chunk=64, pos0=0)
    o2, s2 = gdn_chunked(q[100:], k[100:], v[100:], g[100:], beta[100:], s1, chunk=64, pos0=100)
    assert rel(np.concatenate([o1, o2]), o_all) < 1e-5 and rel(s2, s_all) < 1e-5


def test_agrees_with_the_cpu_fast_path_form():
    """fastcpu.gdn_chunked (helper `default`, the CPU fast path) derives the same form with a
    batched inverse and chunks from the run's first token: the same map within fp32 rounding."""
    from q27py.model.fastcpu import gdn_chunked as fast_chunked

    rng = np.random.default_rng(5)
    q, k, v, g, beta, s0 = f32(*inputs(rng, 150, decay="strong"))
    o1, s1 = gdn_chunked(q, k, v, g, beta, s0, chunk=64, pos0=0)
    o2, s2 = fast_chunked(q, k, v, g, beta, s0, chunk=64)
    assert rel(o1, o2) < 1e-5 and rel(s1, s2) < 1e-5


def test_round_tf32_is_the_kernels_rna():
    """round_tf32 keeps 10 mantissa bits, nearest with ties away from zero (cuda/gdn_chunk2.cu to_tf32), and leaves
    TF32 values (and zeros) alone."""
    from q27py.model.gdn_chunked import round_tf32

    ulp = 2.0 ** -10
    x = np.array([1.0, 1 + ulp / 2, 1 + ulp / 4, 1 + 3 * ulp / 4, -(1 + ulp / 2), -1 - ulp, 0.0, -0.0, 3.5],
                 np.float32)
    want = np.array([1.0, 1 + ulp, 1.0, 1 + ulp, -(1 + ulp), -1 - ulp, 0.0, -0.0, 3.5], np.float32)
    np.testing.assert_array_equal(round_tf32(x).view(np.uint32), want.view(np.uint32))
    r = round_tf32(np.random.default_rng(0).standard_normal(1000).astype(np.float32))
    assert not (r.view(np.uint32) & 0x1FFF).any()


def test_tf32_phases_are_checked():
    rng = np.random.default_rng(1)
    t, h, hv, dk, dv = 10, 1, 1, 8, 8
    q, k = rng.standard_normal((t, h, dk)), rng.standard_normal((t, h, dk))
    v, g, b = rng.standard_normal((t, hv, dv)), -np.abs(rng.standard_normal((t, hv))), np.full((t, hv), 0.5)
    s0 = np.zeros((hv, dk, dv))
    with pytest.raises(ValueError, match="float32"):
        gdn_chunked_wy(q, k, v, g, b, s0, tf32=("state",))
    args = [a.astype(np.float32) for a in (q, k, v, g, b, s0)]
    with pytest.raises(ValueError, match="phases"):
        gdn_chunked_wy(*args, tf32=("solve",))
    o, s = gdn_chunked_wy(*args, tf32=("prep", "state", "out"))
    o0, s0_ = gdn_chunked_wy(*args)
    assert o.dtype == np.float32 and 0 < np.abs(o - o0).max() < 1e-2
