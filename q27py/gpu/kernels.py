"""Typed Python entry points for the kernels in cuda/ (one function per kernel or fused step).

Every function enqueues on CuPy's current stream and returns immediately; nothing here
synchronizes, so the calls can be recorded into a CUDA graph. Arrays are cupy arrays;
activations are fp32 with a row stride (`ld`) per lane.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from q27py.gpu import constants as C
from q27py.gpu import layout as L
from q27py.gpu.runtime import ARCH_SPECIFIC, Runtime, f32, i32, i64, ptr, u64
from q27py.model.kvformat import KV_FORMATS

# Kernel constants live in one table (q27py/gpu/constants.py) that the CUDA sources are compiled
# with; the names below are that table's values, re-exported for callers.
MODE_STORE, MODE_ADD, MODE_SWIGLU = C.MODE_STORE, C.MODE_ADD, C.MODE_SWIGLU
GEMV_R = C.GEMV_R  # row tiles per row group
GEMV_ROWS_PER_CTA = 16 * GEMV_R  # rows of one row group (v1: one CTA)
GEMV_CTAS_PER_SM = {1: C.V1_CTAS_NT1, 2: C.V1_CTAS_NT2}  # v1: resident CTAs of 8 warps by lane tiles
GEMV_MAX_LANES = C.GEMV_MAX_LANES
GWG_MAX_LANES = C.GWG_MAX_LANES  # lanes of one gemv_wg launch (gemv8w_q4_n32)
D_NFIELDS = C.D_NFIELDS
ATT_NSPLIT = C.NSPLIT
ATT_WARPS = C.ATT_WARPS
TOP2_BLOCKS = C.TOP2_BLOCKS
TAB_F32, TAB_BF16, TAB_Q8 = C.TAB_F32, C.TAB_BF16, C.TAB_Q8
# "v1" cuda/gemv.cu, "v2" cuda/gemv2.cu, "a8": v1's kernels with int8 activations for q4/q8 weights
# (quant_act8 + gemv8_*; its own tolerance class, docs/QUANT.md "a8"); bf16 weights stay on v1 there
GEMV_IMPLS = ("v1", "v2", "a8")


@dataclass
class GpuMatrix:
    """A packed matrix on the device (codes + scale pairs) and how the GEMV writes it."""

    shape: L.MatrixShape
    codes: object  # cupy uint8
    scales: object | None  # cupy uint32, None for bf16
    mode: int = MODE_STORE
    out_rows: int | None = None  # rows written (SwiGLU: the inner size)
    fp8_exp: int | None = None  # the fp8 prefill route's weight exponent, once computed (blas.weight_fp8_exponent)

    @property
    def row_groups(self) -> int:
        return -(-self.shape.row_tiles // GEMV_R)

    @property
    def nout(self) -> int:
        if self.out_rows is not None:
            return self.out_rows
        return self.shape.rows

    @property
    def nbytes(self) -> int:
        return self.shape.code_bytes + self.shape.scale_bytes


def upload_packed(pm: L.PackedMatrix, mode: int = MODE_STORE, out_rows: int | None = None) -> GpuMatrix:
    cp = Runtime.get().cp
    scales = cp.asarray(pm.scales) if pm.shape.fmt != L.FMT_BF16 else None
    return GpuMatrix(pm.shape, cp.asarray(pm.codes), scales, mode, out_rows)


def choose_splits(row_groups: int, kchunks: int, sm_count: int, ctas_per_sm: int = 0) -> int:
    """v1 split-K count from the matrix shape only (never the lane count: lane bits stay width-invariant).

    Units (row group x split, one CTA each) should fill the resident CTAs about once (2 per SM
    for 8-lane launches), each keeping >= 8 chunks of K (one per warp). ctas_per_sm (split_ctas_per_sm):
    the most splits whose units still fit one wave of that many CTAs per SM (round() may overshoot a
    wave by a few units, which then run as a thin second one).
    """
    if ctas_per_sm:
        want = ctas_per_sm * sm_count // max(row_groups, 1)
    else:
        want = round(GEMV_CTAS_PER_SM[1] * sm_count / max(row_groups, 1))
    return int(max(1, min(want, kchunks // 8)))


def split_ctas_per_sm(impl: str, fmt: int, tail: bool = False, kchunks: int = 0) -> int:
    """Resident CTAs per SM a matrix's splits are sized for (choose_splits / tail_split): GEMV_SPLIT_CTAS
    (tail: GEMV_TAIL_CTAS) for a8 q4 matrices on a card with cuda/gemv_wg.cu's sm_90a build (its 3-CTA entries
    run them), else 0 (the v1 / a8 rule); GEMV_SPLIT_CTAS only for matrices of at most GEMV_SPLIT_MAX_KCH chunks of K
    (kchunks; 0: any). A function of the card, the plan's implementation and the matrix's shape, never of the lane
    count or the GEMV_WGMMA mode (gemv.cu runs the same units with the same bits where the mode sends a launch
    there)."""
    ctas = C.GEMV_TAIL_CTAS if tail else C.GEMV_SPLIT_CTAS
    if not ctas or impl != "a8" or fmt != L.FMT_Q4 or not gemv_wgmma_supported():
        return 0
    if not tail and C.GEMV_SPLIT_MAX_KCH and kchunks > C.GEMV_SPLIT_MAX_KCH:
        return 0
    return ctas


# v2 partition model (choose_partition): a warp should keep >= this many chunks of its split
G2_MIN_CHUNKS = 2
G2_FILL_ITEMS = 1.5  # per-CTA start + drain, in (row group x chunk) items of one warp
G2_MODEL_LANES = 8  # the width the split / activation traffic terms are priced at
ITEM_BYTES = {fmt: 4 * cb + (0 if fmt == L.FMT_BF16 else 64 * 2 * L.CHUNK_K // L.DEFAULT_GROUP[fmt])
              for fmt, cb in L.CHUNK_BYTES.items()}  # one row group x one chunk, codes + scales


def tail_split(row_groups: int, kchunks: int, splits: int, sm_count: int,
               ctas_per_sm: int = 0) -> list[tuple[int, int, int]]:
    """v1 / a8: (first row group, row groups, K splits) pieces of one matrix. A matrix of one split
    whose row groups overrun the resident CTAs by a thin last wave (gate_up: 544 row groups on 264
    slots, a third wave of 16 CTAs that ran alone for ~9 of its ~38 us, tools/gemv_trace.py) runs
    that remainder split over K instead: its units are short and fill the slots the second wave
    frees. A function of the shape and the SM count only, never the lane count (lane bits stay
    width-invariant); the remainder's rows sum in split order, so their bits differ from one split.
    GEMV_TAIL_SPLIT = 0 keeps every matrix whole, except where ctas_per_sm (split_ctas_per_sm(tail=True): a8 q4
    matrices on gemv_wg cards, GEMV_TAIL_CTAS) sizes the split for those slots: then it is on (0: gemv_slots)."""
    slots = ctas_per_sm * sm_count if ctas_per_sm else gemv_slots(sm_count)
    whole = [(0, row_groups, splits)]
    if not (C.GEMV_TAIL_SPLIT or ctas_per_sm) or splits != 1 or row_groups <= slots:
        return whole
    r = row_groups % slots
    s = min(kchunks // C.GEMV_WARPS, slots // max(r, 1))  # each warp keeps >= 1 chunk of its split
    # (sized for gemv_wg's slots, any remainder that splits at least in two: gate_up's 148 of 396 run as 296 halves)
    if r == 0 or (r > slots // 4 and not ctas_per_sm) or s < 2:
        return whole
    return [(0, row_groups - r, 1), (row_groups - r, r, s)]


def merge_splits(bf16_units: int, splits: int, q4_units: int, slots: int) -> int:
    """GEMV_MERGE's K splits for a plan's bf16 matrices (bf16_units row groups, now `splits` splits each) so
    that they and the q4 launch's q4_units fit one wave of `slots` CTAs as one grid: the most that fit, at most
    `splits`; unchanged where not even one split each fits."""
    free = slots - q4_units
    if free < bf16_units:
        return splits
    return max(1, min(splits, free // bf16_units))


def choose_partition(row_groups: int, kchunks: int, sm_count: int, fmt: int) -> tuple[int, int]:
    """v2 (row groups per CTA, K splits) from the matrix shape only, so lane bits never depend on
    the launch width. A small cost model, best score wins:
      wave quantization  units / (waves x resident CTAs)   (a partial wave leaves SMs idle), times
                         the share of a block's row groups that exist
      fill and drain     items per warp / (items + G2_FILL_ITEMS)
      split partials     2 x (rows x lanes x 4 B) per CTA over its weight bytes  (L2 traffic, half weight)
      activations        x bytes per CTA over its weight bytes: one read per CTA, shared by its row
                         groups through L1  (L2 traffic, 0.3 weight)
    """
    slots = C.G2_CTAS_NT1 * sm_count
    ib = ITEM_BYTES[fmt]
    best = None
    for rgb in (4, 2, 1):
        if rgb > row_groups and rgb > 1:
            continue  # a block of more row groups than exist idles warps for nothing
        kw = C.G2_WARPS // rgb
        blocks = -(-row_groups // rgb)
        for s in range(1, max(1, kchunks // (kw * G2_MIN_CHUNKS)) + 1):
            units = blocks * s
            # a block past the last row group leaves its warps idle
            quant = units / (-(-units // slots) * slots) * row_groups / (blocks * rgb)
            items = rgb * kchunks / s / C.G2_WARPS
            fill = items / (items + G2_FILL_ITEMS)
            wbytes = rgb * (kchunks / s) * ib
            split = 2 * rgb * GEMV_ROWS_PER_CTA * G2_MODEL_LANES * 4 / wbytes if s > 1 else 0.0
            act = (kchunks / s) * L.CHUNK_K * G2_MODEL_LANES * 4 / wbytes
            score = quant * fill / (1 + 0.5 * split + 0.3 * act)
            if best is None or score > best[0] + 1e-12:
                best = (score, rgb, s)
    return best[1], best[2]


def gemv_impl() -> str:
    """The GEMV implementation plans use by default: EngineConfig.gemv (env Q27_GEMV), read once."""
    global _GEMV_IMPL
    if _GEMV_IMPL is None:
        from q27py.config import engine_env

        set_gemv_impl(engine_env().gemv)
    return _GEMV_IMPL


def set_gemv_impl(name: str) -> None:
    if name not in GEMV_IMPLS:
        raise ValueError(f"unknown GEMV implementation {name!r} (choose from {', '.join(GEMV_IMPLS)})")
    global _GEMV_IMPL
    _GEMV_IMPL = name


_GEMV_IMPL: str | None = None


class Workspace:
    """Split-K partials and tickets shared by GEMV launches on one stream (they run one at a time).

    Growing never frees the old buffers: plans built earlier keep valid pointers to them.
    """

    def __init__(self):
        self.floats = 0
        self.counters = 0
        self.ws = None
        self.cnt = None
        # a8, per slot (reserve_act8): int8 activation codes [lanes8][kpad8] and chunk scales [kpad8 / 64]
        # [GEMV_MAX_LANES] (gemv8's layout), at lanes8 = GWG_MAX_LANES two such halves [2][kpad8 / 64][GEMV_MAX_LANES]:
        # lanes 16-31's scales kpad8 / 4 floats after lanes 0-15's (what gemv8w_q4_n32 reads; quant_act8 writes a half)
        self._slots: dict[int, tuple] = {}  # slot -> (kpad8, lanes8, xq, xs)
        self._keep = []

    def reserve_act8(self, kpad: int, lanes: int = GEMV_MAX_LANES, slot: int = 0) -> None:
        """Room for `lanes` (GEMV_MAX_LANES, or GWG_MAX_LANES for a plan that may run gemv8w_q4_n32) lanes'
        a8 activations of K up to kpad. 32 lanes at the 27B's widest K (17408): 557 KB + 35 KB.
        slot: which buffer pair (0: every plan's by default; 1: the plans a producer kernel quantizes into
        while plans of slot 0 still read theirs, GemvPlan quant_into)."""
        assert lanes in (GEMV_MAX_LANES, GWG_MAX_LANES)
        cp = Runtime.get().cp
        kpad8, lanes8, xq, xs = self._slots.get(slot, (0, 0, None, None))
        if xq is None or kpad > kpad8 or lanes > lanes8:
            kpad8, lanes8 = max(kpad, kpad8), max(lanes, lanes8)
            halves = lanes8 // GEMV_MAX_LANES
            xq = cp.zeros((lanes8, kpad8), dtype=cp.uint8)
            chunks = (kpad8 // L.CHUNK_K, GEMV_MAX_LANES)
            xs = cp.zeros(chunks if halves == 1 else (halves,) + chunks, dtype=cp.float32)
            self._keep += [xq, xs]
            self._slots[slot] = (kpad8, lanes8, xq, xs)

    def act8(self, slot: int = 0) -> tuple:
        """The current (codes, scales) of a slot (reserve_act8)."""
        return self._slots[slot][2:]

    def reserve(self, floats: int, counters: int) -> None:
        cp = Runtime.get().cp
        if self.ws is None or floats > self.floats:
            self.floats = max(floats, self.floats)
            self.ws = cp.zeros(max(self.floats, 1), dtype=cp.float32)
            self._keep.append(self.ws)
        if self.cnt is None or counters > self.counters:
            self.counters = max(counters, self.counters)
            self.cnt = cp.zeros(max(self.counters, 1), dtype=cp.int32)
            self._keep.append(self.cnt)


FMT_KERNEL = {L.FMT_BF16: "bf16", L.FMT_Q8: "q8", L.FMT_Q4: "q4"}
# v1 16-byte words per thread and chunk, per format (cuda/gemv.cu)
GEMV_WPC = {L.FMT_BF16: C.WPC_BF16, L.FMT_Q8: C.WPC_Q8, L.FMT_Q4: C.WPC_Q4}


def gemv_shared_bytes(fmt: int, nt: int, a8: bool = False, threads: int | None = None) -> int:
    """Dynamic shared memory of one GEMV CTA: the warps' cp.async rings, or the reduction if larger
    (cuda/gemv_v1.cuh RingCfg: a8 on q4 weights carries each chunk's activation fragments and scales in
    the ring, 24 bytes per thread and lane tile, with RING_Q4_NT2 stages at 16 lanes). threads: the ring's
    (gemv_body_w4's 128 inside a gemv_wg launch; gemv_body's GEMV_WARPS x 32 by default)."""
    threads = threads or 32 * C.GEMV_WARPS
    stages = {L.FMT_BF16: C.RING_BF16, L.FMT_Q8: C.RING_Q8, L.FMT_Q4: C.RING_Q4}[fmt]  # live: probe --set A/B
    act = a8 and fmt == L.FMT_Q4 and a8_act_in_ring(Runtime.get().cc)
    if act and nt == 2:
        stages = C.RING_Q4_NT2
    ring = stages * (GEMV_R * (GEMV_WPC[fmt] * 16 + 4) + (nt * 24 if act else 0)) * threads
    red = C.GEMV_WARPS * GEMV_ROWS_PER_CTA * nt * 8 * 4
    return max(ring, red)


# ---------------------------------------------------------------- a8 GEMV on wgmma (cuda/gemv_wg.cu)
# The a8 kernels' q4 launches as one warpgroup per unit on Hopper's warpgroup MMA (the sm_90a build:
# runtime.ARCH_SPECIFIC): the same units, int32 chunk sums and fp32 operations in the same order, so
# the outputs are bitwise gemv8_q4_*'s and the choice is speed only. Set from EngineConfig.gemv_wgmma:
# "off", "auto" (the widths it measured faster at in whole decode steps: 1 lane and 9-16 lanes, and any
# width for launches of at least GWG_AUTO_WAVES waves of its resident CTAs, i.e. the lm_head), "wide"
# (every q4 launch of 9-16 lanes) or "all". Device runs k1-k4 (H100, docs/PERF.md): "all" against "off"
# decode 2K -1.9%, verify W=16 -8.2%, 16-lane batched round -7.0%, MTP step -5.3%, but verify W=8 +1.6%.
GEMV_WGMMA_MODES = ("off", "auto", "wide", "all")
GWG_AUTO_WAVES = 4


def _gemv_wgmma_default() -> str:
    from q27py.config import engine_env

    return gemv_wgmma_mode(engine_env().gemv_wgmma)


def gemv_wgmma_mode(mode: str) -> str:
    """EngineConfig.gemv_wgmma, checked when the model loads."""
    if mode not in GEMV_WGMMA_MODES:
        raise ValueError(f"gemv_wgmma must be one of {', '.join(GEMV_WGMMA_MODES)}, not {mode!r}")
    return mode


GEMV_WGMMA = _gemv_wgmma_default()


def _wg_three(nl: int, units: int | None) -> bool:
    """Whether a launch of `units` CTAs at width nl runs its 3-CTA entry (gemv8w_q4_n16t / n32s): the constants
    table's GWG_N16_TWO / GWG_N32_SUB, 0 never, 1 always, 2 when the launch has more units than one wave of the
    plain entry (GWG_CTAS_N16 / GWG_CTAS_N32 per SM) -- units None (no launch in view): the plain entry."""
    mode = C.GWG_N16_TWO if nl == 16 else C.GWG_N32_SUB if nl == GWG_MAX_LANES else 0
    if mode == 1:
        return True
    if mode != 2 or units is None:
        return False
    plain = C.GWG_CTAS_N16 if nl == 16 else C.GWG_CTAS_N32
    return units > plain * Runtime.get().sm_count


def _wg_deep(nl: int, units: int | None, chunks: int | None) -> bool:
    """Whether an 8-lane launch of `units` CTAs whose units stream at least `chunks` chunks each runs the deep-ring
    entry gemv8w_q4_n8d (constants GWG_DEEP): it fits one wave at GWG_CTAS_N8D CTAs an SM and its units are long
    enough (GWG_DEEP_MIN_CHUNKS) for the deeper ring to matter. None (no launch in view): the plain entry."""
    if not (C.GWG_DEEP and nl == 8 and units is not None and chunks is not None):
        return False
    return units <= C.GWG_CTAS_N8D * Runtime.get().sm_count and chunks >= C.GWG_DEEP_MIN_CHUNKS


def gemv_wg_kernel(nl: int, units: int | None = None, chunks: int | None = None) -> str:
    """The cuda/gemv_wg.cu entry of a launch of `units` CTAs at width nl = 8 / 16 / 32: gemv8w_q4_n<nl>, or (3 CTAs
    per SM, bitwise the same) at 16 lanes its two-pass entry gemv8w_q4_n16t, at 32 its batched-epilogue entry
    gemv8w_q4_n32s, where _wg_three says so. Experiments (constants table, off): the 4-CTA entries gemv8w_q4_n8q /
    n16q (GWG_N8_FOUR / GWG_N16_FOUR) and the 8-chunk-stage entries gemv8w_q4_n8w / n16w (GWG_WIDE_STAGE). chunks: the
    fewest chunks a unit of the launch streams (_wg_deep: the deep-ring 8-lane entry gemv8w_q4_n8d)."""
    assert nl in (8, 16, GWG_MAX_LANES), nl
    if _wg_deep(nl, units, chunks):
        return "gemv8w_q4_n8d"
    if nl == 16 and C.GWG_N16_FOUR:
        return "gemv8w_q4_n16q"
    if _wg_three(nl, units):
        return "gemv8w_q4_n16t" if nl == 16 else "gemv8w_q4_n32s"
    if nl == 8 and C.GWG_N8_FOUR:
        return "gemv8w_q4_n8q"
    if C.GWG_WIDE_STAGE and nl < GWG_MAX_LANES:
        return f"gemv8w_q4_n{nl}w"
    return f"gemv8w_q4_n{nl}"


def _dp_width(n: int) -> int:
    """The gemv_dp entry's lane count (1, 2, 4, 8) for a launch of n lanes."""
    assert 1 <= n <= 8, n
    return 1 if n == 1 else 2 if n == 2 else 4 if n <= 4 else 8


def gemv_dp_kernel(n: int = 1) -> str:
    """The cuda/gemv_dp.cu entry of a launch of n <= 8 lanes: at 1 lane the ring GEMV_DP_DEPTH deep (read at call time:
    benchmarks override the table), at 2-8 lanes the 8-deep entry of 2, 4 or 8 lanes."""
    assert C.GEMV_DP_DEPTH in (8, 16), C.GEMV_DP_DEPTH
    nl = _dp_width(n)
    if _dp_async(n):
        return "gemv8p_q4_a" if nl == 1 else f"gemv8p_q4_a_n{nl}"
    return f"gemv8p_q4_d{C.GEMV_DP_DEPTH}" if nl == 1 else f"gemv8p_q4_d8_n{nl}"


def _dp_async(n: int) -> bool:
    """Whether a gemv_dp launch of n lanes takes the shared-memory ring entries (GEMV_DP_ASYNC; 1-4 lanes)."""
    return bool(C.GEMV_DP_ASYNC) and n <= 4


def gemv_dp_bytes(kch: int, n: int = 1) -> int:
    """Dynamic shared memory of a gemv_dp CTA of n lanes whose unit streams at most kch chunks: each of its entry's
    lanes' activations (64 bytes a chunk) and chunk scales (4); the async entries' ring before them (GEMV_DP_STAGES x
    128 threads x (16 + 4) bytes)."""
    ring = C.GEMV_DP_STAGES * 128 * 20 if _dp_async(n) else 0
    return ring + _dp_width(n) * kch * (L.CHUNK_K + 4)


def _wg_entry(name: str) -> tuple[int, int, int]:
    """(resident CTAs per SM, chunks a ring stage, ring stages) of a cuda/gemv_wg.cu entry: its GWG_KERNEL line's
    constants, read at call time (benchmarks override the table before anything compiles)."""
    return {
        "gemv8w_q4_n8": (C.GWG_CTAS_N8, C.GWG_CPS, C.GWG_STAGES),
        "gemv8w_q4_n16": (C.GWG_CTAS_N16, C.GWG_CPS, C.GWG_STAGES),
        "gemv8w_q4_n32": (C.GWG_CTAS_N32, C.GWG_CPS, C.GWG_STAGES),
        "gemv8w_q4_n16t": (C.GWG_CTAS_N16T, C.GWG_CPS, C.GWG_STAGES),
        "gemv8w_q4_n32s": (C.GWG_CTAS_N32S, C.GWG_CPS, C.GWG_STAGES_N32S),
        "gemv8w_q4_n8w": (C.GWG_CTAS_N8, C.GWG_CPS_W, C.GWG_STAGES_W),
        "gemv8w_q4_n16w": (C.GWG_CTAS_N16, C.GWG_CPS_W, C.GWG_STAGES_W),
        "gemv8w_q4_n8q": (C.GWG_CTAS_N8Q, C.GWG_CPS, C.GWG_STAGES),
        "gemv8w_q4_n16q": (C.GWG_CTAS_N16Q, C.GWG_CPS, C.GWG_STAGES_N16Q),
        "gemv8w_q4_n8d": (C.GWG_CTAS_N8D, C.GWG_CPS, C.GWG_STAGES_N8D),
    }[name]


