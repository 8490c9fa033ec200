"""tools/step_trace.py (a captured step's launch timeline from STEP_TRACE stamps): its grouping and summary on the
CPU, and the stamps' build; the device run itself is a tool, not a test (docs/PERF.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import step_trace as T  # noqa: E402


def _rec(gid, t_open, t_rel, sm):
    return [gid, t_open, t_rel, sm]


def test_group_orders_by_gridid_and_measures_the_boundaries():
    """Three launches (gridids out of record order, CTAs recorded interleaved): each one's open / release / last,
    its SMs, busy = the next launch's release minus its own, the labels from the capture's sequence, and a record
    whose CTA never left its wait (t_released 0) dropped."""
    ns = 1000  # 1 us
    recs = np.array([
        _rec(7, 10 * ns, 20 * ns, 0), _rec(5, 0, 2 * ns, 0), _rec(7, 12 * ns, 30 * ns, 1), _rec(5, 1 * ns, 3 * ns, 1),
        _rec(9, 25 * ns, 45 * ns, 2), _rec(9, 26 * ns, 0, 3),
    ], dtype=np.uint64)
    ls = T.group(recs, ["norm:rmsnorm_rows_a8", "gemv_wg:gemv8w_q4_n8", "gdn_decode:gdn_decode_fused"])
    assert [x.gridid for x in ls] == [5, 7, 9]
    a, b, c = ls
    assert (a.ctas, a.open, a.release, a.last, a.sms) == (2, 0.0, 2.0, 3.0, 2)
    assert (b.ctas, b.open, b.release, b.last, b.sms) == (2, 10.0, 20.0, 30.0, 2)
    assert (c.ctas, c.release, c.last) == (1, 45.0, 45.0)
    assert (a.busy, b.busy, c.busy) == (18.0, 25.0, 0.0)
    assert [x.name for x in ls] == ["norm:rmsnorm_rows_a8", "gemv_wg:gemv8w_q4_n8", "gdn_decode:gdn_decode_fused"]
    assert [x.name for x in T.group(recs, ["only one"])] == ["?", "?", "?"]  # counts disagree: no labels
    s = T.summary(ls)
    assert s["span_us"] == 45.0 and s["launches"] == 3
    assert s["families"]["gemv"] == {"busy_us": 25.0, "launches": 1}
    assert list(s["families"])[0] == "gemv"  # the most busy first
    assert T.group(np.zeros((0, 4), np.uint64)) == []


def test_align_labels_by_cta_count_past_unstamped_launches():
    """Captured launches that left no stamps (here a 0-CTA grid and a 7-CTA kernel without a wait) are skipped:
    each traced launch takes the next captured one of its CTA count; a count never captured fails the labelling."""
    ls = [T.Launch(i, c, 0.0, 0.0, 0.0, 1) for i, c in enumerate((1, 20, 256))]
    seq = [("norm:rmsnorm_rows_a8", 1), ("gemv:quant_act8", 0), ("gemv:gemv_bf16_nt1", 20), ("x:unstamped", 7),
           ("gemv_wg:gemv8w_q4_n8", 256)]
    assert T.align(ls, seq)
    assert [x.name for x in ls] == ["norm:rmsnorm_rows_a8", "gemv:gemv_bf16_nt1", "gemv_wg:gemv8w_q4_n8"]
    assert not T.align([T.Launch(0, 5, 0.0, 0.0, 0.0, 1)], seq)


def test_label_modules_keeps_each_modules_labels_to_itself():
    """Records read per module: a module's unstamped launch (gemv's 20-CTA bf16 GEMV here, no records) shifts no
    other module's labels, even where a CTA count repeats across modules (gemv_wg's 1-CTA launch beside norm's);
    the launches merge in %gridid order with busy across modules, times from the earliest record of any module."""
    ns = 1000
    parts = {
        "norm": np.array([_rec(1, 0, 1 * ns, 0), _rec(5, 20 * ns, 22 * ns, 0)], np.uint64),
        "gemv_wg": np.array([_rec(3, 2 * ns, 4 * ns, 1), _rec(3, 2 * ns, 5 * ns, 2), _rec(6, 23 * ns, 30 * ns, 3)],
                            np.uint64),
        "gemv": np.array([_rec(4, 5 * ns, 12 * ns, 4)], np.uint64),
    }
    seq = [("norm:rmsnorm_rows_a8", 1), ("gemv:gemv_bf16_nt1", 20), ("gemv_wg:gemv8w_q4_n8d", 2),
           ("gemv:quant_act8", 1), ("norm:rmsnorm_rows", 1), ("gemv_wg:lm_head", 1)]
    ls, ok = T.label_modules(parts, seq)
    assert ok
    assert [(x.gridid, x.name) for x in ls] == [(1, "norm:rmsnorm_rows_a8"), (3, "gemv_wg:gemv8w_q4_n8d"),
                                                (4, "gemv:quant_act8"), (5, "norm:rmsnorm_rows"),
                                                (6, "gemv_wg:lm_head")]
    assert [x.release for x in ls] == [1.0, 4.0, 12.0, 22.0, 30.0]
    assert [x.busy for x in ls] == [3.0, 8.0, 10.0, 8.0, 0.0]
    # a module whose records cannot be matched to its part of the sequence is reported
    bad = dict(parts, gemv=np.array([_rec(4, 5 * ns, 12 * ns, 4), _rec(4, 5 * ns, 12 * ns, 5)], np.uint64))
    assert T.label_modules(bad, seq)[1] is False
    assert T.label_modules({"norm": np.zeros((0, 4), np.uint64)}, seq) == ([], True)


def test_compare_lists_each_kernels_busy_side_by_side(tmp_path):
    """--compare: per kernel name, launches x mean busy = total in each run; a kernel missing from a run shows 0."""
    import json

    def run(path, rows):
        ls = [T.Launch(i, 1, 0.0, float(i), float(i), 1, name, busy) for i, (name, busy) in enumerate(rows)]
        path.write_text(json.dumps({"summary": T.summary(ls), "launches": [x.__dict__ for x in ls]}))
        return str(path)

    a = run(tmp_path / "a.json", [("gemv:quant_act8", 3.0), ("gemv_wg:n8", 20.0), ("gemv:quant_act8", 5.0)])
    b = run(tmp_path / "b.json", [("gemv_wg:n8", 22.0)])
    out = T.compare([a, b]).splitlines()
    row = next(x for x in out if x.startswith("gemv:quant_act8"))
    assert "2 x   4.0 =       8" in row and "0 x   0.0 =       0" in row
    assert T.by_kernel([T.Launch(0, 1, 0, 0, 0, 1, "k", 2.0), T.Launch(1, 1, 0, 0, 0, 1, "k", 1.0)]) == {"k": (2, 3.0)}


@pytest.mark.parametrize("name,fam", [("gemv_wg:gemv8w_q4_n8", "gemv"), ("gemv:quant_act8", "quant"),
                                      ("gemv:gemv8_q4_nt1", "gemv"), ("norm:rmsnorm_rows_a8", "norm"),
                                      ("norm:gated_rmsnorm", "gdn"), ("attention:attn_decode", "attention")])
def test_family(name, fam):
    assert T.family(name) == fam


def test_the_stamps_build_and_vanish_when_off(tmp_path, monkeypatch):
    """norm.cu with STEP_TRACE = 1 builds for sm_90 and holds the trace buffer; with 0 (the default) there is none."""
    import nvcc_build
    from q27py.gpu import constants as C

    if nvcc_build.NVCC is None:
        pytest.skip("nvcc not installed")
    assert C.STEP_TRACE == 0
    for on in (0, 1):
        monkeypatch.setattr(C, "STEP_TRACE", on)
        d = tmp_path / f"t{on}"
        d.mkdir()
        rc, err = nvcc_build.build(d, "norm", "sm_90")
        assert rc == 0, err[-2000:]
        cubin = (d / "norm_sm_90.cubin").read_bytes()
        assert (b"q27_trace_n" in cubin) == bool(on)