def gemv_wg_ctas(nl: int, units: int | None = None, chunks: int | None = None) -> int:
    """Resident CTAs per SM of gemv_wg_kernel(nl, units, chunks) (its launch bounds)."""
    return _wg_entry(gemv_wg_kernel(nl, units, chunks))[0]


def wg_entry_bytes(name: str, nl: int) -> int:
    """Dynamic shared memory of one CTA of the cuda/gemv_wg.cu entry `name` at width nl (its ring; the unit's
    reduced tile reuses it)."""
    _ctas, cps, stages = _wg_entry(name)
    return max(stages * cps * (GEMV_R * 512 + GEMV_R * 32 + nl * 64 + nl * 4), GEMV_ROWS_PER_CTA * nl * 4)


def gemv_wg_shared_bytes(nl: int, units: int | None = None, chunks: int | None = None) -> int:
    """Dynamic shared memory of one gemv_wg_kernel(nl, units, chunks) CTA, nl = 8 / 16 / 32 lanes (WgStage<NL, CPS>::BYTES x
    its stages, _wg_entry; the unit's reduced tile reuses it): per stage CPS chunks of 4 tiles' fragments, their
    scale words, NL lanes' activations and chunk scales. 54,400 / 65,280 / 87,040 bytes (n32s: 69,632; n8d: 87,040)."""
    return wg_entry_bytes(gemv_wg_kernel(nl, units, chunks), nl)


def gemv_wg_launch_bytes(nl: int, units: int | None = None, chunks: int | None = None) -> int:
    """What a gemv_wg launch asks for: gemv_wg_shared_bytes, plus C.GWG_N8_PAD for the 8-lane entry (read at launch:
    an experiment can set it before the graphs are captured); under GWG_PLACE2 at least GWG_PLACE2_BYTES for a plain
    8-lane launch of at most 2 x SMs units (so at most 2 of its CTAs share an SM)."""
    need = gemv_wg_shared_bytes(nl, units, chunks) + (C.GWG_N8_PAD if nl == 8 else 0)
    if (C.GWG_PLACE2 and nl == 8 and units is not None and units <= 2 * Runtime.get().sm_count
            and gemv_wg_kernel(nl, units, chunks) == "gemv8w_q4_n8"):
        need = max(need, C.GWG_PLACE2_BYTES)
    return need


@dataclass(frozen=True)
class NormIn:
    """constants NORM_FOLD: the RMSNorm a GEMV plan's *_nf launch replays in front of itself (GemvPlan.folds_norm):
    rows h (ldh) of the residual, the norm's weights w (+ add_one), eps, the row length `hidden`; y / ldy the normed
    fp32 rows the norm launch would have written (the first matrix's row-group-0 CTAs write them; None: nobody
    reads them). w None (constants QUANT_FOLD, GemvPlan.folds_quant): no norm, rows h quantized as they are (eps
    unused)."""
    h: object
    ldh: int
    w: object
    eps: float
    hidden: int
    y: object = None
    ldy: int = 0
    add_one: bool = True

    def block(self) -> int:
        """rmsnorm's block for this row length (kernels.rmsnorm): the order the fold replays."""
        return 1024 if self.hidden >= 2048 else 256

    def chunks(self) -> int:
        """64-k chunks of the row (its a8 activations' chunks; NORM_TAIL's fnch)."""
        return -(-self.hidden // L.CHUNK_K)


def norm_fold_bytes(nlanes: int, fnch: int) -> int:
    """Shared memory an *_nf launch adds after its ring (cuda/gemv_wg.cu wg_norm_fold): the unit's codes
    [nlanes][fnch][64], chunk scales [fnch][GEMV_MAX_LANES] and the sum's 32 floats."""
    return nlanes * fnch * L.CHUNK_K + fnch * GEMV_MAX_LANES * 4 + 32 * 4


@dataclass(frozen=True)
class GatedIn:
    """constants GATED_FOLD: the GDN output norm a gdn_out plan's *_gf launch computes in front of itself
    (GemvPlan.folds_gated; norm.cu gated_rmsnorm_a8's arguments): the GDN step's output rows o (ldo), the gate rows z
    (ldz), the norm's dv weights w, eps, the value head dim dv."""
    o: object
    ldo: int
    z: object
    ldz: int
    w: object
    eps: float
    dv: int


def gated_fold_bytes(nlanes: int, fnch: int) -> int:
    """Shared memory a *_gf launch adds after its ring (cuda/gemv_wg.cu wg_gated_fold): the unit's codes and chunk
    scales as norm_fold_bytes', GF_HEADS rows of 32 warp sums, and the normed rows of the heads its chunks lie in
    (at most 2 chunks past them at dv <= 128)."""
    return nlanes * fnch * L.CHUNK_K + fnch * GEMV_MAX_LANES * 4 + C.GF_HEADS * 32 * 4 + (fnch + 2) * L.CHUNK_K * 4


def gemv_wg_width(n: int) -> int:
    """The gemv_wg kernel (its NL) a launch of n lanes runs: gemv8w_q4_n8 / _n16 / _n32."""
    assert 1 <= n <= GWG_MAX_LANES, n
    return 8 if n <= 8 else 16 if n <= GEMV_MAX_LANES else GWG_MAX_LANES


def gemv_wgmma_supported(cc: tuple[int, int] | None = None, smem_optin: int | None = None,
                         lanes: int = GEMV_MAX_LANES) -> bool:
    """Whether this card has the sm_90a build of cuda/gemv_wg.cu and the shared memory its CTAs of up to
    `lanes` lanes take (GWG_MAX_LANES: gemv8w_q4_n32 as well)."""
    if cc is None or smem_optin is None:
        rt = Runtime.get()
        cc, smem_optin = rt.cc, rt.smem_optin
    return cc in ARCH_SPECIFIC["gemv_wg"] and gemv_wg_shared_bytes(gemv_wg_width(lanes)) <= smem_optin


def a8_act_in_ring(cc: tuple[int, int]) -> bool:
    """Whether the a8 q4 kernels carry activations in the cp.async ring (cuda/gemv.cu kA8ActRing):
    the 228 KB shared-memory parts (sm_90, sm_100), where two such CTAs fit one SM."""
    return bool(C.GEMV_ACT_RING) and cc in ((9, 0), (10, 0))



class GemvPlan:
    """One logical GEMV: up to 4 matrices reading the same activations x (one launch per format).

    outputs: list of (cupy fp32 array, row stride) per matrix. impl: "v1" (cuda/gemv.cu) or "v2"
    (cuda/gemv2.cu), default gemv_impl(). partition (benchmarks): force (row groups per CTA, splits)
    for every matrix instead of choose_partition (v2) / choose_splits (v1, a8: only the splits).
    """

    def __init__(self, mats: list[GpuMatrix], outputs: list[tuple[object, int]], workspace: Workspace,
                 impl: str | None = None, partition: tuple[int, int] | None = None, wgmma: str | None = None,
                 act8_slot: int = 0, quant_into: "GemvPlan | None" = None, walk_into: "GemvPlan | None" = None):
        """act8_slot: which of the workspace's a8 activation buffers this plan reads (1: a buffer no plan of slot 0
        reads, so a producer may write it while such a plan runs). quant_into: for a plan of one SwiGLU matrix, the
        next plan (a8, its own slot, K covering this plan's outputs): this plan's GEMV launches of lanes 0 ..
        n - 1, n <= 16, also write that plan's a8 activations of the rows they output (cuda/gemv_common.cuh
        swiglu_act8), so it runs prequantized (quantizes_for). walk_into: for such a plan, the next plan a
        constants-MLP_WALK grid runs together with it (walks_into / run_walk): this plan's launch then also writes
        and flags that plan's a8 activations, from descriptors of its own (self.walk), whatever quant_into says."""
        assert 1 <= len(mats) <= 4 and len(mats) == len(outputs)
        rt = Runtime.get()
        self.impl = gemv_impl() if impl is None else impl
        # a8 q4 launches on the wgmma kernel (GEMV_WGMMA's modes; read at run time when None)
        self.wgmma = None if wgmma is None else gemv_wgmma_mode(wgmma)
        if self.impl not in GEMV_IMPLS:
            raise ValueError(f"unknown GEMV implementation {self.impl!r}")
        assert len({m.shape.kchunks for m in mats}) == 1, "matrices in one plan share K"
        for m in mats:  # the kernels assume these scale groups (GSC_* in the constants table)
            assert m.shape.fmt == L.FMT_BF16 or m.shape.group == L.DEFAULT_GROUP[m.shape.fmt], m.shape
        self.mats = mats
        self.kpad = mats[0].shape.kpad
        self.workspace = workspace
        from q27py.gpu import blas

        self._has_bf16 = any(m.shape.fmt == L.FMT_BF16 for m in mats)
        self._bf16_f32 = self._has_bf16 and all(blas.f32_route(m) for m in mats if m.shape.fmt == L.FMT_BF16)
        self.outputs = outputs
        v2 = self.impl == "v2"
        if v2:
            parts = [partition or choose_partition(m.row_groups, m.shape.kchunks, rt.sm_count, m.shape.fmt) for m in mats]
        elif partition is not None:  # v1 / a8 sweeps: force the K splits (one row group per CTA)
            parts = [(1, max(1, min(partition[1], m.shape.kchunks))) for m in mats]
        else:
            parts = [(1, choose_splits(m.row_groups, m.shape.kchunks, rt.sm_count,
                                       split_ctas_per_sm(self.impl, m.shape.fmt, kchunks=m.shape.kchunks)))
                     for m in mats]
        self.rgb = [p[0] for p in parts]  # row groups per CTA
        self.splits = [p[1] for p in parts]
        if C.GEMV_MERGE == 1 and partition is None:  # the bf16 launch sized to the slots qkvz leaves (merge_splits)
            self._fit_merge(mats, rt)
        # whether blocks of 17-32 lanes may run this plan's q4 launches as one gemv8w_q4_n32 launch each (one
        # weight sweep; run): an a8 plan with q4 matrices, a card with that kernel, a mode other than "off".
        # Such a plan's activation buffers hold 32 lanes and its split partials 32-lane tiles.
        self.wide = (self.impl == "a8" and any(m.shape.fmt == L.FMT_Q4 for m in mats) and self.wgmma != "off"
                     and gemv_wgmma_supported(lanes=GWG_MAX_LANES))
        # one row group's partial tile at the widest launch
        e = GEMV_ROWS_PER_CTA * (GWG_MAX_LANES if self.wide else GEMV_MAX_LANES)
        ws_need, cnt_need = 0, 0
        groups: dict[int, list[int]] = {}
        for j, m in enumerate(mats):
            groups.setdefault(m.shape.fmt, []).append(j)
        rows = []  # (fmt, desc rows, ctas, cluster)
        # the smallest launch first (e.g. the bf16 decay / beta gates before the q4 qkvz): the next
        # one's prologue and weight prefetch then overlap it (PDL) instead of it waiting for the
        # big one's tail (tools/gemv_trace.py: ~2.6 us); independent outputs, same bits
        for fmt, idx in sorted(groups.items(), key=lambda kv: sum(mats[j].nbytes for j in kv[1])):
            # pieces (matrix, first row group, row groups, splits): a matrix whose last wave would be a
            # thin tail runs that tail split over K (tail_split), as a second descriptor row
            pieces = []
            for j in idx:
                m = mats[j]
                if v2 or self.rgb[j] != 1:
                    pieces.append((j, 0, m.row_groups, self.splits[j], False))
                    continue
                for k, (g0, ng, s) in enumerate(tail_split(m.row_groups, m.shape.kchunks, self.splits[j], rt.sm_count,
                                                           split_ctas_per_sm(self.impl, m.shape.fmt, tail=True))):
                    pieces.append((j, g0, ng, s, k > 0))
            blocks = {(j, g0): -(-ng // self.rgb[j]) for j, g0, ng, _, _ in pieces}
            # largest matrices first (their CTAs start earliest), split tails last
            pieces.sort(key=lambda q: (q[4], -blocks[(q[0], q[1])] * q[3]))
            desc = np.zeros((len(pieces), D_NFIELDS), dtype=np.int64)
            cta = 0
            for r, (j, g0, ng, s, _tail) in enumerate(pieces):
                m, (y, ldy), rgb = mats[j], outputs[j], self.rgb[j]
                sh = m.shape
                t0 = g0 * GEMV_R  # first row tile of the piece
                # outputs before the piece: 8 per row tile for SwiGLU (gate / up row pairs), else 16
                o0 = t0 * (8 if m.mode == MODE_SWIGLU else 16)
                f = desc[r]
                f[C.D_W] = int(ptr(m.codes)) + t0 * sh.kchunks * L.CHUNK_BYTES[sh.fmt]
                f[C.D_S] = int(ptr(m.scales)) + (t0 * sh.groups * 8 * 4 if m.scales is not None else 0)
                f[C.D_Y] = int(ptr(y)) + o0 * 4
                f[C.D_WS], f[C.D_CNT], f[C.D_LDY], f[C.D_NOUT] = ws_need, cnt_need, ldy, m.nout - o0
                f[C.D_KCH], f[C.D_RT], f[C.D_FMT], f[C.D_MODE] = sh.kchunks, sh.row_tiles - t0, sh.fmt, m.mode
                f[C.D_SPLITS], f[C.D_RG], f[C.D_CTA0] = s, ng, cta
                f[C.D_GSC], f[C.D_NGROUPS], f[C.D_RGB], f[C.D_O0] = sh.group_chunks, sh.groups, rgb, o0
                nb = blocks[(j, g0)]
                cta += nb * s
                if s > 1:
                    ws_need += nb * s * rgb * e
                    cnt_need += nb
            rows.append((fmt, desc, cta, self._cluster([int(x) for x in desc[:, C.D_SPLITS]], rt)))
        workspace.reserve(ws_need, cnt_need)
        self.a8 = self.impl == "a8" and any(m.shape.fmt != L.FMT_BF16 for m in mats)
        self.act8_slot = act8_slot
        self.xq = self.xs = None  # a8 only
        if self.a8:
            workspace.reserve_act8(self.kpad, GWG_MAX_LANES if self.wide else GEMV_MAX_LANES, slot=act8_slot)
            # the buffers as of now (a later, larger reserve allocates new ones and keeps these alive,
            # so graphs captured with this plan stay valid)
            self.xq, self.xs = workspace.act8(act8_slot)
        self.quant_into = None
        if quant_into is not None and self.a8 and quant_into.a8:
            m, (y, ldy) = mats[0], outputs[0]
            assert len(mats) == 1 and m.mode == MODE_SWIGLU, "quant_into: one SwiGLU matrix"
            assert quant_into.act8_slot != act8_slot, "quant_into: the next plan's own activation buffers"
            assert m.nout <= quant_into.kpad <= ldy and ldy % 2 == 0, "quant_into: K covers the outputs' rows"
            self.quant_into = quant_into
            nq = quant_into.kpad // L.CHUNK_K
            for _fmt, desc, _units, _cl in rows:
                desc[:, C.D_XQ], desc[:, C.D_XS] = int(ptr(quant_into.xq)), int(ptr(quant_into.xs))
                desc[:, C.D_LDQ], desc[:, C.D_QCNT] = quant_into.xq.shape[1], cnt_need
            cnt_need += nq
            workspace.reserve(ws_need, cnt_need)
        # this plan's split-K room (floats, counters), from 0 in the shared workspace like every plan's
        self.ws_need, self.cnt_need = ws_need, cnt_need
        walk = walk_into is not None and self.a8 and walk_into.a8 and len(rows) == 1 and rows[0][0] == L.FMT_Q4
        if walk:  # a walk grid runs both plans' units at once: the next plan's split-K room goes after this one's
            workspace.reserve(ws_need + walk_into.ws_need, cnt_need + walk_into.cnt_need)
        ws_base, cnt_base = int(ptr(workspace.ws)), int(ptr(workspace.cnt))
        # host copies of the descriptors (link_prefetch reads the next plan's tiles from them)
        self.desc_host = [(fmt, desc.copy(), units) for fmt, desc, units, _ in rows]
        # next-launch L2 prefetch words of this plan's last launch ([units][GEMV_PF_PER] uint64, a
        # device array written in place by link_prefetch so captured graphs see every relink), or None
        self.pf = None
        self.launches = []
        self.clusters = []  # per launch: CTAs per thread-block cluster (1: none)
        # per launch: the fewest chunks one of its units streams (gemv_wg_kernel's deep-ring rule)
        self.unit_chunks = [int(min(desc[:, C.D_KCH] // desc[:, C.D_SPLITS])) for _f, desc, _u, _c in rows]
        # per launch: the most chunks one of its units streams (an *_nf launch's fold buffer, NORM_FOLD)
        self.unit_chunks_max = [int(max(-(-desc[:, C.D_KCH] // desc[:, C.D_SPLITS]))) for _f, desc, _u, _c in rows]
        for fmt, desc, units, cluster in rows:
            desc[:, C.D_WS] = ws_base + desc[:, C.D_WS] * 4
            desc[:, C.D_CNT] = cnt_base + desc[:, C.D_CNT] * 4
            if self.quant_into is not None:
                desc[:, C.D_QCNT] = cnt_base + desc[:, C.D_QCNT] * 4
            self.launches.append((fmt, rt.cp.asarray(desc), len(desc), units))
            self.clusters.append(cluster)
        # MLP_WALK: (this plan's descriptors, rows, units; ctl; nq; the next plan's descriptors, rows) as a walk grid
        # runs them
        self.walk = None
        self.tail = None  # NORM_TAIL: (the next norm, the plan it feeds, the ticket) -- set_norm_tail
        self.tail_bit = 0  # NORM_TAIL: the bit of the constant that turns this plan's tail on
        self.norm_done = None  # NORM_TAIL: what the previous plan's tail computed for this plan (take_norm_done)
        self._walk_into = None
        if walk:
            m, ldy = mats[0], outputs[0][1]
            assert len(mats) == 1 and m.mode == MODE_SWIGLU, "walk_into: one SwiGLU matrix"
            assert walk_into.act8_slot != act8_slot, "walk_into: the next plan's own activation buffers"
            assert m.nout <= walk_into.kpad <= ldy and ldy % 2 == 0, "walk_into: K covers the outputs' rows"
            nq = walk_into.kpad // L.CHUNK_K
            # [ticket, CTAs done, nq ready flags, nq arrival counters]: the plan's own, so no other launch's
            # counters share them while a walk grid overlaps its neighbours (PDL)
            ctl = rt.cp.zeros(2 + 2 * nq, dtype=rt.cp.int32)
            wd = rows[0][1].copy()
            wd[:, C.D_XQ], wd[:, C.D_XS] = int(ptr(walk_into.xq)), int(ptr(walk_into.xs))
            wd[:, C.D_LDQ] = walk_into.xq.shape[1]
            wd[:, C.D_QRDY] = int(ptr(ctl)) + 2 * 4
            wd[:, C.D_QCNT] = int(ptr(ctl)) + (2 + nq) * 4
            # the next plan's descriptors as the walk runs them: its split-K partials and tickets past this plan's
            dd = walk_into.desc_host[0][1].copy()
            dd[:, C.D_WS] = ws_base + (dd[:, C.D_WS] + ws_need) * 4
            dd[:, C.D_CNT] = cnt_base + (dd[:, C.D_CNT] + cnt_need) * 4
            self.walk = (rt.cp.asarray(wd), len(wd), rows[0][2], ctl, nq, rt.cp.asarray(dd), len(dd))
            self._walk_into = walk_into

    def _fit_merge(self, mats: list[GpuMatrix], rt) -> None:
        """GEMV_MERGE: a plan of bf16 matrices and q4 ones, a8 on a gemv_wg card, whose merged
        grid would overrun one wave (qkvz's 256 units + the gates' 20 on the 264 slots of 2 CTAs an SM: 12 CTAs ran
        a second wave, the merged grid 22.7 us against 13.1 + 8.0 apart, docs/PERF.md thirteenth session): the bf16
        matrices take the K splits that fill the slots left (merge_splits). A function of the shapes and the SM
        count, never of the lane count; the gates' sums then add over fewer splits (their bits differ from
        GEMV_MERGE = 0's; merged or launched apart, the same)."""
        fmts = {m.shape.fmt for m in mats}
        if self.impl != "a8" or fmts != {L.FMT_BF16, L.FMT_Q4} or self.wgmma == "off" or not gemv_wgmma_supported():
            return
        bf = [j for j, m in enumerate(mats) if m.shape.fmt == L.FMT_BF16]
        q4_units = 0
        for j, m in enumerate(mats):
            if m.shape.fmt == L.FMT_Q4:
                q4_units += sum(ng * s for _g0, ng, s in tail_split(
                    m.row_groups, m.shape.kchunks, self.splits[j], rt.sm_count,
                    split_ctas_per_sm(self.impl, m.shape.fmt, tail=True)))
        chunks = min(m.shape.kchunks // self.splits[j] for j, m in enumerate(mats) if m.shape.fmt == L.FMT_Q4)
        ctas = min(gemv_wg_ctas(nl, q4_units, chunks) for nl in (8, 16))
        s = merge_splits(sum(mats[j].row_groups for j in bf), max(self.splits[j] for j in bf), q4_units,
                         ctas * rt.sm_count)
        for j in bf:
            self.splits[j] = min(self.splits[j], s)

    def _cluster(self, splits: list[int], rt) -> int:
        """v1 / a8 on sm_90: a launch whose matrices share one split count s in 2..GEMV_CLUSTER_MAX
        runs as clusters of s CTAs (a row group's splits), reduced through DSMEM (cuda/gemv.cu)."""
        s = splits[0]
        if self.impl == "v2" or rt.cc < (9, 0) or any(x != s for x in splits) or not 1 < s <= C.GEMV_CLUSTER_MAX:
            return 1
        return s

    def branches(self, nlanes: int, use_gemm: bool = False) -> bool:
        """Whether run() puts this plan's first launch on a side branch (constants GEMV_BRANCH): the smallest of
        two or more launches (the GDN layer's bf16 gates beside qkvz, attention's q8 kv beside q), at GEMV
        widths, one block of lanes. Its outputs are its own matrices', the launches after it neither read them nor
        write what it reads (x, or the int8 activations quantized before the fork), and the plan's pieces own
        disjoint ranges of the split-K workspace."""
        if not C.GEMV_BRANCH or use_gemm or len(self.launches) < 2 or nlanes > GEMV_MAX_LANES:
            return False
        return C.GEMV_BRANCH == 1 or self.launches[0][0] == L.FMT_BF16  # 2: the bf16 gates only

    def fuses_quant(self, nlanes: int) -> bool:
        """Whether x's producer may write this plan's int8 activations (then run(prequantized=True))."""
        return self.a8 and nlanes <= GEMV_MAX_LANES

    def folds_norm(self, nlanes: int, skip_bf16: bool = False, norm: "NormIn | None" = None) -> bool:
        """Whether run(nlanes, skip_bf16=..., norm=...) replays the RMSNorm of its input in its own CTAs (constants
        NORM_FOLD; cuda/gemv_wg.cu's *_nf entries) instead of reading activations a norm launch wrote: a GEMV block of
        lanes 0 .. nlanes - 1 <= NORM_FOLD_LANES with a q4 launch on gemv8w_q4_n8 / n8d (_fold_launch), the norm's
        row within rmsnorm_row's registers (no tail loop to replay)."""
        if norm is not None and norm.w is None:
            return self.folds_quant(nlanes, norm)
        if not C.NORM_FOLD:
            return False
        if norm is not None and (norm.hidden > C.NORM_PER_THREAD * norm.block() or norm.hidden > self.kpad):
            return False
        return self._norm_launch(nlanes, skip_bf16, norm) is not None

    def folds_quant(self, nlanes: int, rows: "NormIn") -> bool:
        """Whether run(nlanes, norm=rows) with rows.w None quantizes its input rows in its own CTAs (constants
        QUANT_FOLD: down's SwiGLU rows; the *_nf entries' quant-only mode, each CTA its own unit's chunks) instead of
        a quant_act8 launch: a block of lanes 0 .. nlanes - 1 <= QUANT_FOLD_LANES whose q4 launch runs on
        gemv8w_q4_n8 / n8d with room for the fold buffer (_fold_launch), the rows' length at most kpad."""
        if not C.QUANT_FOLD or rows.w is not None or rows.hidden > self.kpad:
            return False
        return self._norm_launch(nlanes, False, rows) is not None

    def _norm_launch(self, nlanes: int, skip_bf16: bool, norm: "NormIn | None") -> int | None:
        """The *_nf launch of run(norm=...) (_fold_launch), at its widths: QUANT_FOLD_LANES for the quant-only mode
        (norm.w None), NORM_FOLD_LANES for a norm."""
        quant = norm is not None and norm.w is None
        return self._fold_launch(nlanes, skip_bf16, max_lanes=C.QUANT_FOLD_LANES if quant else None)

    def folds_gated(self, nlanes: int, gated: "GatedIn") -> bool:
        """Whether run(nlanes, gated=...) computes the GDN output norm of its input in its own CTAs (constants
        GATED_FOLD; cuda/gemv_wg.cu's *_gf entries) instead of reading the activations gated_rmsnorm_a8 wrote: the
        plan's one launch on gemv8w_q4_n8 / n8d (_fold_launch), K exactly the value heads, dv 64 or 128 (a head's
        norm is one block of dv <= 128 threads, the CTA's)."""
        if not C.GATED_FOLD or len(self.launches) != 1 or gated.dv not in (64, 128) or self.kpad % gated.dv:
            return False
        return self._fold_launch(nlanes, False, gated_fold_bytes) is not None

    def _fold_launch(self, nlanes: int, skip_bf16: bool, fold_bytes=None, max_lanes: int | None = None) -> int | None:
        """The launch an *_nf entry runs for folds_norm, or None: the first of the block's launches that is a q4 one on
        gemv8w_q4_n8 / n8d whose fold buffer keeps the entry's CTAs an SM. It runs first (its first matrix's row group 0 writes x,
        and with other a8 launches in the plan their int8 activations too), then the
        plan's other launches in their order (each writes its own outputs: the same bits in any order)."""
        max_lanes = C.NORM_FOLD_LANES if max_lanes is None else max_lanes
        if not self.a8 or not 1 <= nlanes <= max_lanes or nlanes >= GEMM_MIN_TOKENS:
            return None
        fold_bytes = fold_bytes or norm_fold_bytes
        last = len(self.launches) - 1
        for li, (fmt, _desc, _nmat, units) in enumerate(self.launches):
            if skip_bf16 and fmt == L.FMT_BF16:
                continue
            pf = self.pf if li == last else None
            if fmt != L.FMT_Q4 or not self._on_wg(fmt, units, self.clusters[li], nlanes, pf):
                continue
            name = gemv_wg_kernel(8, units, self.unit_chunks[li])
            if name not in ("gemv8w_q4_n8", "gemv8w_q4_n8d"):
                continue
            need = gemv_wg_launch_bytes(8, units, self.unit_chunks[li]) + fold_bytes(nlanes, self.unit_chunks_max[li])
            if _wg_entry(name)[0] * (need + 1024) <= C.GWG_SM_SHARED:
                return li
        return None

    def walks_into(self, nxt: "GemvPlan", nlanes: int) -> bool:
        """Whether run_walk(nxt, ...) runs this plan and nxt as one grid (constants MLP_WALK, read here at launch time):
        a plan built with walk_into=nxt, a block of lanes 0 .. nlanes - 1 <= MLP_WALK_LANES (8 or 16), both plans one
        q4 launch that would run on gemv_wg (no cluster, no next-launch prefetch)."""
        if (not C.MLP_WALK or self._walk_into is not nxt or not 1 <= nlanes <= min(C.MLP_WALK_LANES, GEMV_MAX_LANES)
                or len(nxt.launches) != 1):
            return False
        (f1, u1), (f2, u2) = self.launches[0][::3], nxt.launches[0][::3]
        return (f2 == L.FMT_Q4 and self.clusters[0] == 1 and nxt.clusters[0] == 1
                and self._on_wg(f1, u1, 1, nlanes, None) and nxt._on_wg(f2, u2, 1, nlanes, nxt.pf))

    def run_walk(self, nxt: "GemvPlan", x, ldx: int, nlanes: int, prequantized: bool = False) -> None:
        """This plan (gate_up, SwiGLU) and nxt (down) for lanes 0 .. nlanes - 1 as one grid (walks_into): this plan's
        units first, then nxt's, which wait on the chunks this plan's epilogue quantizes into nxt's a8 buffers.
        The same units, so the same bits as run(x) then nxt.run(prequantized=True)."""
        assert self.walks_into(nxt, nlanes)
        rt = Runtime.get()
        if not prequantized:
            self._quant_act8(rt, x, ldx, 0, nlanes)
        wd, wm, wu, ctl, nq, d2, m2 = self.walk
        u2 = nxt.launches[0][3]
        # the entry both plans' units run on: 1-8 lanes gemv8w_q4_n8's (MLP_WALK 1) or n8d's (2), 9-16 n16t's
        nl = gemv_wg_width(nlanes)
        name = "gemv8w_q4_n16t" if nl == 16 else "gemv8w_q4_n8d" if C.MLP_WALK == 2 else "gemv8w_q4_n8"
        rt.launch("gemv_wg", name + "_walk", wu + u2, 128,
                  (wd, i32(wm), i32(wu), self.xq, i32(self.xq.shape[1]), self.xs, np.uint32(0x80808080),
                   i32(nlanes), i32(0), d2, i32(m2), i32(u2), nxt.xq, i32(nxt.xq.shape[1]), nxt.xs, ctl, i32(nq)),
                  shared_mem=wg_entry_bytes(name, nl))

    def _quant_act8(self, rt, x, ldx: int, l0: int, n: int, xq=None, xs=None) -> None:
        """The a8 activations of lanes l0 .. l0 + n - 1 of x into rows 0 .. n - 1 of xq / xs (default: the plan's)."""
        xq, xs = (self.xq, self.xs) if xq is None else (xq, xs)
        kch = self.kpad // L.CHUNK_K
        rt.launch("gemv", "quant_act8", (-(-kch // 8), n), 256,
                  (x[l0:] if l0 else x, i32(ldx), i32(kch), xq, i32(xq.shape[1]), xs))

    # NORM_TAIL: the plan whose norm_done a tail launch set and nobody has taken yet (drop_open_tail)
    _open_tail: "GemvPlan | None" = None

    def set_norm_tail(self, norm: "NormIn", nxt: "GemvPlan", bit: int = 1) -> None:
        """constants NORM_TAIL: this plan (one q4 matrix adding into the residual rows norm.h) is followed by the RMSNorm
        `norm` feeding nxt's a8 activations (bit 1: a layer's post-attention norm before gate_up; bit 2: the next
        layer's input norm after down): where NORM_TAIL has `bit`, run() of a block of lanes 0 .. n - 1 <=
        NORM_TAIL_LANES then launches the *_nt entry, whose last CTA computes that norm (cuda/gemv_wg.cu
        wg_norm_tail), and leaves nxt a marker that FastModel._norm takes instead of launching the norm."""
        assert len(self.mats) == 1 and self.mats[0].mode == MODE_ADD and norm.w is not None and norm.y is not None
        cp = Runtime.get().cp
        self.tail = (norm, nxt, cp.zeros(1, dtype=cp.int32))
        self.tail_bit = bit

    @staticmethod
    def drop_open_tail() -> None:
        """Forget a tail's marker nobody took (a forward cut short between the tail launch and its norm), so the
        next forward's norm launches."""
        p, GemvPlan._open_tail = GemvPlan._open_tail, None
        if p is not None:
            p.norm_done = None

    def _tails(self, n: int) -> bool:
        """Whether run() of lanes 0 .. n - 1 takes the *_nt entry (set_norm_tail; constants NORM_TAIL, read at launch
        time): one q4 launch on gemv8w_q4_n8 / n8d, n <= NORM_TAIL_LANES (at most 8), the next plan fed
        prequantized, the norm's row within the replay's registers and its weights and one row within the ring's
        shared memory (wg_norm_tail)."""
        if (self.tail is None or not C.NORM_TAIL & self.tail_bit or not 1 <= n <= min(8, C.NORM_TAIL_LANES)
                or len(self.launches) != 1):
            return False
        norm, nxt, _ctl = self.tail
        fmt, _desc, _nmat, units = self.launches[0]
        kp = norm.chunks() * L.CHUNK_K  # wg_norm_tail's shared memory: w and one row of kp, red[32]
        return (fmt == L.FMT_Q4 and self.clusters[0] == 1 and self._on_wg(fmt, units, 1, n, self.pf)
                and gemv_wg_kernel(8, units, self.unit_chunks[0]) in ("gemv8w_q4_n8", "gemv8w_q4_n8d")
                and nxt.fuses_quant(n) and norm.hidden <= C.NORM_PER_THREAD * norm.block() and norm.block() <= 8 * 128
                and norm.hidden <= nxt.kpad
                and 8 * kp + 128 <= gemv_wg_launch_bytes(8, units, self.unit_chunks[0]))

    def _launch_tail(self, rt, n: int) -> None:
        norm, nxt, ctl = self.tail
        fmt, desc, nmat, units = self.launches[0]
        name = gemv_wg_kernel(8, units, self.unit_chunks[0])
        rt.launch("gemv_wg", name + "_nt", units, 128,
                  (desc, i32(nmat), i32(units), self.xq, i32(self.xq.shape[1]), self.xs, np.uint32(0x80808080),
                   i32(n), i32(0), norm.h, i32(norm.ldh), norm.w, f32(1.0 if norm.add_one else 0.0), f32(norm.eps),
                   i32(norm.hidden), i32(norm.block()), norm.y, i32(norm.ldy), i32(norm.chunks()),
                   nxt.xq, i32(nxt.xq.shape[1]), nxt.xs, ctl),
                  shared_mem=gemv_wg_launch_bytes(8, units, self.unit_chunks[0]))
        nxt.norm_done = (norm.w, n)
        GemvPlan._open_tail = nxt

    def take_norm_done(self):
        """(norm weights, lanes) of the norm the previous plan's *_nt launch computed for this plan (NORM_TAIL), once;
        else None."""
        done, self.norm_done = self.norm_done, None
        if done is not None:
            GemvPlan._open_tail = None
        return done

    def quantizes_for(self, nxt: "GemvPlan", nlanes: int) -> bool:
        """Whether run(nlanes) writes nxt's a8 activations (quant_into; then nxt.run(prequantized=True)): the
        GEMV's one block of lanes 0 .. nlanes - 1 (no prefill GEMM)."""
        return self.quant_into is nxt and nxt.fuses_quant(nlanes) and nlanes < GEMM_MIN_TOKENS

    def gemm_inputs(self, nlanes: int) -> tuple[bool, bool]:
        """(bf16, f32): which rows of x run(nlanes) reads -- bf16 ones for the matrices on cuBLAS's bf16
        route (gemm_bf16_route), the fp32 ones for any other (GEMV, mma.sync GEMM, fp32 / fp8 routes).
        A producer that writes x for this plan writes those (then run(x_bf16=...))."""
        bf = [gemm_bf16_route(m, nlanes) for m in self.mats]
        return any(bf), not all(bf)

    def swiglu_bf16(self, nlanes: int) -> bool:
        """Whether run(nlanes) may write its output as bf16 rows only (run(y_bf16=...)): one SwiGLU
        matrix on cuBLAS's bf16 route."""
        return len(self.mats) == 1 and self.mats[0].mode == MODE_SWIGLU and gemm_bf16_route(self.mats[0], nlanes)

    def run(self, x, ldx: int, nlanes: int, lane0: int = 0, allow_gemm: bool = True,
            prequantized: bool = False, x_bf16=None, y_bf16=None, skip_bf16: bool = False,
            norm: "NormIn | None" = None, gated: "GatedIn | None" = None) -> None:
        """y[lane0 + t] for t < nlanes: the prefill GEMM for many tokens (q4/q8 matrices), else
        the GEMV in blocks of at most 16 lanes -- or, where the plan's q4 launches run on gemv_wg (self.wide),
        blocks of 17-32 lanes whose q4 launches stream the weights once (_run_wide). prequantized: x's producer already wrote this plan's
        a8 activations (kernels.rmsnorm(a8=plan)), so no quant_act8 launch. x_bf16: x's producer
        also (or only) wrote bf16 rows [lanes, kpad] of it (gemm_inputs says when); without them the
        matrices on the bf16 route share one conversion. y_bf16 (swiglu_bf16): the output as bf16 rows.
        skip_bf16: leave the plan's bf16 matrices out (GDN_GATES_IN_CONV: the conv computes the gates itself).
        norm (folds_norm): x is norm's output, which this launch computes itself (no norm launch before it); gated
        (folds_gated): the same for the GDN output norm (x is not read)."""
        assert not prequantized or (self.fuses_quant(nlanes) and lane0 == 0)
        assert norm is None or (lane0 == 0 and self.folds_norm(nlanes, skip_bf16, norm)), "norm: folds_norm's launch"
        assert gated is None or (lane0 == 0 and self.folds_gated(nlanes, gated)), "gated: folds_gated's launch"
        if gated is not None:
            fmt, desc, nmat, units = self.launches[0]
            self._launch(Runtime.get(), fmt, desc, nmat, units, 1, x, ldx, nlanes, 0, None, self.xq, self.xs,
                         self.unit_chunks[0], gated=gated, fnch=self.unit_chunks_max[0])
            return
        if norm is not None:  # the *_nf launch first, then the others on what it wrote (_fold_launch)
            rt = Runtime.get()
            wl = self._norm_launch(nlanes, skip_bf16, norm)
            last = len(self.launches) - 1
            others = [li for li, lw in enumerate(self.launches) if li != wl and not (skip_bf16 and lw[0] == L.FMT_BF16)]
            fmt, desc, nmat, units = self.launches[wl]
            share = any(self.launches[li][0] != L.FMT_BF16 for li in others)  # a8 launches read xq / xs after it
            self._launch(rt, fmt, desc, nmat, units, 1, x, ldx, nlanes, 0, None, self.xq, self.xs,
                         self.unit_chunks[wl], norm=norm, fnch=self.unit_chunks_max[wl], share=share)
            for li in others:
                fmt, desc, nmat, units = self.launches[li]
                self._launch(rt, fmt, desc, nmat, units, self.clusters[li], x, ldx, nlanes, 0,
                             self.pf if li == last else None, self.xq, self.xs, self.unit_chunks[li])
            return
        assert not skip_bf16 or sum(m.shape.fmt == L.FMT_BF16 for m in self.mats) == 1, "skip_bf16: one bf16 matrix"
        rt = Runtime.get()
        use_gemm = allow_gemm and nlanes >= GEMM_MIN_TOKENS
        assert (x_bf16 is None or (use_gemm and x_bf16.shape[1] == self.kpad)) and (
            y_bf16 is None or (use_gemm and self.swiglu_bf16(nlanes)))
        if use_gemm:
            from q27py.gpu import blas

            xs = x[lane0:] if lane0 else x
            routes = [gemm_bf16_route(m, nlanes) for m in self.mats]
            if x_bf16 is not None:
                x_bf16 = x_bf16[lane0:] if lane0 else x_bf16
            elif sum(routes) > 1:  # one conversion for every matrix of the plan (e.g. attention's q and kv)
                x_bf16 = blas.to_bf16(xs, ldx, nlanes, self.kpad)
            f32 = self._bf16_f32 and gemm_f32_route(nlanes)  # every bf16 matrix through cuBLAS (PREFILL_SMALL_GEMM)
            split = None  # the three-term route's planes of x, made once for every bf16 matrix of the plan
            for m, (y, ldy), bf in zip(self.mats, self.outputs, routes):
                if skip_bf16 and m.shape.fmt == L.FMT_BF16:
                    continue
                if gemm_supported(m):
                    gemm(m, xs, ldx, nlanes, y[lane0:] if lane0 else y, ldy, x_bf16=x_bf16 if bf else None,
                         y_bf16=y_bf16)
                elif f32 and PREFILL_SMALL_GEMM == "f32":
                    blas.prefill_gemm_f32(m, xs, ldx, nlanes, y[lane0:] if lane0 else y, ldy)
                elif f32 and PREFILL_SMALL_GEMM == "bf16x3f" and blas.bf16x3f_fits(m):
                    blas.prefill_gemm_bf16x3f(m, xs, ldx, nlanes, y[lane0:] if lane0 else y, ldy)
                elif f32:  # "bf16x3", or a matrix of more row tiles than the fused kernel is built for
                    if split is None:  # the plan's bf16 rows of x (if it has them) are the hi term
                        split = blas.split3(xs, ldx, nlanes, self.kpad, x_bf16=x_bf16)
                    blas.prefill_gemm_split3(m, xs, ldx, nlanes, y[lane0:] if lane0 else y, ldy, split=split)
            if f32 or not self._has_bf16 or skip_bf16:
                return  # nothing is left for the GEMV
        done = 0
        last = len(self.launches) - 1
        while done < nlanes:
            quant = self.a8 and not use_gemm and not prequantized
            # 17-32 lanes left whose q4 launches may run on gemv8w_q4_n32: one block (_run_wide)
            n = min(GWG_MAX_LANES, nlanes - done)
            if quant and n > GEMV_MAX_LANES and self._wide_block(n, done + n >= nlanes):
                self._run_wide(rt, x, ldx, n, lane0 + done, done + n >= nlanes, skip_bf16)
                done += n
                continue
            n = min(GEMV_MAX_LANES, nlanes - done)
            final = done + n >= nlanes  # only the last 16-lane block precedes the next plan
            if quant:
                self._quant_act8(rt, x, ldx, lane0 + done, n)
            if n == nlanes and lane0 == 0 and not use_gemm and self._tails(n):  # NORM_TAIL: the next norm in its tail
                self._launch_tail(rt, n)
                done += n
                continue
            merged = None if skip_bf16 else self._merged_kernel(n, final, use_gemm)
            if merged is not None:  # GEMV_MERGE: the bf16 launch's units in the q4 launch's grid
                self._launch_merged(rt, merged, x, ldx, n, lane0 + done)
                done += n
                continue
            # one block of lanes only: a later block's quant_act8 is on main
            branch = not skip_bf16 and self.branches(nlanes, use_gemm)
            # the branch forks before the first launch and joins after the last (the first on the side stream)
            with rt.side_branch() if branch else nullcontext() as on_side:
                for li, ((fmt, desc, nmat, units), cluster) in enumerate(zip(self.launches, self.clusters)):
                    if (use_gemm and fmt != L.FMT_BF16) or (skip_bf16 and fmt == L.FMT_BF16):
                        continue  # done by the GEMM above / by the plan's consumer
                    pf = self.pf if (final and li == last and not use_gemm) else None
                    xq, xs = (self.xq, self.xs) if self.a8 else (None, None)
                    with on_side() if on_side is not None and li == 0 else nullcontext():
                        self._launch(rt, fmt, desc, nmat, units, cluster, x, ldx, n, lane0 + done, pf, xq, xs,
                                     self.unit_chunks[li])
            done += n

    def _launch(self, rt, fmt: int, desc, nmat: int, units: int, cluster: int, x, ldx: int, n: int, l0: int, pf,
                xq, xs, chunks: int | None = None, norm: "NormIn | None" = None, fnch: int = 0,
                share: bool = False, gated: "GatedIn | None" = None) -> None:
        """One launch of the plan for n <= 16 lanes l0 .. l0 + n - 1, their a8 activations at xq / xs (rows 0 ..
        n - 1; [chunk][GEMV_MAX_LANES] scales); chunks: the fewest chunks one of its units streams. norm / fnch
        (folds_norm): the *_nf entry, which computes those activations from norm's rows (fnch: the most chunks a
        unit streams, the fold buffer's; share: it also writes them to xq / xs for the plan's other launches)."""
        nt = 1 if n <= 8 else 2
        if gated is not None:  # folds_gated: the *_gf entry
            rt.launch("gemv_wg", gemv_wg_kernel(8, units, chunks) + "_gf", units, 128,
                      (desc, i32(nmat), i32(units), xq, i32(xq.shape[1]), xs, np.uint32(0x80808080), i32(n), i32(l0),
                       gated.o, i32(gated.ldo), gated.z, i32(gated.ldz), gated.w, f32(gated.eps), i32(gated.dv),
                       i32(fnch)),
                      shared_mem=gemv_wg_launch_bytes(8, units, chunks) + gated_fold_bytes(n, fnch))
            return
        if norm is not None:
            rt.launch("gemv_wg", gemv_wg_kernel(8, units, chunks) + "_nf", units, 128,
                      (desc, i32(nmat), i32(units), xq, i32(xq.shape[1]), xs, np.uint32(0x80808080), i32(n), i32(l0),
                       norm.h, i32(norm.ldh), norm.w, f32(1.0 if norm.add_one else 0.0), f32(norm.eps),
                       i32(norm.hidden), i32(norm.block()), norm.y, i32(norm.ldy), i32(fnch),
                       xq if share else None, i32(xq.shape[1]), xs if share else None),
                      shared_mem=gemv_wg_launch_bytes(8, units, chunks) + norm_fold_bytes(n, fnch))
            return
        if self._on_dp(fmt, cluster, n, pf):
            rt.launch("gemv_dp", gemv_dp_kernel(n), units, 128,
                      (desc, i32(nmat), i32(units), xq, i32(xq.shape[1]), xs, np.uint32(0x80808080), i32(n), i32(l0),
                       i32(C.GEMV_DP_L2PF)), shared_mem=gemv_dp_bytes(self._chunks_max(desc), n))
        elif self._on_wg(fmt, units, cluster, n, pf):
            nl = 8 * nt
            rt.launch("gemv_wg", gemv_wg_kernel(nl, units, chunks), units, 128,
                      (desc, i32(nmat), i32(units), xq, i32(xq.shape[1]), xs,
                       np.uint32(0x80808080), i32(n), i32(l0)),
                      shared_mem=gemv_wg_launch_bytes(nl, units, chunks))
        elif self.a8 and fmt != L.FMT_BF16:
            rt.launch("gemv", f"gemv8_{FMT_KERNEL[fmt]}_nt{nt}", units, 32 * C.GEMV_WARPS,
                      (desc, i32(nmat), i32(units), xq, i32(xq.shape[1]), xs,
                       np.uint32(0x80808080), i32(n), i32(l0), pf),
                      shared_mem=gemv_shared_bytes(fmt, nt, a8=True), cluster=cluster)
        elif self.impl == "v2":
            rt.launch("gemv2", f"gemv2_{FMT_KERNEL[fmt]}_nt{nt}", units, 32 * C.G2_WARPS,
                      (desc, i32(nmat), x, i32(ldx), i32(n), i32(l0)))
        else:
            rt.launch("gemv", f"gemv_{FMT_KERNEL[fmt]}_nt{nt}", units, 32 * C.GEMV_WARPS,
                      (desc, i32(nmat), i32(units), x, i32(ldx), i32(n), i32(l0), pf),
                      shared_mem=gemv_shared_bytes(fmt, nt), cluster=cluster)

    def _merged_kernel(self, n: int, final: bool, use_gemm: bool) -> str | None:
        """The cuda/gemv_wg.cu entry that runs this plan's two launches as one grid for a block of n lanes
        (constants GEMV_MERGE), or None: a plan of a bf16 launch (v1, no cluster) then a q4 one on gemv_wg whose
        entry has a _g twin (n8 / n8d / n16) -- the GDN layer's decay / beta gates and qkvz. Same units, so the
        same bits (gemv_v1.cuh gemv_body_w4)."""
        if not C.GEMV_MERGE or use_gemm or len(self.launches) != 2 or self.impl == "v2" or n > GEMV_MAX_LANES:
            return None
        (f0, _d0, _m0, u0), (f1, _d1, _m1, u1) = self.launches
        pf = self.pf if final else None
        if f0 != L.FMT_BF16 or f1 != L.FMT_Q4 or self.clusters[0] != 1:
            return None
        if not self._on_wg(f1, u1, self.clusters[1], n, pf):
            return None
        # the entry a grid of both launches' units takes (GEMV_MERGE 2 at <= 8 lanes: 276 units overrun n8d's 264 slots,
        # so the plain entry's 3 an SM); a second wave would cost more than the gates' own launch
        nl, units = gemv_wg_width(n), u0 + u1
        name = gemv_wg_kernel(nl, units, self.unit_chunks[1])
        if units > _wg_entry(name)[0] * Runtime.get().sm_count:
            return None
        return name + "_g" if name in ("gemv8w_q4_n8", "gemv8w_q4_n8d", "gemv8w_q4_n16") else None

    def _launch_merged(self, rt, kernel: str, x, ldx: int, n: int, l0: int) -> None:
        """The plan's bf16 launch and q4 launch for lanes l0 .. l0 + n - 1 as one grid of `kernel` (_merged_kernel):
        its first CTAs the bf16 units (fp32 rows x), the rest the q4 units (the plan's a8 activations)."""
        (_f0, d0, m0, u0), (_f1, d1, m1, u1) = self.launches
        nl = gemv_wg_width(n)
        smem = max(gemv_wg_launch_bytes(nl, u0 + u1, self.unit_chunks[1]),
                   gemv_shared_bytes(L.FMT_BF16, nl // 8, threads=128))
        rt.launch("gemv_wg", kernel, u0 + u1, 128,
                  (d1, i32(m1), i32(u1), self.xq, i32(self.xq.shape[1]), self.xs, np.uint32(0x80808080), i32(n),
                   i32(l0), d0, i32(m0), i32(u0), x, i32(ldx)),
                  shared_mem=smem)

    def _chunks_max(self, desc) -> int:
        """The most chunks a unit of the launch whose descriptors are `desc` streams."""
        return next(self.unit_chunks_max[li] for li, lw in enumerate(self.launches) if lw[1] is desc)

    def _on_dp(self, fmt: int, cluster: int, n: int, pf) -> bool:
        """Whether this plan's launch runs cuda/gemv_dp.cu (constants GEMV_DP4A / GEMV_DP_LANES, read at launch time):
        an a8 q4 launch of at most GEMV_DP_LANES lanes with neither the next-launch prefetch nor clusters (gemv.cu's
        only). Bitwise the tensor-core kernels."""
        return (bool(C.GEMV_DP4A) and self.a8 and fmt == L.FMT_Q4 and 1 <= n <= min(8, C.GEMV_DP_LANES)
                and pf is None and cluster == 1)

    def _on_wg(self, fmt: int, units: int, cluster: int, n: int, pf) -> bool:
        """Whether this plan's launch (format fmt, `units` CTAs, n lanes) runs cuda/gemv_wg.cu: a8 q4 launches
        the mode takes, except those with the next-launch prefetch or thread-block clusters (gemv.cu's only)."""
        return self.a8 and fmt == L.FMT_Q4 and pf is None and cluster == 1 and self._wgmma(n, units)

    def _wide_block(self, n: int, final: bool) -> bool:
        """Whether a block of n = 17..32 lanes runs as _run_wide: some q4 launch of it goes to gemv8w_q4_n32."""
        if not self.wide:
            return False
        last = len(self.launches) - 1
        return any(self._on_wg(fmt, units, cluster, n, self.pf if (final and li == last) else None)
                   for li, ((fmt, _d, _m, units), cluster) in enumerate(zip(self.launches, self.clusters)))

    def _run_wide(self, rt, x, ldx: int, n: int, l0: int, final: bool, skip_bf16: bool = False) -> None:
        """Lanes l0 .. l0 + n - 1 (17 <= n <= 32) as one block: their a8 activations quantized into the 32-lane
        buffers as two 16-lane halves (quant_act8 writes gemv8's [chunk][GEMV_MAX_LANES] scales, so a launch
        per half, the second's scales into xs[1]), then each q4 launch that may run on gemv_wg as ONE
        gemv8w_q4_n32 launch over all n lanes (the weights streamed once), and every other launch -- bf16 /
        q8 matrices, clusters, the next-launch prefetch -- as the two 16-lane launches of the narrow loop
        (the prefetch, as there, on the second). Each lane's outputs are the same bits either way."""
        ldq = self.xq.shape[1]
        halves = [(0, GEMV_MAX_LANES, self.xq, self.xs[0]),
                  (GEMV_MAX_LANES, n - GEMV_MAX_LANES, self.xq[GEMV_MAX_LANES:], self.xs[1])]
        for o, m, xq, xs in halves:
            self._quant_act8(rt, x, ldx, l0 + o, m, xq, xs)
        last = len(self.launches) - 1
        for li, ((fmt, desc, nmat, units), cluster) in enumerate(zip(self.launches, self.clusters)):
            if skip_bf16 and fmt == L.FMT_BF16:
                continue
            pf = self.pf if (final and li == last) else None
            if self._on_wg(fmt, units, cluster, n, pf):
                rt.launch("gemv_wg", gemv_wg_kernel(GWG_MAX_LANES, units), units, 128,
                          (desc, i32(nmat), i32(units), self.xq, i32(ldq), self.xs,
                           np.uint32(0x80808080), i32(n), i32(l0)),
                          shared_mem=gemv_wg_shared_bytes(GWG_MAX_LANES, units))
                continue
            for h, (o, m, xq, xs) in enumerate(halves):
                self._launch(rt, fmt, desc, nmat, units, cluster, x, ldx, m, l0 + o, pf if h else None, xq, xs,
                             self.unit_chunks[li])

    def _wgmma(self, n: int, units: int) -> bool:
        """Whether this plan's a8 q4 launch of `units` CTAs and n lanes runs cuda/gemv_wg.cu (the next-launch
        prefetch and thread-block clusters are gemv.cu's only: such launches stay there)."""
        mode = GEMV_WGMMA if self.wgmma is None else self.wgmma
        if mode == "off" or not gemv_wgmma_supported():
            return False
        if mode == "auto":
            slots = gemv_wg_ctas(8 if n <= 8 else 16) * Runtime.get().sm_count
            return n == 1 or n > 8 or units >= GWG_AUTO_WAVES * slots
        return mode == "all" or n > 8

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.mats)


# ---------------------------------------------------------------- prefill GEMM
GEMM_MIN_TOKENS = 32  # below this the GEMV (16 lanes per weight pass) is as good


# ---------------------------------------------------------------- next-launch L2 prefetch
PF_MAX_UNITS16 = 0xFFFF  # a range's length field: 16-bit count of 16-byte units (<= 1 MiB)


def gemv_slots(sm_count: int) -> int:
    """Resident v1 / a8 GEMV CTAs of the 1-lane kernels (their launch bounds: 2 per SM)."""
    return C.A8_CTAS_NT1 * sm_count


def prefetch_ranges(next_desc: list[tuple[int, np.ndarray, int]], budget: int, slots: int) -> list[tuple[int, int]]:
    """The L2 ranges (address, bytes) worth prefetching for the launches of the next plan, in their
    run order: for each launch, its first-wave CTAs (the first `slots` units: they start first),
    and of each such unit's GEMV_R tiles the first chunks of its K range, the ones its warps'
    rings fill first (cuda/gemv.cu gemv_loop reads each tile from its split's first chunk on).
    Every tile gets the same number of chunks, sized so the total stays within `budget` bytes."""
    tiles = []  # (tile start address of the unit's K range, chunk bytes, chunks in the range)
    for fmt, desc, _units in next_desc:
        cb = L.CHUNK_BYTES[fmt]
        for f in desc:
            s, kch, rts = int(f[C.D_SPLITS]), int(f[C.D_KCH]), int(f[C.D_RT])
            cta0, nunits = int(f[C.D_CTA0]), int(f[C.D_RG]) * int(f[C.D_SPLITS])
            for v in range(min(nunits, max(0, slots - cta0))):
                rg, sp = divmod(v, s)
                c0, c1 = sp * kch // s, (sp + 1) * kch // s
                for i in range(GEMV_R):
                    t = rg * GEMV_R + i
                    if t < rts:
                        tiles.append((int(f[C.D_W]) + t * kch * cb + c0 * cb, cb, c1 - c0))
    if not tiles or budget <= 0:
        return []
    # the same number of chunks per tile: the largest that keeps the total within budget
    per_tile = budget / len(tiles)
    out = []
    for a, cb, nch in tiles:
        k = min(nch, int(per_tile // cb), PF_MAX_UNITS16 * 16 // cb)
        if k > 0:
            out.append((a, k * cb))
    return out


def prefetch_words(ranges: list[tuple[int, int]], units: int, slots: int) -> np.ndarray:
    """[units][GEMV_PF_PER] uint64 words for a launch of `units` CTAs: the ranges dealt round-robin
    to its last wave (the CTAs that finish last, so the prefetch fills the launch's tail and the
    kernels after it). A word is address | (bytes / 16) << 48; ranges past the capacity are dropped."""
    words = np.zeros((units, C.GEMV_PF_PER), dtype=np.uint64)
    first = max(0, units - slots)
    issuers = units - first
    for j, (a, nb) in enumerate(ranges[: issuers * C.GEMV_PF_PER]):
        assert a % 16 == 0 and nb % 16 == 0 and 0 < nb // 16 <= PF_MAX_UNITS16 and a < 1 << 48
        words[first + j % issuers, j // issuers] = np.uint64(a | (nb // 16) << 48)
    return words


def link_prefetch(plans: list["GemvPlan"], budget_bytes: int, cyclic: bool = True) -> None:
    """Each plan's last launch prefetches into L2 the first bytes the next plan's launches read
    (plans in the order a decode step runs them; cyclic: the last one is followed by the first,
    else it is left as it is). budget 0 clears it. v2 plans neither issue nor receive (their kernels take no prefetch list). Writes
    the words in place, so graphs captured before a relink see the new ranges."""
    rt = Runtime.get()
    slots = gemv_slots(rt.sm_count)
    n = len(plans)
    for i, p in enumerate(plans):
        if p.impl == "v2" or (not cyclic and i == n - 1):
            continue
        nxt = plans[(i + 1) % n]
        _fmt, _desc, units = p.desc_host[-1]
        ranges = [] if nxt.impl == "v2" or budget_bytes <= 0 else prefetch_ranges(nxt.desc_host, budget_bytes, slots)
        words = prefetch_words(ranges, units, slots)
        if p.pf is None:
            if not ranges:
                continue
            p.pf = rt.cp.asarray(words)
        else:
            p.pf.set(words)


def gemm_f32_route(ntok: int) -> bool:
    """Whether a prefill chunk of ntok tokens runs its small bf16 matrices (blas.f32_route) through cuBLAS
    -- PREFILL_SMALL_GEMM picks how -- instead of the GEMV in blocks of 16 lanes: the chunks the cuBLAS route
    takes (the prefill tolerance class), never the gates' short prompts or the verify lanes."""
    from q27py.gpu import blas

    return PREFILL_GEMM != "kernel" and ntok >= blas.MIN_TOKENS and blas.available()


def gemm_supported(m: GpuMatrix) -> bool:
    # bf16 weights stay on the GEMV, whose hi + lo activations keep fp32-grade results
    return m.shape.fmt in (L.FMT_Q4, L.FMT_Q8) and m.shape.group == L.DEFAULT_GROUP[m.shape.fmt]


# "auto": cuBLAS on a bf16 expansion of the weights for chunks of >= blas.MIN_TOKENS tokens, the
# mma.sync kernel below that; "fp8": the same chunks through cuBLASLt's fp8 GEMM on e4m3 weights and
# activations (sm_89+, else "auto"; its own tolerance class, docs/QUANT.md); "kernel": always the
# kernel (A/B runs). Set from EngineConfig.prefill_gemm.
PREFILL_GEMM = "auto"


# How the chunks gemm_f32_route takes multiply their small bf16 matrices (the GDN gates' ab): "bf16x3f" (the default:
# blas.prefill_gemm_bf16x3f, x split exactly into three bf16 terms in one fused tensor-core kernel), "bf16x3" (the same
# terms as blas.prefill_gemm_split3: a split pass, cuBLAS GEMMs, a combine) or "f32" (blas.prefill_gemm_f32: fp32 copies
# of the weights, pedantic SGEMM). All fp32-grade, different bits (q27py/config.py says why the default).
# EngineConfig.prefill_small_gemm (env Q27_PREFILL_SMALL_GEMM) is the module default, so models built
# directly (gates, benches, tests) follow it as engines do; load_fast_model sets it from the engine's config.
def prefill_small_gemm_mode(mode: str) -> str:
    """EngineConfig.prefill_small_gemm, checked when the model loads (a typo fails there, not mid-request)."""
    from q27py.config import PREFILL_SMALL_GEMM_CHOICES

    if mode not in PREFILL_SMALL_GEMM_CHOICES:
        raise ValueError(f"prefill_small_gemm must be one of {', '.join(PREFILL_SMALL_GEMM_CHOICES)}, not {mode!r}")
    return mode


def _prefill_small_gemm_default() -> str:
    from q27py.config import engine_env

    return prefill_small_gemm_mode(engine_env().prefill_small_gemm)


PREFILL_SMALL_GEMM = _prefill_small_gemm_default()


# Whether the MLP's gate_up GEMM of a prefill chunk on cuBLAS's bf16 route (gemm_bf16_route: >= blas.MIN_TOKENS
# tokens, never decode / verify / the gates' short prompts) writes its gate and up rows as bf16 (fp32 accumulation,
# one round to nearest each) for SwiGLU to read (blas._gemm_expanded, cuda/dequant.cu swiglu_tiles_zbf16*) instead
# of fp32 rows: half the bytes of that pass (+3.0% on an 8K prefill of the 27B, H100). Its own tolerance class
# (docs/QUANT.md "bf16 gate_up before SwiGLU"), on by default (q27py/config.py says why).
# EngineConfig.prefill_gate_up_bf16 (env Q27_PREFILL_GATE_UP_BF16) is the module default, so models built
# directly (gates, benches, tests) follow it as engines do; load_fast_model sets it from the engine's config. Read
# per call (a test or bench may switch it on one model).
def _prefill_gate_up_bf16_default() -> bool:
    from q27py.config import engine_env

    return bool(engine_env().prefill_gate_up_bf16)


PREFILL_GATE_UP_BF16 = _prefill_gate_up_bf16_default()


def gemm_bf16_route(m: GpuMatrix, ntok: int) -> bool:
    """Whether GemvPlan.run multiplies m for a chunk of ntok tokens through cuBLAS on bf16 activations
    (gemm's cuBLAS branch, not its fp8 one, nor the mma.sync kernel): x's producer may then write the
    bf16 rows itself (GemvPlan.gemm_inputs) and a SwiGLU matrix may write bf16 rows (swiglu_bf16)."""
    if ntok < GEMM_MIN_TOKENS or PREFILL_GEMM == "kernel" or not gemm_supported(m):
        return False  # decode, verify and the short pieces: no import, no lookups (asked per matrix per chunk)
    from q27py.gpu import blas

    return ntok >= blas.MIN_TOKENS and blas.available() and not (PREFILL_GEMM == "fp8" and blas.fp8_available())


def gemm(m: GpuMatrix, x, ldx: int, ntok: int, y, ldy: int, x_bf16=None, y_bf16=None) -> None:
    """Y[t] (mode)= W x[t] for ntok tokens, tensor-core tiles of 128 rows x 64 tokens (cuda/gemm.cu),
    or through cuBLAS (q27py/gpu/blas.py) for large chunks. x_bf16 / y_bf16: blas.prefill_gemm's (only
    where gemm_bf16_route holds)."""
    from q27py.gpu import blas

    assert (x_bf16 is None and y_bf16 is None) or gemm_bf16_route(m, ntok)
    if PREFILL_GEMM != "kernel" and ntok >= blas.MIN_TOKENS and blas.available():
        if PREFILL_GEMM == "fp8" and blas.fp8_available():
            blas.prefill_gemm_fp8(m, x, ldx, ntok, y, ldy)
        else:
            blas.prefill_gemm(m, x, ldx, ntok, y, ldy, x_bf16=x_bf16, y_bf16=y_bf16,
                              z_bf16=PREFILL_GATE_UP_BF16 and m.mode == MODE_SWIGLU)
        return
    fmt = m.shape.fmt
    slot = GEMV_WPC[fmt] * 16 + 4  # weight words + scale word per thread and stage
    threads = 32 * C.GM_WARPS
    smem = 2 * C.GM_TOK * C.GM_XS * 2 + C.GM_STAGES * threads * slot
    grid = (-(-m.shape.row_tiles // C.GM_WARPS), -(-ntok // C.GM_TOK))  # a 16-row tile per warp
    Runtime.get().launch("gemm", f"gemm_{FMT_KERNEL[fmt]}", grid, threads,
                         (m.codes, m.scales, i32(m.shape.kchunks), i32(m.shape.groups), i32(m.shape.row_tiles), x,
                          i32(ldx), i32(ntok), y, i32(ldy), i32(m.nout), i32(m.mode)), shared_mem=smem)


# ---------------------------------------------------------------- quantize / pack on the GPU
def pack_on_gpu(src, rows: int, cols: int, fmt: int, group: int | None = None, src_bf16: bool = False,
                ld: int | None = None, mode: int = MODE_STORE, out_rows: int | None = None) -> GpuMatrix:
    """Quantize + pack a device matrix (fp32, or bf16 bits as uint16) into the GEMV layout."""
    rt = Runtime.get()
    cp = rt.cp
    shape = L.matrix_shape(rows, cols, fmt, group)
    ld = cols if ld is None else ld
    codes = cp.empty(shape.code_bytes, dtype=cp.uint8)
    scales = None
    plain = None
    if fmt != L.FMT_BF16:
        scales = cp.empty(shape.row_tiles * shape.groups * 8, dtype=cp.uint32)
        plain = cp.empty(rows * shape.groups, dtype=cp.uint16)
        n = rows * shape.groups
        rt.launch("quant", "quant_scales", -(-n // 256), 256,
                  (src, i32(src_bf16), i32(rows), i32(cols), i64(ld), i32(shape.group), f32(L.QMAX[fmt]),
                   i32(shape.groups), plain))
    rt.launch("quant", "pack_matrix", (shape.kchunks, shape.row_tiles), 32,
              (src, i32(src_bf16), i32(rows), i32(cols), i64(ld), i32(fmt), i32(shape.kchunks),
               i32(shape.group_chunks), i32(shape.groups), plain, codes, scales))
    return GpuMatrix(shape, codes, scales, mode, out_rows)


def random_matrix(rows: int, cols: int, fmt: int, seed: int, scale: float, mode: int = MODE_STORE,
                  out_rows: int | None = None) -> GpuMatrix:
    """Seeded random codes and scales made on the device (benchmarks: no host copy of the model).

    Codes are uniform, so a weight's standard deviation is about 4.6 * scale (q4) or
    74 * scale (q8); bf16 weights are uniform in [-scale, scale).
    """
    rt = Runtime.get()
    cp = rt.cp
    shape = L.matrix_shape(rows, cols, fmt)
    codes = cp.empty(shape.code_bytes, dtype=cp.uint8)
    if fmt == L.FMT_BF16:
        n = shape.code_bytes // 2
        rt.launch("quant", "fill_random_bf16", min(-(-n // 256), 65535), 256,
                  (codes, i64(n), u64(seed), f32(-scale), f32(scale)))
        return GpuMatrix(shape, codes, None, mode, out_rows)
    n = shape.code_bytes // 4
    rt.launch("quant", "fill_random_u32", min(-(-n // 256), 65535), 256, (codes, i64(n), u64(seed)))
    scales = cp.empty(shape.row_tiles * shape.groups * 8, dtype=cp.uint32)
    rt.launch("quant", "fill_random_scales", min(-(-scales.size // 256), 65535), 256,
              (scales, i64(scales.size), u64(seed + 1), f32(0.5 * scale), f32(1.5 * scale)))
    return GpuMatrix(shape, codes, scales, mode, out_rows)


def fill_uniform(arr, seed: int, lo: float, hi: float) -> None:
    Runtime.get().launch("quant", "fill_random_f32", min(-(-arr.size // 256), 65535), 256,
                         (arr, i64(arr.size), u64(seed), f32(lo), f32(hi)))


# ---------------------------------------------------------------- embeddings
@dataclass
class GpuTable:
    """Row-major embedding table on the device (fp32, bf16 bits, or int8 codes + fp16 scales)."""

    fmt: int
    data: object
    ld: int
    scales: object | None = None
    group: int = 128
    groups: int = 1

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + (int(self.scales.nbytes) if self.scales is not None else 0)


def table_on_gpu(src, rows: int, cols: int, fmt: int, src_bf16: bool = False, group: int = 128) -> GpuTable:
    rt = Runtime.get()
    cp = rt.cp
    if fmt == TAB_F32:
        return GpuTable(TAB_F32, src.astype(cp.float32).reshape(rows, cols), cols)
    if fmt == TAB_BF16:
        out = cp.empty(rows * cols, dtype=cp.uint16)
        rt.launch("quant", "to_bf16_rows", -(-out.size // 256), 256, (src, i32(src_bf16), i64(out.size), out))
        return GpuTable(TAB_BF16, out, cols)
    groups = -(-cols // group)
    plain = cp.empty(rows * groups, dtype=cp.uint16)
    rt.launch("quant", "quant_scales", -(-(rows * groups) // 256), 256,
              (src, i32(src_bf16), i32(rows), i32(cols), i64(cols), i32(group), f32(127.0), i32(groups), plain))
    codes = cp.empty(rows * cols, dtype=cp.int8)
    rt.launch("quant", "quant_rows_q8", -(-codes.size // 256), 256,
              (src, i32(src_bf16), i32(rows), i32(cols), i64(cols), i32(group), i32(groups), plain, codes, i64(cols)))
    return GpuTable(TAB_Q8, codes, cols, plain, group, groups)


def embed(ids, nlanes: int, table: GpuTable, hidden: int, out, ldo: int) -> None:
    Runtime.get().launch("embed", "embed_rows", nlanes, 256,
                         (ids, table.data, i32(table.fmt), i64(table.ld), table.scales, i32(table.groups),
                          i32(table.group), i32(hidden), out, i32(ldo)))


# ---------------------------------------------------------------- norms
def rmsnorm(x, ldx: int, w, eps: float, hidden: int, y, ldy: int, nlanes: int, add_one: bool = True,
            a8: "GemvPlan | None" = None) -> None:
    """y = rmsnorm(x); with a8 (a plan whose run() will get prequantized=True) the same launch also
    writes that plan's int8 activations of y (norm.cu rmsnorm_rows_a8: the bytes quant_act8 makes)."""
    args = (x, i32(ldx), w, f32(1.0 if add_one else 0.0), f32(eps), i32(hidden), y, i32(ldy))
    block = 1024 if hidden >= 2048 else 256
    if a8 is None:
        Runtime.get().launch("norm", "rmsnorm_rows", nlanes, block, args)
        return
    assert a8.a8 and nlanes <= GEMV_MAX_LANES and a8.kpad <= ldy
    Runtime.get().launch("norm", "rmsnorm_rows_a8", nlanes, block,
                         args + (i32(a8.kpad // L.CHUNK_K), a8.xq, i32(a8.xq.shape[1]), a8.xs))


def rmsnorm_rows(x, ldx: int, w, eps: float, hidden: int, y, ldy: int, nlanes: int, yb=None, ldyb: int = 0,
                 add_one: bool = True) -> None:
    """rmsnorm for prefill chunks (norm.cu rmsnorm_rows_wide): the bits rmsnorm writes, more rows per SM
    in flight; y (fp32) and / or yb (bf16 bits, the cuBLAS route's input) -- either may be None."""
    assert y is not None or yb is not None
    wide = 1024 if hidden >= 2048 else 256  # rmsnorm's block for this row length: the tree to reproduce
    Runtime.get().launch("norm", "rmsnorm_rows_wide", nlanes, 256,
                         (x, i32(ldx), w, f32(1.0 if add_one else 0.0), f32(eps), i32(hidden), i32(wide), y, i32(ldy),
                          yb, i32(ldyb)))


def gated_rmsnorm_rows(o, ldo: int, z, ldz: int, w, eps: float, nlanes: int, hv: int, dv: int, y, ldy: int,
                       yb=None, ldyb: int = 0) -> None:
    """gated_rmsnorm for prefill chunks (norm.cu gated_rmsnorm_rows): its bits, C.GATED_ROWS tokens of a
    head per block; y (fp32) and / or yb (bf16 bits) -- either may be None."""
    assert y is not None or yb is not None
    block = max(32, -(-dv // 32) * 32)
    Runtime.get().launch("norm", "gated_rmsnorm_rows", (-(-nlanes // C.GATED_ROWS), hv), block,
                         (o, i32(ldo), z, i32(ldz), w, f32(eps), i32(dv), i32(nlanes), y, i32(ldy), yb, i32(ldyb)))


def gated_rmsnorm_fuses(plan: "GemvPlan", nlanes: int, hv: int, dv: int) -> bool:
    """Whether gated_rmsnorm can write `plan`'s a8 activations itself (then plan.run(prequantized=True)):
    each value head owns whole 64-k chunks and the plan's K is exactly the heads."""
    return plan.fuses_quant(nlanes) and dv % L.CHUNK_K == 0 and dv <= C.GATED_A8_MAX_DV and plan.kpad == hv * dv


def attention_a8_fuses(plan: "GemvPlan", nlanes: int, nq: int, hd: int) -> bool:
    """Whether the decode / verify attention's combine can write `plan`'s a8 activations of its gated output
    (the wrappers' a8=; then plan.run(prequantized=True)): each q head owns whole 64-k chunks and the plan's
    K is exactly the heads. The attention kernels' a8 rows follow their output rows, one per lane."""
    return plan.fuses_quant(nlanes) and hd % L.CHUNK_K == 0 and hd <= C.ATT_A8_MAX_HD and plan.kpad == nq * hd


def _att_a8(a8: "GemvPlan | None", nlanes: int, nq: int, hd: int) -> tuple:
    """An attention combine's (xq, ldq, xs) arguments: a8's int8 activations (attention_a8_fuses), or nulls."""
    assert a8 is None or attention_a8_fuses(a8, nlanes, nq, hd)
    return _a8_args(a8)


def gated_rmsnorm(o, ldo: int, z, ldz: int, w, eps: float, nlanes: int, hv: int, dv: int, y, ldy: int,
                  a8: "GemvPlan | None" = None) -> None:
    """The GDN output norm; with a8 (gated_rmsnorm_fuses) the same launch also writes that plan's
    int8 activations (norm.cu gated_rmsnorm_a8: the bytes quant_act8 makes from y)."""
    block = max(32, -(-dv // 32) * 32)
    args = (o, i32(ldo), z, i32(ldz), w, f32(eps), i32(dv), y, i32(ldy))
    if a8 is None:
        Runtime.get().launch("norm", "gated_rmsnorm", (nlanes, hv), block, args)
        return
    assert gated_rmsnorm_fuses(a8, nlanes, hv, dv)
    Runtime.get().launch("norm", "gated_rmsnorm_a8", (nlanes, hv), block, args + (a8.xq, i32(a8.xq.shape[1]), a8.xs))


# ---------------------------------------------------------------- Gated DeltaNet
@dataclass(frozen=True)
class GatesInConv:
    """constants GDN_GATES_IN_CONV: what gdn_conv's v-head blocks need to compute the decay / beta gates themselves
    (cuda/conv.cu gates_dot2) instead of reading the bf16 GEMV's output ab: the gates matrix (a bf16 GpuMatrix of
    2 x HV rows, b then a) and the lanes' normed rows x (row stride ldx; lane b's row b)."""
    mat: "GpuMatrix"
    x: object
    ldx: int

    def args(self) -> tuple:
        assert self.mat.shape.fmt == L.FMT_BF16
        return (self.mat.codes, i32(self.mat.shape.kchunks), self.x, i32(self.ldx))


def _gates_args(gates: GatesInConv | None) -> tuple:
    return (None, i32(0), None, i32(0)) if gates is None else gates.args()


def gdn_conv(raw, ldr: int, window, convw, ab, ldab: int, neg_a, dt_bias, h: int, hv: int, dk: int, dv: int, kw: int,
             qkvn, gb, nlanes: int, gates: GatesInConv | None = None, commit: bool = False) -> None:
    """gates: the v-head blocks compute b / a from the normed rows (GatesInConv); None: they read ab. commit (one lane
    only, constants CONV_COMMIT_FOLD): the window also slides by the lane's raw row, as gdn_conv_commit(n=1) would."""
    assert not commit or nlanes == 1, "the window slides in the conv for one committing lane only"
    block = max(32, -(-max(dk, dv) // 32) * 32)
    Runtime.get().launch("conv", "gdn_conv", (nlanes, 2 * h + hv), block,
                         (raw, i32(ldr), window, convw, ab, i32(ldab), neg_a, dt_bias, i32(h), i32(hv), i32(dk),
                          i32(dv), i32(kw), f32(np.float32(dk) ** np.float32(-0.5)), qkvn, gb, *_gates_args(gates),
                          window if commit else None))


def gdn_conv_rows(raw, ldr: int, window, convw, ab, ldab: int, neg_a, dt_bias, h: int, hv: int, dk: int, dv: int,
                  kw: int, qkvn, gb, nlanes: int) -> None:
    """gdn_conv for prefill chunks (conv.cu gdn_conv_rows_k4): its bits, C.CONV_ROWS tokens of a head slot
    per block with the taps slid in registers; gdn_conv itself for a tap count other than 4."""
    if kw != 4:
        gdn_conv(raw, ldr, window, convw, ab, ldab, neg_a, dt_bias, h, hv, dk, dv, kw, qkvn, gb, nlanes)
        return
    block = max(32, -(-max(dk, dv) // 32) * 32)
    Runtime.get().launch("conv", "gdn_conv_rows_k4", (-(-nlanes // C.CONV_ROWS), 2 * h + hv), block,
                         (raw, i32(ldr), window, convw, ab, i32(ldab), neg_a, dt_bias, i32(h), i32(hv), i32(dk),
                          i32(dv), f32(np.float32(dk) ** np.float32(-0.5)), i32(nlanes), qkvn, gb))


def gdn_conv_commit(window, window_stride: int, raw, ldr: int, raw_stride: int, channels: int, kw: int, layers: int,
                    n_dev=None, n: int = 0) -> None:
    Runtime.get().launch("conv", "gdn_conv_commit", (-(-channels // 256), layers), 256,
                         (window, i64(window_stride), raw, i32(ldr), i64(raw_stride), i32(channels), i32(kw),
                          n_dev, i32(n)))


def _gdn_step_kernel(dk: int, suffix: str = "") -> str:
    kpl = -(-dk // 32)
    if kpl > 4:
        raise ValueError(f"GDN key head dim {dk} > 128 is not supported by the fast path")
    return f"gdn_step{suffix}_k{4 if kpl > 2 else kpl}"


def gdn_column_blocks(hv: int, dv: int) -> int:
    """CTAs per layer of the recurrence: each GDN_ST_WARPS warps x 32 / GDN_ST_LPC columns of one head."""
    return hv * -(-dv // (32 // C.GDN_ST_LPC * C.GDN_ST_WARPS))


def gdn_step(state, state_stride: int, qkvn, qkvn_stride: int, gb, gb_stride: int, out, ldo: int, h: int, hv: int,
             dk: int, dv: int, nlanes: int, layers: int = 1, n_dev=None, emit: bool = True,
             write_state: bool = False) -> None:
    Runtime.get().launch("gdn", _gdn_step_kernel(dk), (gdn_column_blocks(hv, dv), layers), 32 * C.GDN_ST_WARPS,
                         (state, i64(state_stride), qkvn, i64(qkvn_stride), gb, i64(gb_stride), out, i32(ldo), i32(h),
                          i32(hv), i32(dk), i32(dv), i32(nlanes), n_dev, i32(1 if emit else 0),
                          i32(1 if write_state else 0)))


# decode_batch (FastModel.decode_batch): lanes of different sequences, each its own one-token step.
# `lanes` is the model's lane table (constants LT_*: per lane its state's base addresses, then the
# positions and ids); *_off are the byte offsets of this layer inside each state's arrays (every
# state of a model has the same shapes). Each entry runs the one-sequence kernel's body for t = 0,
# so lane b's bits are those of a one-token forward of its sequence whatever the other lanes are.
def gdn_conv_lanes(raw, ldr: int, lanes, win_off: int, convw, ab, ldab: int, neg_a, dt_bias, h: int, hv: int, dk: int,
                   dv: int, kw: int, qkvn, gb, nlanes: int, gates: GatesInConv | None = None, commit: bool = False) -> None:
    """gdn_conv for nlanes lanes, lane b tapping its own state's window (+ win_off bytes) and raw row b. commit
    (CONV_COMMIT_FOLD): each lane's window also slides by its raw row, as gdn_conv_commit_lanes would."""
    block = max(32, -(-max(dk, dv) // 32) * 32)
    Runtime.get().launch("conv", "gdn_conv_lanes", (nlanes, 2 * h + hv), block,
                         (raw, i32(ldr), lanes, i64(win_off), convw, ab, i32(ldab), neg_a, dt_bias, i32(h), i32(hv),
                          i32(dk), i32(dv), i32(kw), f32(np.float32(dk) ** np.float32(-0.5)), qkvn, gb,
                          *_gates_args(gates), i32(1 if commit else 0)))


def gdn_conv_commit_lanes(lanes, win_off: int, raw, ldr: int, channels: int, kw: int, nlanes: int) -> None:
    """Slide each lane's window (its state's, + win_off bytes) by its one raw row."""
    Runtime.get().launch("conv", "gdn_conv_commit_lanes", (-(-channels // 256), nlanes), 256,
                         (lanes, i64(win_off), raw, i32(ldr), i32(channels), i32(kw)))


def gdn_step_lanes(lanes, state_off: int, qkvn, gb, out, ldo: int, h: int, hv: int, dk: int, dv: int,
                   nlanes: int) -> None:
    """gdn_step(emit, write_state) of one token per lane, lane b on its own state's S (+ state_off bytes)."""
    Runtime.get().launch("gdn", _gdn_step_kernel(dk, "_lanes"), (gdn_column_blocks(hv, dv), nlanes),
                         32 * C.GDN_ST_WARPS,
                         (lanes, i64(state_off), qkvn, gb, out, i32(ldo), i32(h), i32(hv), i32(dk), i32(dv), i32(1),
                          i32(1), i32(1)))


# verify_batch / commit_batch (FastModel.verify_batch): several sequences' verify lanes in one launch.
# `groups` is the model's group table (constants GT_*: per group its first lane row, lane count and kept
# count, per lane its group), beside the lane table. Each entry runs the one-sequence kernel's body on a
# group as that sequence's solo verify (or commit) runs it, so every lane's bits are the solo call's.
def gdn_conv_groups(raw, ldr: int, lanes, groups, win_off: int, convw, ab, ldab: int, neg_a, dt_bias, h: int, hv: int,
                    dk: int, dv: int, kw: int, qkvn, gb, nlanes: int, gates: GatesInConv | None = None) -> None:
    """gdn_conv for the nlanes lanes of a verify_batch: lane b is lane b - r0 of its group's verify (its
    state's window + win_off bytes, the group's raw rows from r0), outputs in rows b; no window commit."""
    block = max(32, -(-max(dk, dv) // 32) * 32)
    Runtime.get().launch("conv", "gdn_conv_groups", (nlanes, 2 * h + hv), block,
                         (raw, i32(ldr), lanes, groups, i64(win_off), convw, ab, i32(ldab), neg_a, dt_bias, i32(h),
                          i32(hv), i32(dk), i32(dv), i32(kw), f32(np.float32(dk) ** np.float32(-0.5)), qkvn, gb,
                          *_gates_args(gates), None))


def gdn_conv_commit_groups(lanes, groups, win_layer_bytes: int, raw, ldr: int, raw_stride: int, channels: int,
                           kw: int, layers: int, ngroups: int) -> None:
    """commit_batch's window slide: group g's state window (every layer: + layer x win_layer_bytes) by its
    GT_KEEP kept raw rows from row r0 of each layer's records (raw_stride floats apart)."""
    Runtime.get().launch("conv", "gdn_conv_commit_groups", (-(-channels // 256), layers, ngroups), 256,
                         (lanes, groups, i64(win_layer_bytes), raw, i32(ldr), i64(raw_stride), i32(channels), i32(kw)))


def gdn_step_groups(lanes, groups, count_field: int, state_off: int, state_layer_bytes: int, qkvn, qkvn_stride: int,
                    gb, gb_stride: int, out, ldo: int, h: int, hv: int, dk: int, dv: int, ngroups: int,
                    layers: int = 1, emit: bool = True, write_state: bool = False) -> None:
    """gdn_step per group: group g on its state's S (+ state_off + layer x state_layer_bytes), its rows r0..
    of qkvn / gb (+ layer x *_stride floats) and out, over the group table's count_field lanes (C.GT_COUNT:
    the verify, emit; C.GT_KEEP: the commit replay, write_state, 0 = untouched)."""
    Runtime.get().launch("gdn", _gdn_step_kernel(dk, "_groups"), (gdn_column_blocks(hv, dv), layers, ngroups),
                         32 * C.GDN_ST_WARPS,
                         (lanes, groups, i32(count_field), i64(state_off), i64(state_layer_bytes), qkvn, i64(qkvn_stride),
                          gb, i64(gb_stride), out, i32(ldo), i32(h), i32(hv), i32(dk), i32(dv), i32(1 if emit else 0),
                          i32(1 if write_state else 0)))


# Fused decode / verify step (cuda/gdn_decode.cu): conv + gates + q/k norm, the delta rule step,
# the gated RMSNorm and (commit) the window slide in one launch, bitwise the chain above.
def gdn_fused_shared_floats(nlanes: int, dk: int, warps: int) -> int:
    """Dynamic shared floats of one block: q/k rows, the block's v columns, g/beta."""
    return nlanes * (2 * dk + warps * C.GDN_FD_COLS + 2)


def gdn_fused_supported(h: int, hv: int, dk: int, dv: int, kw: int, nlanes: int,
                        warps: int = C.GDN_FD_WARPS) -> bool:
    """Shapes the fused kernel runs (callers keep the kernel chain otherwise)."""
    return (dk <= 128 and dv <= 1024 and dv % C.GDN_FD_COLS == 0 and hv % h == 0 and kw - 1 <= 8
            and 1 <= warps <= C.GDN_FD_MAX_WARPS and 4 * gdn_fused_shared_floats(nlanes, dk, warps) <= 48 * 1024)


def gdn_decode_fused(raw, ldr: int, window, convw, ab, ldab: int, neg_a, dt_bias, h: int, hv: int, dk: int, dv: int,
                     kw: int, qkvn, gb, state, out, ldo: int, norm_w, eps: float, y, ldy: int, tickets, nlanes: int,
                     commit: bool, warps: int = C.GDN_FD_WARPS, a8: "GemvPlan | None" = None) -> None:
    """gdn_conv + [gdn_conv_commit] + gdn_step(emit, write_state=commit) + gated_rmsnorm of one layer,
    bitwise: the same records (qkvn, gb), o in `out`, the normed rows in y, and when committing the
    state and window advanced by nlanes. z is read from raw's columns past the conv channels.
    tickets: int32 [h + hv], zero, left zero (the kernel's last arrivals reset them).
    a8 (gated_rmsnorm_fuses): also that plan's int8 activations of y, as gated_rmsnorm(a8=) writes them
    (then the plan runs prequantized: no quant_act8 launch)."""
    if not gdn_fused_supported(h, hv, dk, dv, kw, nlanes, warps):
        raise ValueError(f"fused GDN step: unsupported shape h={h} hv={hv} dk={dk} dv={dv} kw={kw} lanes={nlanes}")
    assert a8 is None or gated_rmsnorm_fuses(a8, nlanes, hv, dv)
    kpl = -(-dk // 32)
    kernel = {1: "gdn_decode_k1", 2: "gdn_decode_k2", 3: "gdn_decode_k4", 4: "gdn_decode_k4"}[kpl]
    nb = -(-dv // (warps * C.GDN_FD_COLS))
    Runtime.get().launch("gdn_decode", kernel, (nb, hv), 32 * warps,
                         (raw, i32(ldr), window, convw, ab, i32(ldab), neg_a, dt_bias, i32(h), i32(hv), i32(dk),
                          i32(dv), i32(kw), f32(np.float32(dk) ** np.float32(-0.5)), qkvn, gb, state, out, i32(ldo),
                          norm_w, f32(eps), y, i32(ldy), *_a8_args(a8), tickets, i32(nlanes), i32(1 if commit else 0)),
                         shared_mem=4 * gdn_fused_shared_floats(nlanes, dk, warps))


def _a8_args(a8: "GemvPlan | None") -> tuple:
    """(xq, ldq, xs) of a plan whose int8 activations a producer kernel writes, or nulls."""
    return (None, i32(0), None) if a8 is None else (a8.xq, i32(a8.xq.shape[1]), a8.xs)


def gdn_fused_lanes_supported(h: int, hv: int, dk: int, dv: int, kw: int, warps: int = C.GDN_FD_WARPS) -> bool:
    """Shapes the decode_batch entry of the fused step runs (its launch bounds: GDN_FD_LANES_MAX_WARPS)."""
    return warps <= C.GDN_FD_LANES_MAX_WARPS and gdn_fused_supported(h, hv, dk, dv, kw, 1, warps)


def gdn_decode_fused_lanes(raw, ldr: int, lanes, win_off: int, state_off: int, convw, ab, ldab: int, neg_a, dt_bias,
                           h: int, hv: int, dk: int, dv: int, kw: int, qkvn, gb, out, ldo: int, norm_w, eps: float,
                           y, ldy: int, tickets, nlanes: int, warps: int = C.GDN_FD_WARPS,
                           a8: "GemvPlan | None" = None) -> None:
    """gdn_decode_fused(commit, one token) per lane, lane b on its own state's window and S (+ win_off /
    state_off bytes), its rows b of raw / ab / qkvn / gb / out / y (and with a8, of the plan's int8
    activations). tickets: int32 [lanes][h + hv], zero, left zero."""
    if not gdn_fused_lanes_supported(h, hv, dk, dv, kw, warps):
        raise ValueError(f"fused GDN lanes step: unsupported shape h={h} hv={hv} dk={dk} dv={dv} kw={kw} warps={warps}")
    assert a8 is None or gated_rmsnorm_fuses(a8, nlanes, hv, dv)
    kpl = -(-dk // 32)
    kernel = {1: "gdn_decode_lanes_k1", 2: "gdn_decode_lanes_k2", 3: "gdn_decode_lanes_k4", 4: "gdn_decode_lanes_k4"}[kpl]
    nb = -(-dv // (warps * C.GDN_FD_COLS))
    Runtime.get().launch("gdn_decode", kernel, (nb, hv, nlanes), 32 * warps,
                         (raw, i32(ldr), lanes, i64(win_off), i64(state_off), convw, ab, i32(ldab), neg_a, dt_bias,
                          i32(h), i32(hv), i32(dk), i32(dv), i32(kw), f32(np.float32(dk) ** np.float32(-0.5)), qkvn,
                          gb, out, i32(ldo), norm_w, f32(eps), y, i32(ldy), *_a8_args(a8), tickets),
                         shared_mem=4 * gdn_fused_shared_floats(1, dk, warps))


def gemv_prefetch_default() -> float:
    """EngineConfig.gemv_prefetch_mb (env Q27_GEMV_PREFETCH_MB), read once."""
    global _GEMV_PREFETCH_MB
    if _GEMV_PREFETCH_MB is None:
        from q27py.config import engine_env

        _GEMV_PREFETCH_MB = float(engine_env().gemv_prefetch_mb)
    return _GEMV_PREFETCH_MB


_GEMV_PREFETCH_MB: float | None = None


def prefetch_budget_bytes(mb: float, l2_bytes: int) -> int:
    """The prefetch budget in bytes: mb MiB, at most a third of the L2 (the next launch's first
    wave must still find its ranges there after the current launch's last stream)."""
    return int(min(max(0.0, mb) * (1 << 20), l2_bytes / 3))


def gdn_fused_default() -> bool:
    """Whether models use the fused step by default: EngineConfig.gdn_fused (env Q27_GDN_FUSED), read once."""
    global _GDN_FUSED
    if _GDN_FUSED is None:
        from q27py.config import engine_env

        _GDN_FUSED = bool(engine_env().gdn_fused)
    return _GDN_FUSED


_GDN_FUSED: bool | None = None


def gdn_prefill_supported(dk: int, dv: int) -> bool:
    return dk <= 128


def gdn_prefill(state, qkvn, gb, out, ldo: int, h: int, hv: int, dk: int, dv: int, nlanes: int) -> None:
    """The sequential prefill route: gdn_step(emit=True, write_state=True) over a long run of lanes
    (the kernel stages GDN_ST_TILE tokens per burst, so a long run is one launch)."""
    gdn_step(state, 0, qkvn, 0, gb, 0, out, ldo, h, hv, dk, dv, nlanes, emit=True, write_state=True)


# Chunked (WY / UT) GDN prefill on tensor cores (cuda/gdn_chunk.cu, cuda/gdn_chunk2.cu; spec
# q27py/model/gdn_chunked.py). "chunked" / "chunked2": prefill runs use it where the shape and the
# card allow; "sequential": gdn_prefill always (bitwise the decode step). EngineConfig.gdn_prefill
# (env Q27_GDN_PREFILL) is the module default, so models built directly (gates, benches, tests)
# follow it as engines do; load_fast_model sets it from the engine's config.
def _gdn_prefill_default() -> str:
    from q27py.config import engine_env

    return engine_env().gdn_prefill


GDN_PREFILL = _gdn_prefill_default()
GDN_CHUNK_BV = 64  # value columns per block
GDN_CHUNK_DK = (64, 128)  # key head dims with a compiled variant


GDN_PREFILL_MODES = ("sequential", "chunked", "chunked2")


def gdn_prefill_mode(mode: str) -> str:
    """EngineConfig.gdn_prefill, checked when the model loads (a typo fails there, not mid-request)."""
    if mode not in GDN_PREFILL_MODES:
        raise ValueError(f"gdn_prefill must be one of {', '.join(GDN_PREFILL_MODES)}, not {mode!r}")
    return mode


def gdn_chunk_floats(dk: int, chunk: int) -> int:
    """Shared-memory floats of one block (ChunkSmem in cuda/gdn_chunk.cu: K, Q, S, A, M, U, G, beta, T)."""
    ldk, ldc, ldv, ldt = dk + 4, chunk + 4, GDN_CHUNK_BV + 8, 16 + 4
    return 2 * chunk * ldk + dk * ldv + 2 * chunk * ldc + chunk * ldv + 2 * chunk + chunk * ldt


def gdn_chunk_size(dk: int, dv: int) -> int:
    """Tokens per chunk the card runs for this head shape: 64 where the block's shared memory
    fits (~160 KB at dk 128: sm_80 / sm_90), else 32 (~90 KB: sm_86 / sm_89 / sm_120); 0 when the
    shape has no variant (callers then take gdn_prefill)."""
    if dk not in GDN_CHUNK_DK or dv % GDN_CHUNK_BV:
        return 0
    rt = Runtime.get()
    if rt.cc < (8, 0):  # mma.sync tf32 needs sm_80
        return 0
    for chunk in (64, 32):
        if 4 * gdn_chunk_floats(dk, chunk) <= rt.smem_optin:
            return chunk
    return 0


def gdn_prefill_chunked(state, qkvn, gb, out, ldo: int, h: int, hv: int, dk: int, dv: int, nlanes: int,
                        pos0: int = 0, chunk: int | None = None) -> None:
    """gdn_prefill's contract (o for every lane, the final state written; state K-last [HV][dv][dk])
    through the chunked form: chunks start at absolute positions that are multiples of the chunk
    size (pos0 = position of lane 0), so pieces split there give the bits of one run. Matches the
    sequential kernel within fp32 rounding (3xTF32 products; tests/gpu/test_gdn_chunk.py)."""
    chunk = chunk or gdn_chunk_size(dk, dv)
    if not chunk:
        raise ValueError(f"no chunked GDN kernel for dk={dk}, dv={dv} on this card")
    if not gdn_chunk_aligned(qkvn, h, hv, dk, dv):
        raise ValueError("gdn_prefill_chunked reads qkvn with float4 loads: its rows must start 16-byte aligned")
    Runtime.get().launch("gdn_chunk", f"gdn_chunk_d{dk}_c{chunk}", (dv // GDN_CHUNK_BV, hv), 256,
                         (state, qkvn, gb, out, i32(ldo), i32(h), i32(hv), i32(dv), i32(nlanes), i32(pos0)),
                         shared_mem=4 * gdn_chunk_floats(dk, chunk))


def gdn_chunk_aligned(qkvn, h: int, hv: int, dk: int, dv: int) -> bool:
    """The chunked kernel's float4 loads need 16-byte aligned rows and head offsets."""
    base = qkvn.data.ptr if hasattr(qkvn, "data") else int(qkvn)
    return base % 16 == 0 and dk % 4 == 0 and dv % 4 == 0 and (2 * h * dk + hv * dv) % 4 == 0


# Three-kernel chunked pipeline (cuda/gdn_chunk2.cu, route "chunked2"; spec gdn_chunked.gdn_chunked_wy):
# a parallel pre-pass over (chunk, head) pairs, the state recurrence over chunks per (64 value
# columns, head), a parallel output pass. Head shapes with a compiled variant: dk = dv in GDN2_D.
GDN2_D = (64, 128)
# The state pass's warps per CTA: 8 (gdn2_state_*_w8, state8_body: 4 pairs of warps, each pair on the 16 value rows
# one warp of the 4-warp form holds, its halves on half of each product's columns) or 4 (state_body). Every choice
# gives the same bits; set 4 to run the 4-warp kernels (A/B: tools/kernel_ab.py --state-ab).
GDN2_STATE_WARPS = 8
# The 8-warp form's presplit operands where they fit: True (W and K), "k" (K alone: half the lo buffer, no barrier
# of its own; two stages only) or False. The 4-warp form presplits W and K (True) where it fits. "k" since device run
# j5 (H100, kernel_ab --state-ab, 27B at 8K, ms per layer): 4-warp W+K 1.055, 8-warp W+K 1.002 / K 0.966 / none 0.996.
GDN2_STATE8_PRESPLIT: bool | str = "k"
GDN2_SPLIT = {False: 0, "k": 1, True: 2}  # presplit -> the kernels' SPLIT: none, K alone (8 warps only), W and K


def gdn2_nchunks(nlanes: int, pos0: int) -> int:
    """Chunks of a run of nlanes lanes whose first lane sits at absolute position pos0 (chunk_spans)."""
    first = C.GDN2_C - pos0 % C.GDN2_C
    return 1 if nlanes <= first else 1 + -(-(nlanes - first) // C.GDN2_C)


def gdn2_max_chunks(nlanes: int) -> int:
    """The most chunks nlanes lanes can span whatever pos0 is (a one-lane ragged first chunk)."""
    return 1 + -(-(nlanes - 1) // C.GDN2_C)


def gdn2_scratch_floats(nchunks: int, hv: int, dk: int, dv: int) -> int:
    """Scratch of one chunked2 run, floats: W [C x dk], U / V_new [C x dv], the chunk's start state
    [dv x dk] and the gates (G as hi + lo, e^{G_last - G}, e^G) [GDN2_GATES x C], per (value head,
    chunk). The 27B (48 x 128 x 128) at 4096 lanes (65 chunks at most): 412.1 MB."""
    c = C.GDN2_C
    return hv * nchunks * (c * dk + c * dv + dv * dk + C.GDN2_GATES * c)


def gdn2_smem_floats(dk: int, dv: int, stages: int, presplit: bool | str = False) -> dict[str, int]:
    """Shared-memory floats of each kernel's block (PrepSmem / StateSmem / OutSmem in cuda/gdn_chunk2.cu);
    presplit: the state pass's extra buffer of W and K tf32 lo halves (StateSmem::LO; "k": K's alone, the
    8-warp kernels' SPLIT 1)."""
    c = C.GDN2_C
    return {"prep": c * (dk + dv + 8) + c * (c + 4) + c * 20 + 4 * c,
            "state": stages * (2 * c * dk + c * C.GDN2_BV + 2 * c) + GDN2_SPLIT[presplit] * c * dk,
            "out": 2 * c * dk + c * (c + 8) + 3 * c}


def gdn2_fits(dk: int, dv: int, stages: int, presplit: bool | str) -> bool:
    """Whether every kernel of the pipeline with this state-pass variant fits the card's opt-in shared memory."""
    return 4 * max(gdn2_smem_floats(dk, dv, stages, presplit).values()) <= Runtime.get().smem_optin


def gdn2_state_variant(dk: int, dv: int, warps: int | None = None) -> tuple[int, bool | str, int]:
    """(cp.async stages, presplit, warps) of the state pass on this card: two stages (next chunk in flight)
    where they fit, and the once-per-CTA operand split where its buffer fits beside them (sm_90: both; sm_80:
    two stages, no presplit; sm_86 / 89 / 120: one stage); the split is W and K (True), for 8 warps
    GDN2_STATE8_PRESPLIT. warps: GDN2_STATE_WARPS unless given (the same shared memory either way).
    (0, False, 0) when the card cannot run the pipeline for this shape (callers take another route)."""
    if dk != dv or dk not in GDN2_D:
        return 0, False, 0
    warps = GDN2_STATE_WARPS if warps is None else warps
    rt = Runtime.get()
    # the card and the module knobs A/B runs change are part of the key
    key = (dk, warps, GDN2_STATE8_PRESPLIT, rt.cc, rt.smem_optin)
    got = _GDN2_VARIANTS.get(key)
    if got is None:
        got = _GDN2_VARIANTS[key] = _gdn2_state_variant(rt, dk, dv, warps)
    return got


_GDN2_VARIANTS: dict = {}  # gdn2_state_variant's answers: asked twice per GDN layer of every prefill chunk


def _gdn2_state_variant(rt, dk: int, dv: int, warps: int) -> tuple[int, bool | str, int]:
    if rt.cc < (8, 0):  # mma.sync tf32 needs sm_80
        return 0, False, 0
    split = GDN2_STATE8_PRESPLIT if warps == 8 else True
    for stages, presplit in ((2, split), (2, False), (1, split), (1, False)):
        if gdn2_state_kernel_exists(stages, presplit, warps) and gdn2_fits(dk, dv, stages, presplit):
            return stages, presplit, warps
    return 0, False, 0


def gdn2_state_kernel_exists(stages: int, presplit: bool | str, warps: int, tf32: bool = False) -> bool:
    """Whether cuda/gdn_chunk2.cu has this state-pass variant (K's presplit alone: 8 warps, two stages; tf32, the
    "tf32 state" class's gdn2_state1_*: 8 warps, no presplit or K's, no lo halves to keep)."""
    if tf32 and (warps != 8 or presplit not in (False, "k")):
        return False
    return warps in (4, 8) and stages in (1, 2) and (presplit != "k" or (warps == 8 and stages == 2))


def gdn2_state_kernel(dk: int, stages: int, presplit: bool | str, warps: int, tf32: bool = False) -> tuple[str, int]:
    """(entry name, threads per CTA) of one state-pass variant: gdn2_state[1]_d<dk>_s<stages>[k|p][_w8] (1: tf32,
    one TF32 product a mma)."""
    if not gdn2_state_kernel_exists(stages, presplit, warps, tf32):
        what = "tf32 state pass" if tf32 else "gdn2 state pass"
        raise ValueError(f"no {what} with {stages} stages, presplit={presplit!r} and {warps} warps")
    tag = ("", "k", "p")[GDN2_SPLIT[presplit]]
    return f"gdn2_state{'1' if tf32 else ''}_d{dk}_s{stages}{tag}{'_w8' if warps == 8 else ''}", warps * 32


def gdn2_tf32_state_variant(dk: int, dv: int) -> tuple[int, bool, int]:
    """(stages, presplit, warps) of the state pass under GDN2_STATE_TF32 (gdn2_state1_d<dk>_s<stages>_w8): 8 warps,
    no presplit (one TF32 product reads no lo halves), two stages where they fit, else one; (0, False, 0) where the
    card cannot run the pipeline for this shape."""
    if not gdn2_state_variant(dk, dv)[0]:
        return 0, False, 0
    return (2 if gdn2_fits(dk, dv, 2, False) else 1), False, 8


def gdn2_stages(dk: int, dv: int) -> int:
    """cp.async stages of the state pass (gdn2_state_variant); 0: no chunked2 pipeline on this card."""
    return gdn2_state_variant(dk, dv)[0]


def gdn_prefill_chunked2(state, qkvn, gb, out, ldo: int, h: int, hv: int, dk: int, dv: int, nlanes: int,
                         pos0: int = 0, scratch=None, stages: int | None = None, presplit: bool | str | None = None,
                         warps: int | None = None, events=None, gated: "GatedNormArgs | None" = None) -> None:
    """gdn_prefill's contract through the three-kernel pipeline; chunk boundaries at absolute
    multiples of GDN2_C (pieces split there give the bits of one run). scratch: a float32 device
    buffer of at least gdn2_scratch_floats(gdn2_nchunks(nlanes, pos0), hv, dk, dv) floats
    (allocated here when None). With both TF32 classes off it matches the sequential kernel within fp32 rounding
    (3xTF32); by default (GDN2_STATE_TF32 / GDN2_OUT_TF32, the "tf32 state" / "tf32 out" classes of docs/QUANT.md) O
    and the state sit ~2-5e-4 relative off it, and pieces cut at multiples of GDN2_C still give one run's bits.
    stages / presplit / warps: the state pass's variant (default gdn2_state_variant; every variant gives the same
    bits; presplit "k": K alone, 8 warps only).
    events: four CUDA events recorded around the three launches (the bench's per-kernel split).
    Under GDN2_STATE_TF32 the pre-pass and the state pass run one TF32 product a mma (gdn2_prep1_* /
    gdn2_state1_*_w8, the "tf32 state" class): 8 warps, no presplit by default (gdn2_tf32_state_variant), or
    presplit "k" with two stages (gdn2_state1_*_s2k_w8: K rounded to tf32 once a chunk, as row pairs); a variant
    asked for beyond those is refused."""
    import cupy as cp

    if nlanes <= 0:
        return
    tf32 = GDN2_STATE_TF32
    warps = (8 if tf32 else GDN2_STATE_WARPS) if warps is None else warps
    if stages is None:
        stages, best, _ = gdn2_tf32_state_variant(dk, dv) if tf32 else gdn2_state_variant(dk, dv, warps)
        presplit = best if presplit is None else presplit
    elif presplit is None:  # the split buffer where it fits beside the stages asked for
        presplit = False if tf32 else gdn2_fits(dk, dv, stages, True)
    if not stages:
        raise ValueError(f"no chunked2 GDN kernels for dk={dk}, dv={dv} on this card")
    state_fn, state_threads = gdn2_state_kernel(dk, stages, presplit, warps, tf32)
    if not gdn_chunk_aligned(qkvn, h, hv, dk, dv):
        raise ValueError("gdn_prefill_chunked2 reads qkvn 16 bytes at a time: its rows must start 16-byte aligned")
    nc = gdn2_nchunks(nlanes, pos0)
    c = C.GDN2_C
    need = gdn2_scratch_floats(nc, hv, dk, dv)
    if scratch is None:
        scratch = cp.empty(need, dtype=cp.float32)
    if scratch.size < need or scratch.dtype != cp.float32:
        raise ValueError(f"chunked2 scratch holds {scratch.size} floats, the run needs {need}")
    flat = scratch.reshape(-1)
    o1 = hv * nc * c * dk
    o2 = o1 + hv * nc * c * dv
    o3 = o2 + hv * nc * dv * dk
    wsc, usc, ssc, gsc = flat[:o1], flat[o1:o2], flat[o2:o3], flat[o3:need]
    smem = gdn2_smem_floats(dk, dv, stages, presplit)
    rt = Runtime.get()
    mark = (lambda i: events[i].record()) if events else (lambda i: None)  # noqa: E731
    mark(0)
    rt.launch("gdn_chunk2", f"gdn2_prep{'1' if tf32 else ''}_d{dk}", (nc, hv), 256,
              (qkvn, gb, wsc, usc, gsc, i32(h), i32(hv), i32(nlanes), i32(pos0), i32(nc)), shared_mem=4 * smem["prep"])
    mark(1)
    rt.launch("gdn_chunk2", state_fn, (dv // C.GDN2_BV, hv), state_threads,
              (state, qkvn, wsc, usc, ssc, gsc, i32(h), i32(hv), i32(dv), i32(nlanes), i32(pos0), i32(nc)),
              shared_mem=4 * smem["state"])
    mark(2)
    out_name = "gdn2_out1" if GDN2_OUT_TF32 else "gdn2_out"  # the "tf32 out" class or the fp32-grade pass
    if gated is None:
        rt.launch("gdn_chunk2", f"{out_name}_d{dk}", (nc, hv), 2 * dv,
                  (qkvn, usc, ssc, gsc, out, i32(ldo), i32(h), i32(hv), i32(nlanes), i32(pos0), i32(nc)),
                  shared_mem=4 * smem["out"])
    else:  # the output norm in the same pass (out unused): gated_rmsnorm_rows' bits
        g = gated
        assert g.y is not None or g.yb is not None
        rt.launch("gdn_chunk2", f"{out_name}_gated_d{dk}", (nc, hv), 2 * dv,
                  (qkvn, usc, ssc, gsc, g.z, i32(g.ldz), g.w, f32(g.eps), g.y, i32(g.ldy), g.yb, i32(g.ldyb), i32(h),
                   i32(hv), i32(nlanes), i32(pos0), i32(nc)), shared_mem=4 * smem["out"])
    mark(3)


@dataclass(frozen=True)
class GatedNormArgs:
    """gated_rmsnorm_rows' operands, for the chunked2 output pass that applies it itself (GDN2_OUT_GATED)."""
    z: object
    ldz: int
    w: object
    eps: float
    y: object
    ldy: int
    yb: object = None
    ldyb: int = 0


# Whether prefill chunks run the GDN output norm inside the chunked2 output pass (gdn2_out_gated_*: the O rows
# never leave the chip as fp32) instead of gated_rmsnorm_rows after it; the same bits. EngineConfig.gdn_out_fused.
def _gdn_out_fused_default() -> bool:
    from q27py.config import engine_env

    return bool(engine_env().gdn_out_fused)


GDN2_OUT_GATED = _gdn_out_fused_default()


# Whether the chunked2 output pass runs its products as one TF32 product each (gdn2_out1_*, the "tf32 out"
# tolerance class) instead of 3xTF32 (gdn2_out_*). EngineConfig.prefill_gdn_out_tf32 (env Q27_PREFILL_GDN_OUT_TF32)
# is the module default, as PREFILL_GATE_UP_BF16's; read per call.
def _gdn_out_tf32_default() -> bool:
    from q27py.config import engine_env

    return bool(engine_env().prefill_gdn_out_tf32)


GDN2_OUT_TF32 = _gdn_out_tf32_default()


# Whether the chunked2 pre-pass and state recurrence run one TF32 product a mma (gdn2_prep1_* / gdn2_state1_*_w8, the
# "tf32 state" tolerance class) instead of 3xTF32. EngineConfig.prefill_gdn_state_tf32 (env Q27_PREFILL_GDN_STATE_TF32)
# is the module default; read per call.
def _gdn_state_tf32_default() -> bool:
    from q27py.config import engine_env

    return bool(engine_env().prefill_gdn_state_tf32)


GDN2_STATE_TF32 = _gdn_state_tf32_default()


def gdn_prefill_run(state, qkvn, gb, out, ldo: int, h: int, hv: int, dk: int, dv: int, nlanes: int,
                    pos0: int = 0, scratch=None, gated: GatedNormArgs | None = None) -> bool:
    """A prefill run of lanes by the configured route (GDN_PREFILL), falling back to gdn_prefill.
    scratch: the chunked2 route's buffer (gdn2_scratch_floats), allocated per call when None.
    gated: the output norm's operands, applied in the chunked2 output pass when GDN2_OUT_GATED (then `out` is
    not written). Returns whether it was (else the caller runs gated_rmsnorm_rows on `out`)."""
    if GDN_PREFILL == "chunked2" and gdn2_stages(dk, dv) and gdn_chunk_aligned(qkvn, h, hv, dk, dv):
        fuse = gated is not None and GDN2_OUT_GATED and dv % 32 == 0
        gdn_prefill_chunked2(state, qkvn, gb, out, ldo, h, hv, dk, dv, nlanes, pos0, scratch=scratch,
                             gated=gated if fuse else None)
        return fuse
    elif GDN_PREFILL == "chunked" and gdn_chunk_size(dk, dv) and gdn_chunk_aligned(qkvn, h, hv, dk, dv):
        gdn_prefill_chunked(state, qkvn, gb, out, ldo, h, hv, dk, dv, nlanes, pos0)
    else:
        gdn_prefill(state, qkvn, gb, out, ldo, h, hv, dk, dv, nlanes)
    return False


# ---------------------------------------------------------------- attention
def qk_norm_rope_store(qg, ldq: int, kv, ldkv: int, q_norm, k_norm, eps: float, nq: int, nkv: int, hd: int, rd: int,
                       inv_freq, pos0_dev, qout, ldqo: int, kcache, vcache, kv_bf16: bool, max_pos: int,
                       nlanes: int) -> None:
    if rope_rows_fits(hd, rd, nlanes):
        Runtime.get().launch("rope", f"qk_norm_rope_store_rows_d{hd // 32}", (nlanes, -(-(nq + nkv) // 4)), 128,
                             (qg, i32(ldq), kv, i32(ldkv), q_norm, k_norm, f32(eps), i32(nq), i32(nkv), i32(rd),
                              inv_freq, pos0_dev, qout, i32(ldqo), kcache, vcache, i32(1 if kv_bf16 else 0),
                              i32(max_pos)))
        return
    Runtime.get().launch("rope", "qk_norm_rope_store", (nlanes, nq + nkv), max(32, -(-hd // 32) * 32),
                         (qg, i32(ldq), kv, i32(ldkv), q_norm, k_norm, f32(eps), i32(nq), i32(nkv), i32(hd), i32(rd),
                          inv_freq, pos0_dev, qout, i32(ldqo), kcache, vcache, i32(1 if kv_bf16 else 0),
                          i32(max_pos)), shared_mem=4 * hd)


# qk_norm_rope_store's warp-per-head form (rope.cu qk_norm_rope_store_rows_d*): the same bits, for prefill chunks
# (the block form is 229K blocks of 256 threads per 4,096-token chunk of the 27B); decode keeps the block form.
ROPE_ROWS_MIN = 64


def rope_rows_fits(hd: int, rd: int, nlanes: int) -> bool:
    """Whether qk_norm_rope_store takes the warp-per-head form: head dims 64 / 128 / 256 (2-8 per lane), the
    rotation partner in the same lane (rd / 2 a multiple of 32), and a chunk of at least ROPE_ROWS_MIN lanes."""
    return nlanes >= ROPE_ROWS_MIN and hd in (64, 128, 256) and rd <= hd and rd % 64 == 0 and rd > 0


def _split_shape(hd: int, nq: int, nkv: int) -> tuple[int, int]:
    """(head dims per lane, q heads per kv head) of the split-K attention kernels, checked."""
    dpl = hd // 32
    if hd % 32 or dpl not in (1, 2, 4, 8):
        raise ValueError(f"attention head dim {hd} not supported by the fast path (32, 64, 128 or 256)")
    rep = nq // nkv
    if rep > C.REPMAX:
        raise ValueError(f"{rep} q heads per kv head > {C.REPMAX} not supported by the fast path")
    return dpl, rep


def attention(q, ldq: int, kcache, vcache, kv_bf16: bool, max_pos: int, nq: int, nkv: int, hd: int, pos0_dev,
              span: int, part, qg, ldqg: int, out, ldo: int, nlanes: int, a8: "GemvPlan | None" = None) -> None:
    """Split-K attention + combine with the sigmoid gate; out[t][h*hd + d]."""
    dpl, rep = _split_shape(hd, nq, nkv)
    kernel = f"attn_split_{'bf16' if kv_bf16 else 'f32'}_d{dpl}"
    rt = Runtime.get()
    rt.launch("attention", kernel, (nkv, ATT_NSPLIT, nlanes), 32 * ATT_WARPS,
              (q, i32(ldq), kcache, vcache, i32(max_pos), i32(nq), i32(nkv), f32(hd ** -0.5), pos0_dev, i32(span),
               part), shared_mem=4 * ATT_WARPS * rep * (hd + 2))
    rt.launch("attention", "attn_combine", (nlanes, nq), hd,
              (part, i32(nq), i32(hd), pos0_dev, i32(span), qg, i32(ldqg), out, i32(ldo), *_att_a8(a8, nlanes, nq, hd)))


def qk_norm_rope_store_fp8(qg, ldq: int, kv, ldkv: int, q_norm, k_norm, eps: float, nq: int, nkv: int, hd: int,
                           rd: int, inv_freq, pos0_dev, qout, ldqo: int, kcache, vcache, kexp, vexp, max_pos: int,
                           nlanes: int) -> None:
    """qk_norm_rope_store into fp8 e4m3 KV: u8 codes [nkv][max_pos][hd] + int8 row exponents [nkv][max_pos]."""
    Runtime.get().launch("rope", "qk_norm_rope_store_fp8", (nlanes, nq + nkv), max(32, -(-hd // 32) * 32),
                         (qg, i32(ldq), kv, i32(ldkv), q_norm, k_norm, f32(eps), i32(nq), i32(nkv), i32(hd), i32(rd),
                          inv_freq, pos0_dev, qout, i32(ldqo), kcache, vcache, kexp, vexp, i32(max_pos)),
                         shared_mem=4 * hd)


def attention_fp8(q, ldq: int, kcache, vcache, kexp, vexp, max_pos: int, nq: int, nkv: int, hd: int, pos0_dev,
                  span: int, part, qg, ldqg: int, out, ldo: int, nlanes: int, a8: "GemvPlan | None" = None) -> None:
    """attention() over fp8 e4m3 KV (codes + row exponents); decode, verify and (for now) prefill lanes."""
    dpl, rep = _split_shape(hd, nq, nkv)
    rt = Runtime.get()
    rt.launch("attention", f"attn_split_fp8_d{dpl}", (nkv, ATT_NSPLIT, nlanes), 32 * ATT_WARPS,
              (q, i32(ldq), kcache, vcache, i32(max_pos), i32(nq), i32(nkv), f32(hd ** -0.5), pos0_dev, i32(span),
               part, kexp, vexp), shared_mem=4 * ATT_WARPS * rep * (hd + 2))
    rt.launch("attention", "attn_combine", (nlanes, nq), hd,
              (part, i32(nq), i32(hd), pos0_dev, i32(span), qg, i32(ldqg), out, i32(ldo), *_att_a8(a8, nlanes, nq, hd)))


def qk_norm_rope_store_lanes(qg, ldq: int, kv, ldkv: int, q_norm, k_norm, eps: float, nq: int, nkv: int, hd: int,
                             rd: int, inv_freq, lanes, kv_off: int, qout, ldqo: int, kv_bf16: bool, max_pos: int,
                             nlanes: int) -> None:
    """qk_norm_rope_store for decode_batch lanes: lane b at its own position, into its state's K / V
    (+ kv_off bytes: the layer)."""
    Runtime.get().launch("rope", "qk_norm_rope_store_lanes", (nlanes, nq + nkv), max(32, -(-hd // 32) * 32),
                         (qg, i32(ldq), kv, i32(ldkv), q_norm, k_norm, f32(eps), i32(nq), i32(nkv), i32(hd), i32(rd),
                          inv_freq, lanes, i64(kv_off), qout, i32(ldqo), i32(1 if kv_bf16 else 0), i32(max_pos)),
                         shared_mem=4 * hd)


def qk_norm_rope_store_fp8_lanes(qg, ldq: int, kv, ldkv: int, q_norm, k_norm, eps: float, nq: int, nkv: int, hd: int,
                                 rd: int, inv_freq, lanes, kv_off: int, x_off: int, qout, ldqo: int, max_pos: int,
                                 nlanes: int) -> None:
    """qk_norm_rope_store_fp8 for decode_batch lanes (codes + kv_off, row exponents + x_off bytes)."""
    Runtime.get().launch("rope", "qk_norm_rope_store_fp8_lanes", (nlanes, nq + nkv), max(32, -(-hd // 32) * 32),
                         (qg, i32(ldq), kv, i32(ldkv), q_norm, k_norm, f32(eps), i32(nq), i32(nkv), i32(hd), i32(rd),
                          inv_freq, lanes, i64(kv_off), i64(x_off), qout, i32(ldqo), i32(max_pos)), shared_mem=4 * hd)


def attention_lanes(q, ldq: int, lanes, kv_off: int, x_off: int, kv: str, max_pos: int, nq: int, nkv: int, hd: int,
                    span: int, part, qg, ldqg: int, out, ldo: int, nlanes: int, a8: "GemvPlan | None" = None) -> None:
    """attention() / attention_fp8() for decode_batch lanes: lane b is a one-token decode of its own
    sequence (its position, its state's K / V + kv_off, fp8 exponents + x_off bytes). kv: "f32",
    "bf16" or "fp8". part: attention_partials_floats(>= nlanes, nq, hd)."""
    dpl, rep = _split_shape(hd, nq, nkv)
    if kv not in ("f32", "bf16", "fp8"):
        raise ValueError(f"attention_lanes: KV {kv!r} (f32, bf16 or fp8)")
    rt = Runtime.get()
    rt.launch("attention", f"attn_split_lanes_{kv}_d{dpl}", (nkv, ATT_NSPLIT, nlanes), 32 * ATT_WARPS,
              (q, i32(ldq), lanes, i64(kv_off), i64(x_off), i32(max_pos), i32(nq), i32(nkv), f32(hd ** -0.5),
               i32(span), part), shared_mem=4 * ATT_WARPS * rep * (hd + 2))
    rt.launch("attention", "attn_combine_lanes", (nlanes, nq), hd,
              (part, i32(nq), i32(hd), lanes, i32(span), qg, i32(ldqg), out, i32(ldo), *_att_a8(a8, nlanes, nq, hd)))


def attention_partials_floats(max_lanes: int, nq: int, hd: int, nsplit: int = ATT_NSPLIT) -> int:
    """Floats of the split partials buffer (nsplit: ATT_NSPLIT for attention(), attention_mma_splits for
    attention_mma())."""
    return max_lanes * nq * nsplit * (hd + 2)


# ---------------------------------------------------------------- tensor-core decode / verify attention
# attention_mma (cuda/attention.cu attn_mma_*): one CTA per (kv head, split) for every lane, so the KV is
# read once per round. "split": attention() / attention_fp8() (the per-lane kernel, default until the
# device run); "mma": attention_mma where the shape fits. Set from EngineConfig.attn_decode.
ATTN_DECODE_MODES = ("split", "mma")
ATTN_DECODE: str | None = None  # None: EngineConfig's default overlaid with the environment, read once


def attn_decode_default() -> str:
    """The decode attention models use when not told: EngineConfig.attn_decode (env Q27_ATTN_DECODE),
    so `Q27_ATTN_DECODE=mma pytest tests/gpu` runs every FastModel test on the tensor-core kernel."""
    global ATTN_DECODE
    if ATTN_DECODE is None:
        from q27py.config import engine_env

        ATTN_DECODE = attn_decode_mode(engine_env().attn_decode)
    return ATTN_DECODE
ATTD_HEAD_DIMS = (32, 64, 128, 256)
ATTN_DECODE_FP8: bool | None = None  # None: EngineConfig.attn_decode_fp8 overlaid with the environment, read once


def attn_decode_fp8_default() -> bool:
    """Whether fp8 KV takes the "mma" decode kernel too: EngineConfig.attn_decode_fp8 (env
    Q27_ATTN_DECODE_FP8), read once (so `Q27_ATTN_DECODE_FP8=1 pytest tests/gpu` runs fp8 on it)."""
    global ATTN_DECODE_FP8
    if ATTN_DECODE_FP8 is None:
        from q27py.config import engine_env

        ATTN_DECODE_FP8 = bool(engine_env().attn_decode_fp8)
    return ATTN_DECODE_FP8


def attn_decode_mode(mode: str) -> str:
    """EngineConfig.attn_decode, checked when the model loads (a typo fails there, not mid-request)."""
    if mode not in ATTN_DECODE_MODES:
        raise ValueError(f"attn_decode must be one of {', '.join(ATTN_DECODE_MODES)}, not {mode!r}")
    return mode


def attention_mma_splits(nkv: int, sm_count: int) -> int:
    """Splits per kv head: ATTD_WAVES CTAs per SM over the kv heads. A function of the model shape and
    the card only -- never the live width -- so it is fixed for a model on a device (graphs, bits)."""
    return int(max(1, min(C.ATTD_NSPLIT_MAX, -(-C.ATTD_WAVES * sm_count // max(nkv, 1)))))


def attention_mma_split_size(pos0: int, span: int, nsplit: int) -> int:
    """Positions per split (cuda/attention.cu attd_split_size; tests/gpu checks the two agree)."""
    need = -(-(pos0 + span) // nsplit)
    return max(C.ATTD_MIN_SPLIT, -(-need // C.ATTD_KT) * C.ATTD_KT)


def attention_mma_warps(nlanes: int, rep: int) -> int:
    """Warps of a CTA: one per ATTD_ROWS (lane, q head) rows, at least ATTD_MIN_WARPS (the extra ones
    only stage tiles). Depends on the live width, which only changes who copies, never any row's math."""
    return max(C.ATTD_MIN_WARPS, -(-nlanes * rep // C.ATTD_ROWS))


def attention_mma_shared_bytes(hd: int, fp8: bool, max_pos: int, span: int, nsplit: int) -> int:
    """The cp.async ring (K + V tiles per stage); fp8 adds the converted bf16 K / V tile and the split's
    row exponents (a split is at most attention_mma_split_size(max_pos, span, nsplit) positions)."""
    eb = 1 if fp8 else 2
    n = C.ATTD_STAGES * 2 * C.ATTD_KT * hd * eb
    if fp8:
        n += 2 * C.ATTD_KT * hd * 2 + 2 * attention_mma_split_size(max_pos, span, nsplit)
    return n


def attention_mma_qsplit(hd: int, cc: tuple[int, int]) -> bool:
    """Q as bf16 hi + lo (fp32-grade scores) where the registers allow it: every head dim on sm_90+,
    below 256 elsewhere (cuda/attention.cu builds the d256 hi + lo kernels for sm_90+ only)."""
    return bool(C.ATTD_QSPLIT) and (hd < 256 or tuple(cc) >= (9, 0))


def attention_mma_supported(hd: int, nq: int, nkv: int, span: int, fp8: bool, max_pos: int) -> bool:
    """Whether attention_mma runs this launch shape on this card. Decided from the capacity `span`
    (never the live width), so every width of one graph family takes the same kernel."""
    if hd not in ATTD_HEAD_DIMS or nkv < 1 or nq % nkv:
        return False
    if span * (nq // nkv) > C.ATTD_MAX_WARPS * C.ATTD_ROWS:
        return False
    rt = Runtime.get()
    nsplit = attention_mma_splits(nkv, rt.sm_count)
    return attention_mma_shared_bytes(hd, fp8, max_pos, span, nsplit) <= rt.smem_optin


def _attention_mma_variant(hd: int, nq: int, nkv: int, span: int, fp8: bool, max_pos: int,
                           qsplit: bool | None) -> tuple[bool, int]:
    """(Q hi + lo or once, splits per kv head) of an attn_mma launch, checked against the card."""
    if not attention_mma_supported(hd, nq, nkv, span, fp8, max_pos):
        raise ValueError(f"attention_mma: head dim {hd}, {nq}/{nkv} heads at span {span} not supported here")
    rt = Runtime.get()
    if qsplit is None:
        qsplit = attention_mma_qsplit(hd, rt.cc)
    elif qsplit and hd == 256 and tuple(rt.cc) < (9, 0):
        raise ValueError("attention_mma: Q hi + lo at head dim 256 needs sm_90+")
    return qsplit, attention_mma_splits(nkv, rt.sm_count)


def attention_mma(q, ldq: int, kcache, vcache, kexp, vexp, fp8: bool, max_pos: int, nq: int, nkv: int, hd: int,
                  pos0_dev, span: int, part, qg, ldqg: int, out, ldo: int, nlanes: int,
                  qsplit: bool | None = None, a8: "GemvPlan | None" = None) -> None:
    """attention() / attention_fp8() on tensor cores: the same contract (out[t][h*hd + d], gated), the
    KV read once for all lanes. kcache / vcache: bf16 bits (fp8=False) or e4m3 codes with row
    exponents kexp / vexp. part: attention_partials_floats(lanes, nq, hd, attention_mma_splits(...)).
    qsplit: None = attention_mma_qsplit (tests force either variant)."""
    if nlanes > span or ldq % 2:
        raise ValueError("attention_mma: nlanes must be <= span and q rows 8-byte aligned (ldq even)")
    rt = Runtime.get()
    qsplit, nsplit = _attention_mma_variant(hd, nq, nkv, span, fp8, max_pos, qsplit)
    kernel = f"attn_mma_{'fp8' if fp8 else 'bf16'}_d{hd}{'' if qsplit else '_bq'}"
    rep = nq // nkv
    rt.launch("attention", kernel, (nkv, nsplit), 32 * attention_mma_warps(nlanes, rep),
              (q, i32(ldq), kcache, vcache, i32(max_pos), i32(nq), i32(nkv), f32(hd ** -0.5), pos0_dev, i32(span),
               i32(nsplit), i32(nlanes), part, kexp if fp8 else None, vexp if fp8 else None),
              shared_mem=attention_mma_shared_bytes(hd, fp8, max_pos, span, nsplit))
    rt.launch("attention", "attn_mma_combine", (nlanes, nq), hd,
              (part, i32(nq), i32(hd), pos0_dev, i32(span), i32(nsplit), qg, i32(ldqg), out, i32(ldo), *_att_a8(a8, nlanes, nq, hd)))


def attention_mma_lanes(q, ldq: int, lanes, kv_off: int, x_off: int, fp8: bool, max_pos: int, nq: int, nkv: int,
                        hd: int, span: int, part, qg, ldqg: int, out, ldo: int, nlanes: int,
                        qsplit: bool | None = None, a8: "GemvPlan | None" = None) -> None:
    """attention_mma for decode_batch lanes: grid z = lane, each lane b a one-lane launch of its own
    sequence (its position, its state's K / V + kv_off, fp8 exponents + x_off bytes) with the block
    size and split count a one-token decode uses, so its bits are that decode's."""
    if nlanes > C.LANES_MAX or ldq % 2:
        raise ValueError(f"attention_mma_lanes: at most {C.LANES_MAX} lanes, q rows 8-byte aligned (ldq even)")
    rt = Runtime.get()
    qsplit, nsplit = _attention_mma_variant(hd, nq, nkv, span, fp8, max_pos, qsplit)
    kernel = f"attn_mma_lanes_{'fp8' if fp8 else 'bf16'}_d{hd}{'' if qsplit else '_bq'}"
    rep = nq // nkv
    rt.launch("attention", kernel, (nkv, nsplit, nlanes), 32 * attention_mma_warps(1, rep),
              (q, i32(ldq), lanes, i64(kv_off), i64(x_off), i32(max_pos), i32(nq), i32(nkv), f32(hd ** -0.5),
               i32(span), i32(nsplit), part),
              shared_mem=attention_mma_shared_bytes(hd, fp8, max_pos, span, nsplit))
    rt.launch("attention", "attn_mma_combine_lanes", (nlanes, nq), hd,
              (part, i32(nq), i32(hd), lanes, i32(span), i32(nsplit), qg, i32(ldqg), out, i32(ldo), *_att_a8(a8, nlanes, nq, hd)))


def attention_groups(q, ldq: int, lanes, groups, kv_off: int, x_off: int, kv: str, max_pos: int, nq: int, nkv: int,
                     hd: int, span: int, part, qg, ldqg: int, out, ldo: int, nlanes: int, a8: "GemvPlan | None" = None) -> None:
    """attention() / attention_fp8() for the nlanes lanes of a verify_batch: lane b is lane b - r0 of its
    group's verify round (the round's pos0 = row r0's position and its split size; its state's K / V +
    kv_off, fp8 exponents + x_off bytes). kv: "f32", "bf16" or "fp8"."""
    dpl, rep = _split_shape(hd, nq, nkv)
    if kv not in ("f32", "bf16", "fp8"):
        raise ValueError(f"attention_groups: KV {kv!r} (f32, bf16 or fp8)")
    rt = Runtime.get()
    rt.launch("attention", f"attn_split_groups_{kv}_d{dpl}", (nkv, ATT_NSPLIT, nlanes), 32 * ATT_WARPS,
              (q, i32(ldq), lanes, groups, i64(kv_off), i64(x_off), i32(max_pos), i32(nq), i32(nkv), f32(hd ** -0.5),
               i32(span), part), shared_mem=4 * ATT_WARPS * rep * (hd + 2))
    rt.launch("attention", "attn_combine_groups", (nlanes, nq), hd,
              (part, i32(nq), i32(hd), lanes, groups, i32(span), qg, i32(ldqg), out, i32(ldo), *_att_a8(a8, nlanes, nq, hd)))


def attention_mma_groups(q, ldq: int, lanes, groups, kv_off: int, x_off: int, fp8: bool, max_pos: int, nq: int,
                         nkv: int, hd: int, span: int, part, qg, ldqg: int, out, ldo: int, nlanes: int, ngroups: int,
                         max_width: int, qsplit: bool | None = None, a8: "GemvPlan | None" = None) -> None:
    """attention_mma for a verify_batch of nlanes lanes in ngroups groups: grid z = group, each group (its
    GT_COUNT lanes from its first row) the launch its sequence's solo verify makes -- its pos0, nlanes and
    split count -- then the combine over every lane. The block is sized for max_width lanes (at least the
    widest group: FastModel passes nlanes - ngroups + 1, so one graph serves every split of nlanes into
    ngroups); the extra warps only stage tiles (attention_mma_warps), no row's math changes."""
    if not 1 <= ngroups <= nlanes <= C.LANES_MAX or not nlanes - ngroups + 1 <= max_width <= span or ldq % 2:
        raise ValueError(f"attention_mma_groups: 1..{C.LANES_MAX} lanes in 1..lanes groups, widths <= span "
                         "(max_width covering the widest group), q rows 8-byte aligned (ldq even)")
    rt = Runtime.get()
    qsplit, nsplit = _attention_mma_variant(hd, nq, nkv, span, fp8, max_pos, qsplit)
    kernel = f"attn_mma_groups_{'fp8' if fp8 else 'bf16'}_d{hd}{'' if qsplit else '_bq'}"
    rep = nq // nkv
    rt.launch("attention", kernel, (nkv, nsplit, ngroups), 32 * attention_mma_warps(max_width, rep),
              (q, i32(ldq), lanes, groups, i64(kv_off), i64(x_off), i32(max_pos), i32(nq), i32(nkv), f32(hd ** -0.5),
               i32(span), i32(nsplit), part),
              shared_mem=attention_mma_shared_bytes(hd, fp8, max_pos, span, nsplit))
    rt.launch("attention", "attn_mma_combine_groups", (nlanes, nq), hd,
              (part, i32(nq), i32(hd), lanes, groups, i32(span), i32(nsplit), qg, i32(ldqg), out, i32(ldo), *_att_a8(a8, nlanes, nq, hd)))


# ---------------------------------------------------------------- argmax / sampling
def top2(logits, ld: int, vocab: int, rows: int, part, ids, top1, margin, inv_temp: float = 0.0, seed: int = 0,
         pos0_dev=None) -> None:
    rt = Runtime.get()
    rt.launch("sampling", "top2_partial", (rows, TOP2_BLOCKS), 256,
              (logits, i32(ld), i32(vocab), f32(inv_temp), u64(seed), pos0_dev, part))
    rt.launch("sampling", "top2_final", rows, 32, (part, i32(TOP2_BLOCKS), ids, top1, margin))


def top2_masked(logits, ld: int, vocab: int, rows: int, row_idx, mask, mask_ld: int, part, ids, top1, margin) -> None:
    """top2 over the allowed ids only (one bit per id, mask_ld uint32 words per row), reading logits
    row row_idx[r] for pick r: the device side of a constrained greedy pick (issue 16)."""
    rt = Runtime.get()
    rt.launch("sampling", "top2_partial_masked", (rows, TOP2_BLOCKS), 256,
              (logits, i32(ld), i32(vocab), row_idx, mask, i32(mask_ld), part))
    rt.launch("sampling", "top2_final", rows, 32, (part, i32(TOP2_BLOCKS), ids, top1, margin))


# ---------------------------------------------------------------- prefill attention (tensor-core tiles)
PF_ROWS = C.PF_ROWS  # (lane, q head) rows per CTA
PF_THREADS = C.PF_THREADS


def prefill_key_tile(hd: int, kv_bf16: bool) -> int:
    """Keys per shared-memory tile (the NK each kernel in cuda/attention_prefill.cu is built with)."""
    return 16 if (hd == 256 and not kv_bf16) else 32


def attention_prefill_shared_bytes(hd: int, kv_bf16: bool) -> int:
    """PfLayout::BYTES: Q hi/lo for 64 rows + one K tile and one transposed V tile (hi, and lo for fp32)."""
    nk = prefill_key_tile(hd, kv_bf16)
    parts = 1 if kv_bf16 else 2
    return 2 * (2 * PF_ROWS * (hd + 8) + parts * (nk * (hd + 8) + hd * (nk + 8)))


_SMEM_OPTIN: dict[int, int] = {}


def attention_prefill_fits(hd: int, kv_bf16: bool) -> bool:
    """Whether this device grants the kernel's shared memory. sm_80/sm_90 parts (163-227 KB) take
    every variant; 99 KB parts (sm_86/89) not the head-dim-256 ones, which then keep the per-lane kernel."""
    rt = Runtime.get()
    if rt.device.id not in _SMEM_OPTIN:
        try:  # cudaDevAttrMaxSharedMemoryPerBlockOptin
            _SMEM_OPTIN[rt.device.id] = int(rt.cp.cuda.runtime.deviceGetAttribute(97, rt.device.id))
        except Exception:  # unknown: let the launch itself report a shortfall
            _SMEM_OPTIN[rt.device.id] = 1 << 30
    return attention_prefill_shared_bytes(hd, kv_bf16) <= _SMEM_OPTIN[rt.device.id]


def attention_prefill(q, ldq: int, kcache, vcache, kv_bf16: bool, max_pos: int, nq: int, nkv: int, hd: int, pos0_dev,
                      qg, ldqg: int, out, ldo: int, nlanes: int) -> None:
    """Causal attention of nlanes prefill lanes at pos0.. (lane i sees keys 0..pos0+i) + the sigmoid
    gate; out[t][h*hd + d]. Same contract as attention() minus the partials buffer, but each K/V
    tile is read once per 64 (lane, q head) rows instead of once per lane."""
    if hd not in (32, 64, 128, 256):
        raise ValueError(f"prefill attention head dim {hd} not supported (32, 64, 128 or 256)")
    if nq % nkv:
        raise ValueError(f"{nq} q heads do not split evenly over {nkv} kv heads")
    if ldq % 4 or ldo < nq * hd or ldqg < 2 * nq * hd:
        raise ValueError("q rows must be float4-aligned (ldq % 4 == 0) and out / qg rows wide enough")
    rows = nq // nkv * nlanes
    kernel = f"attn_prefill_{'bf16' if kv_bf16 else 'f32'}_d{hd}"
    Runtime.get().launch("attention_prefill", kernel, (nkv, -(-rows // PF_ROWS)), PF_THREADS,
                         (q, i32(ldq), kcache, vcache, i32(max_pos), i32(nq), i32(nkv), i32(nlanes), f32(hd ** -0.5),
                          pos0_dev, qg, i32(ldqg), out, i32(ldo)),
                         shared_mem=attention_prefill_shared_bytes(hd, kv_bf16))


def attention_prefill_fp8(q, ldq: int, kcache, vcache, kexp, vexp, max_pos: int, nq: int, nkv: int, hd: int,
                          pos0_dev, qg, ldqg: int, out, ldo: int, nlanes: int) -> None:
    """attention_prefill over fp8 e4m3 KV (codes + row exponents), staged into the bf16 tiles exactly:
    the bf16 kernels' shared memory and key tile (attention_prefill_fits(hd, True))."""
    if hd not in (32, 64, 128, 256):
        raise ValueError(f"prefill attention head dim {hd} not supported (32, 64, 128 or 256)")
    if nq % nkv:
        raise ValueError(f"{nq} q heads do not split evenly over {nkv} kv heads")
    if ldq % 4 or ldo < nq * hd or ldqg < 2 * nq * hd:
        raise ValueError("q rows must be float4-aligned (ldq % 4 == 0) and out / qg rows wide enough")
    rows = nq // nkv * nlanes
    Runtime.get().launch("attention_prefill", f"attn_prefill_fp8_d{hd}", (nkv, -(-rows // PF_ROWS)), PF_THREADS,
                         (q, i32(ldq), kcache, vcache, i32(max_pos), i32(nq), i32(nkv), i32(nlanes), f32(hd ** -0.5),
                          pos0_dev, qg, i32(ldqg), out, i32(ldo), kexp, vexp),
                         shared_mem=attention_prefill_shared_bytes(hd, True))


# ---------------------------------------------------------------- prefill attention v2 (cuda/attention_prefill2.cu)
# "v1": the hi + lo kernel above (fp32-grade, ~90 TFLOP/s on the H200); "v2": single-bf16 Q and P,
# cp.async double buffering, ldmatrix, 128-row tiles, absolute key blocks + combine (its own
# tolerance class, tests/gpu/test_attention_prefill2.py). Set from EngineConfig.attn_prefill.
ATTN_PREFILL_IMPLS = ("v1", "v2")


def _attn_prefill_default() -> str:
    """EngineConfig.attn_prefill with Q27_ATTN_PREFILL applied: the module default, so models built
    directly (gates, benches, tests) follow the env switch as engines do."""
    from q27py.config import engine_env

    return engine_env().attn_prefill


ATTN_PREFILL = _attn_prefill_default()
PF2_SPLIT_KEYS = C.PF2_SPLIT_KEYS
# (name, warps, keys per tile), largest first: the first the card's shared memory grants runs
PF2_VARIANTS = (("a", C.PF2_WARPS_A, C.PF2_NK_A), ("b", C.PF2_WARPS_B, C.PF2_NK_B), ("c", C.PF2_WARPS_C, C.PF2_NK_C))
PF2_PART_BYTES = 128 << 20  # split-row partials scratch of FastModel (bounds the lanes per launch piece)


def attn_prefill_mode(mode: str) -> str:
    """EngineConfig.attn_prefill, checked when the model loads (a typo fails there, not mid-request)."""
    if mode not in ATTN_PREFILL_IMPLS:
        raise ValueError(f"attn_prefill must be one of {', '.join(ATTN_PREFILL_IMPLS)}, not {mode!r}")
    return mode


def attention_prefill2_bytes(hd: int, fp8: bool, warps: int, nk: int) -> int:
    """Pf2Layout::BYTES: the bf16 Q tile, PF2_STAGES streamed K + V tiles (bf16, or fp8 codes plus
    one converted bf16 K + V tile)."""
    eb = 1 if fp8 else 2
    return 16 * warps * hd * 2 + C.PF2_STAGES * 2 * nk * hd * eb + (2 * nk * hd * 2 if fp8 else 0)


def attention_prefill2_variant(hd: int, fp8: bool, smem_optin: int | None = None) -> tuple[str, int, int] | None:
    """(variant, warps, keys per tile) this card runs for head dim hd, or None (callers keep v1).
    Head dims <= 128 are built as variant a only (it fits 99 KB parts); 256 takes the first of
    a / b / c whose shared memory the card grants (227 KB sm_90: a, 163 KB sm_80: b, 99 KB: c)."""
    if hd not in (32, 64, 128, 256):
        return None
    if smem_optin is None:
        rt = Runtime.get()
        if rt.cc < (8, 0):
            return None
        smem_optin = rt.smem_optin
    for v in PF2_VARIANTS if hd == 256 else PF2_VARIANTS[:1]:
        if attention_prefill2_bytes(hd, fp8, v[1], v[2]) <= smem_optin:
            return v
    return None


def attention_prefill2_blocks(pos_end: int) -> int:
    """Key blocks of a launch whose last lane sits at position pos_end - 1."""
    return -(-int(pos_end) // PF2_SPLIT_KEYS)


def attention_prefill2_part_floats(lanes: int, nq: int, hd: int, nblk: int) -> int:
    """Partials of `lanes` lanes over nblk blocks ({O, m, l} padded to hd + 4 floats per row and block)."""
    return lanes * nq * nblk * (hd + 4)


def attention_prefill2_piece(part_floats: int, nq: int, hd: int, nblk: int) -> int:
    """Lanes per launch piece that the partials scratch holds (the whole launch when nothing splits)."""
    if nblk <= 1:
        return 1 << 30
    return part_floats // attention_prefill2_part_floats(1, nq, hd, nblk)


def attention_prefill2(q, ldq: int, kcache, vcache, fp8: bool, max_pos: int, nq: int, nkv: int, hd: int, pos0_dev,
                       pos0: int, qg, ldqg: int, out, ldo: int, nlanes: int, part, kexp=None, vexp=None) -> None:
    """attention_prefill's contract (causal attention of nlanes lanes at pos0.. + the sigmoid gate)
    on the v2 kernel; bf16 KV, or fp8 KV (codes + row exponents kexp / vexp).

    pos0 (host) must equal *pos0_dev: it sizes the grid's key blocks (rows at positions >=
    PF2_SPLIT_KEYS merge one partial per block through `part`, launched in lane pieces that
    fit it); the kernel reads *pos0_dev. A lane's bits depend on its own position only."""
    v = attention_prefill2_variant(hd, fp8)
    if v is None:
        raise ValueError(f"no prefill attention v2 kernel for head dim {hd} on this card")
    if nq % nkv:
        raise ValueError(f"{nq} q heads do not split evenly over {nkv} kv heads")
    if ldq % 4 or ldqg % 2 or ldo < nq * hd or ldqg < 2 * nq * hd:
        raise ValueError("q rows must be float4-aligned, qg rows float2-aligned, out / qg rows wide enough")
    if fp8 and (kexp is None or vexp is None):
        raise ValueError("fp8 KV needs the row exponents")
    name, warps, nk = v
    module, kernel = "attention_prefill2", f"attn_prefill2_{'fp8' if fp8 else 'bf16'}_d{hd}_{name}"
    smem = attention_prefill2_bytes(hd, fp8, warps, nk)
    if attention_prefill3_supported(hd, fp8):  # the same grid, rows and partials on wgmma
        module, (kernel, threads, _), smem = "attention_prefill3", PF3_FORMS[PF3_FORM], attention_prefill3_bytes()
        rows_per_cta = 16 * C.PF3_WARPS
    else:
        rows_per_cta, threads = 16 * warps, 32 * warps
    rep = nq // nkv
    nblk = attention_prefill2_blocks(pos0 + nlanes)
    piece = attention_prefill2_piece(0 if part is None else part.size, nq, hd, nblk)
    if piece < 1:
        raise ValueError(f"prefill attention v2 partials scratch too small for {nblk} key blocks")
    rt = Runtime.get()
    scale_log2 = hd ** -0.5 * 1.4426950408889634  # the kernel's softmax runs in log2 units (exp2)
    for a in range(0, nlanes, piece):
        n = min(piece, nlanes - a)
        args = (ptr(q, 4 * a * ldq), i32(ldq), kcache, vcache, i32(max_pos), i32(nq), i32(nkv), i32(n),
                f32(scale_log2), pos0_dev, i32(a), ptr(qg, 4 * a * ldqg), i32(ldqg), ptr(out, 4 * a * ldo), i32(ldo),
                part, kexp, vexp)
        if module == "attention_prefill3":
            args = args[:-2]  # bf16 KV only: no row exponents
        rt.launch(module, kernel, (nkv, -(-(rep * n) // rows_per_cta), nblk), threads, args, shared_mem=smem)
        if nblk > 1:
            rt.launch("attention_prefill2", "attn_prefill2_combine", (n, nq), hd,
                      (part, i32(nq), i32(hd), i32(nblk), pos0_dev, i32(a), ptr(qg, 4 * a * ldqg), i32(ldqg),
                       ptr(out, 4 * a * ldo), i32(ldo)))


# ---------------------------------------------------------------- prefill attention v3 (cuda/attention_prefill3.cu)
# v2's contract, tiles and numerics on Hopper's warpgroup MMA (wgmma, the sm_90a build: runtime.ARCH_SPECIFIC),
# for bf16 KV at head dim 256 (the 27B); attention_prefill2 takes it wherever it is supported and
# selected, and v2 runs everywhere else (fp8 KV, other head dims, cards without an sm_90a build).
# Set from EngineConfig.attn_prefill_wgmma.
def _attn_prefill_wgmma_default() -> bool:
    from q27py.config import engine_env

    return bool(engine_env().attn_prefill_wgmma)


ATTN_PREFILL_WGMMA = _attn_prefill_wgmma_default()


# The kernel's forms (cuda/attention_prefill3.cu FORM): "sync", a CTA barrier per tile keeps the two warpgroups in
# step; "ws", full / empty mbarriers per stage instead, so they drift apart and one's softmax overlaps the other's
# wgmma; "pipe", ws's barriers with K and V in rings of their own and, inside a warpgroup, tile kt's softmax
# running while P V (kt - 1) is on the tensor cores. Every form gives v2's bits. (entry, threads, 32 KB tiles)
PF3_FORMS = {"sync": ("attn_prefill3_bf16_d256", 32 * C.PF3_WARPS, 2 * C.PF2_STAGES),
             "ws": ("attn_prefill3_bf16_d256_ws", 32 * C.PF3_WARPS, 2 * C.PF2_STAGES),
             "pipe": ("attn_prefill3_bf16_d256_pipe", 32 * C.PF3_WARPS, 5)}
PF3_FORM = "ws"  # device runs j4 / j10: 2-4% faster than "sync", 5% faster than "pipe" (docs/PERF.md), the same bits


def attention_prefill3_bytes(form: str | None = None) -> int:
    """The bf16 Q tile, the form's K / V tiles (PF3_NK keys each), 1 KB to align the 128-byte swizzle atoms and
    128 bytes of mbarriers."""
    tiles = PF3_FORMS[form or PF3_FORM][2]
    return 16 * C.PF3_WARPS * C.PF3_HD * 2 + tiles * C.PF3_NK * C.PF3_HD * 2 + 1024 + 128


def attention_prefill3_supported(hd: int, fp8: bool, cc: tuple[int, int] | None = None,
                                 smem_optin: int | None = None) -> bool:
    """Whether attention_prefill2 runs the wgmma kernel for this head dim / KV format on this card."""
    if not ATTN_PREFILL_WGMMA or fp8 or hd != C.PF3_HD:
        return False
    if cc is None or smem_optin is None:
        rt = Runtime.get()
        cc, smem_optin = rt.cc, rt.smem_optin
    return cc in ARCH_SPECIFIC["attention_prefill3"] and attention_prefill3_bytes() <= smem_optin


# ---------------------------------------------------------------- rotated Lloyd-Max KV (k5v3 / k3v3)
# cuda/kv_rotated.cu, the store in cuda/rope.cu and the prefill tiles in cuda/attention_prefill.cu
# (FastModel._attention_rotated runs them; docs/KV.md).
ROTATED_KV_BITS = {n: (f.k_bits, f.v_bits) for n, f in KV_FORMATS.items() if f.k_bits}  # k5v3 (5, 3), k3v3 (3, 3)
def rotated_kv_tables(bits: int):
    """(centroids, edges) of the b-bit codebook as device arrays (kvformat's tables)."""
    from q27py.model import kvformat as F

    cp = Runtime.get().cp
    return cp.asarray(F.CODEBOOKS[bits]), cp.asarray(F.codebook_edges(bits))


def lm_quantize_rows(x, ldx: int, n_rows: int, d: int, bits: int, centroids, edges, codes, norms) -> None:
    """Rows [n][ldx] fp32 -> packed codes [n][d*bits/8] + fp16 norms [n] (kvformat.lm_quantize)."""
    import math

    if d < 32 or d > 1024 or d & (d - 1):
        raise ValueError(f"rotated KV needs a power-of-two head dim in 32..1024, not {d}")
    Runtime.get().launch("kv_rotated", "lm_quantize_rows", n_rows, d,
                         (x, i32(ldx), i32(d), i32(bits), centroids, edges, f32(1.0 / math.sqrt(d)),
                          f32(math.sqrt(d)), codes, norms), shared_mem=5 * d)


def rotate_heads(x, ldx: int, rows: int, heads: int, d: int, inverse: bool) -> None:
    import math

    Runtime.get().launch("kv_rotated", "rotate_heads", (rows, heads), d,
                         (x, i32(ldx), i32(d), i32(1 if inverse else 0), f32(1.0 / math.sqrt(d))), shared_mem=4 * d)


def attention_rotated(q_rot, ldq: int, kcodes, vcodes, knorm, vnorm, kbits: int, vbits: int, ktab, vtab, max_pos: int,
                      nq: int, nkv: int, hd: int, pos0_dev, span: int, part, qg, ldqg: int, out, ldo: int,
                      nlanes: int) -> None:
    """Split-K attention over rotated codes; q_rot = rotate_heads(q); out in the original basis, gated."""
    import math

    dpl = hd // 32
    if hd % 32 or dpl not in (1, 2, 4, 8) or nq // nkv > 8:
        raise ValueError(f"rotated attention: head dim {hd} / {nq // nkv} q heads per kv head unsupported")
    rt = Runtime.get()
    rt.launch("kv_rotated", f"attn_split_rot_d{dpl}", (nkv, ATT_NSPLIT, nlanes), 32 * ATT_WARPS,
              (q_rot, i32(ldq), kcodes, vcodes, knorm, vnorm, i32(kbits), i32(vbits), ktab, vtab, i32(max_pos),
               i32(nq), i32(nkv), f32(hd ** -0.5), f32(1.0 / math.sqrt(hd)), pos0_dev, i32(span), part),
              shared_mem=4 * ATT_WARPS * (nq // nkv) * (hd + 2))
    rt.launch("kv_rotated", "attn_combine_rotated", (nlanes, nq), hd,
              (part, i32(nq), i32(hd), pos0_dev, i32(span), qg, i32(ldqg), f32(1.0 / math.sqrt(hd)), out, i32(ldo)),
              shared_mem=4 * hd)


def _check_rotated_dims(hd: int) -> None:
    if hd < 32 or hd > 1024 or hd & (hd - 1):
        raise ValueError(f"rotated KV needs a power-of-two head dim in 32..1024, not {hd}")


def qk_norm_rope_store_rot(qg, ldq: int, kv, ldkv: int, q_norm, k_norm, eps: float, nq: int, nkv: int, hd: int,
                           rd: int, inv_freq, pos0_dev, qout, ldqo: int, kcodes, vcodes, knorm, vnorm, kbits: int,
                           vbits: int, ktabs, vtabs, max_pos: int, nlanes: int) -> None:
    """qk_norm_rope_store into rotated Lloyd-Max KV: codes [nkv][max_pos][hd*bits/8] (u8) + fp16 norms
    [nkv][max_pos] (u16) for K (kbits) and V (vbits); qout gets the rotated query R q.
    ktabs / vtabs: rotated_kv_tables(kbits) / (vbits)."""
    import math

    _check_rotated_dims(hd)
    Runtime.get().launch("rope", "qk_norm_rope_store_rot", (nlanes, nq + nkv), hd,
                         (qg, i32(ldq), kv, i32(ldkv), q_norm, k_norm, f32(eps), i32(nq), i32(nkv), i32(hd), i32(rd),
                          inv_freq, pos0_dev, qout, i32(ldqo), kcodes, vcodes, knorm, vnorm, i32(kbits), i32(vbits),
                          ktabs[0], ktabs[1], vtabs[0], vtabs[1], f32(1.0 / math.sqrt(hd)), f32(math.sqrt(hd)),
                          i32(max_pos)), shared_mem=5 * hd)


def rotated_prefill_fits(hd: int) -> bool:
    """The rotated prefill kernels stage hi + lo tiles like the fp32 ones: the same shared memory."""
    return attention_prefill_fits(hd, False)


def attention_prefill_rotated(q_rot, ldq: int, kcodes, vcodes, knorm, vnorm, kbits: int, vbits: int, ktab, vtab,
                              max_pos: int, nq: int, nkv: int, hd: int, pos0_dev, qg, ldqg: int, out, ldo: int,
                              nlanes: int) -> None:
    """attention_prefill over rotated codes (q_rot = R q): the tiled kernel writes the rotated, ungated
    output, unrotate_gate rotates it back and gates it in place. Same contract as attention_rotated."""
    import math

    _check_rotated_dims(hd)
    if hd > 256:
        raise ValueError(f"prefill attention head dim {hd} not supported (32, 64, 128 or 256)")
    if nq % nkv:
        raise ValueError(f"{nq} q heads do not split evenly over {nkv} kv heads")
    if ldq % 4 or ldo < nq * hd or ldqg < 2 * nq * hd:
        raise ValueError("q rows must be float4-aligned (ldq % 4 == 0) and out / qg rows wide enough")
    name = {v: k for k, v in ROTATED_KV_BITS.items()}.get((kbits, vbits))
    if name is None:
        raise ValueError(f"no rotated prefill kernel for {kbits}-bit K / {vbits}-bit V")
    rows = nq // nkv * nlanes
    inv = f32(1.0 / math.sqrt(hd))
    rt = Runtime.get()
    rt.launch("attention_prefill", f"attn_prefill_{name}_d{hd}", (nkv, -(-rows // PF_ROWS)), PF_THREADS,
              (q_rot, i32(ldq), kcodes, vcodes, i32(max_pos), i32(nq), i32(nkv), i32(nlanes), f32(hd ** -0.5),
               pos0_dev, out, i32(ldo), knorm, vnorm, ktab, vtab, inv),
              shared_mem=attention_prefill_shared_bytes(hd, False))
    rt.launch("kv_rotated", "unrotate_gate", (nlanes, nq), hd, (out, i32(ldo), qg, i32(ldqg), i32(hd), inv),
              shared_mem=4 * hd)
