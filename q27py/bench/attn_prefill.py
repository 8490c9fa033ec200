"""Focused prefill-attention timing at the 27B head shapes (24 q heads, 4 kv heads, head dim 256):
the attention kernels alone, v1 / v2 / v3 (v2 on wgmma), on random q / K / V, as FastModel calls them.

Cases (per attention layer, then x the model's 16 attention layers):
  8K prefill       two 4096-lane chunks at pos0 0 and 4096 (the engine's gpu_prefill_chunk)
  32K prefill      eight 4096-lane chunks
  warm 512 @ 25K   one 512-lane chunk at pos0 25,000 (a warm agent turn)
FLOP = 4 x nq x hd x (visible keys summed over lanes), the causal work actually required; TFLOP/s
against the box's 790 TFLOP/s bf16 figure (random_weights.BF16_DENSE_PEAK_TFLOPS).
"""

from __future__ import annotations

import numpy as np

from q27py.gpu import kernels as K
from q27py.gpu.runtime import Runtime

CASES = {"8K": [(0, 4096), (4096, 4096)], "32K": [(4096 * i, 4096) for i in range(8)], "warm 512 @ 25K": [(25000, 512)]}


def attention_prefill_timing(impls=("v1", "v2"), kv: str = "bf16", reps: int = 3, layers: int = 16, nq: int = 24,
                             nkv: int = 4, hd: int = 256, log=print) -> list[dict]:
    from q27py.bench.random_weights import BF16_DENSE_PEAK_TFLOPS

    rt = Runtime.get()
    cp = rt.cp
    fp8 = kv == "fp8"
    max_pos = max(p + t for chunks in CASES.values() for p, t in chunks) + 64
    tmax = max(t for chunks in CASES.values() for _, t in chunks)
    ldq, ldqg, ldo = nq * hd, 2 * nq * hd, nq * hd
    q = cp.empty((tmax, ldq), dtype=cp.float32)
    qg = cp.empty((tmax, ldqg), dtype=cp.float32)
    out = cp.empty((tmax, ldo), dtype=cp.float32)
    K.fill_uniform(q, 1, -2.0, 2.0)
    K.fill_uniform(qg, 2, -2.0, 2.0)
    rng = np.random.default_rng(0)
    if fp8:
        kc = cp.asarray(rng.integers(0, 0x7E, (nkv, max_pos, hd), dtype=np.uint8))
        vc = cp.asarray(rng.integers(0, 0x7E, (nkv, max_pos, hd), dtype=np.uint8))
        kx = cp.asarray(np.full((nkv, max_pos), -6, np.int8))
        vx = cp.asarray(np.full((nkv, max_pos), -6, np.int8))
    else:  # bf16 bits of values in about [-1, 1): random mantissas under exponents 0x3F / 0xBF
        kc = cp.asarray((rng.integers(0, 1 << 16, (nkv, max_pos, hd)) & 0x807F | 0x3F00).astype(np.uint16))
        vc = cp.asarray((rng.integers(0, 1 << 16, (nkv, max_pos, hd)) & 0x807F | 0x3F00).astype(np.uint16))
        kx = vx = None
    nblk_max = K.attention_prefill2_blocks(max_pos)
    part = cp.zeros(min(K.PF2_PART_BYTES // 4, K.attention_prefill2_part_floats(tmax, nq, hd, nblk_max)), cp.float32)
    pos_dev = cp.zeros(1, dtype=cp.int32)
    stream = cp.cuda.get_current_stream()

    def call(impl, pos0, t):
        pos_dev.fill(pos0)
        if impl in ("v2", "v3", "v3ws", "v3pipe"):  # v3: v2's entry point with the wgmma kernel selected
            K.ATTN_PREFILL_WGMMA = impl != "v2"  # (v3ws / v3pipe: its other forms, kernels.PF3_FORMS)
            K.PF3_FORM = {"v3ws": "ws", "v3pipe": "pipe"}.get(impl, "sync")
            K.attention_prefill2(q, ldq, kc, vc, fp8, max_pos, nq, nkv, hd, pos_dev, pos0, qg, ldqg, out, ldo, t, part,
                                 kx, vx)
        elif fp8:
            K.attention_prefill_fp8(q, ldq, kc, vc, kx, vx, max_pos, nq, nkv, hd, pos_dev, qg, ldqg, out, ldo, t)
        else:
            K.attention_prefill(q, ldq, kc, vc, True, max_pos, nq, nkv, hd, pos_dev, qg, ldqg, out, ldo, t)

    def timed(impl, pos0, t) -> float:
        call(impl, pos0, t)  # warm: compile, clocks
        ms = []
        for _ in range(reps):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            call(impl, pos0, t)
            e1.record(stream)
            e1.synchronize()
            ms.append(cp.cuda.get_elapsed_time(e0, e1))
        return float(np.median(ms))

    rows = []
    wgmma, form = K.ATTN_PREFILL_WGMMA, K.PF3_FORM
    for name, chunks in CASES.items():
        flop = sum(4.0 * nq * hd * (t * pos0 + t * (t + 1) / 2) for pos0, t in chunks)
        for impl in impls:
            if impl in ("v2", "v3", "v3ws", "v3pipe") and K.attention_prefill2_variant(hd, fp8) is None:
                continue
            if impl in ("v3", "v3ws", "v3pipe"):
                saved, K.ATTN_PREFILL_WGMMA = K.ATTN_PREFILL_WGMMA, True
                ok = K.attention_prefill3_supported(hd, fp8)
                K.ATTN_PREFILL_WGMMA = saved
                if not ok:
                    continue
            ms = sum(timed(impl, p, t) for p, t in chunks)
            tf = flop / ms / 1e9
            row = {"case": name, "impl": impl, "kv": kv, "ms_per_layer": ms, "s_all_layers": ms * layers / 1e3,
                   "TFLOPs": tf, "fraction_of_peak": tf / BF16_DENSE_PEAK_TFLOPS}
            rows.append(row)
            log(f"attention prefill {name:>15} {impl} {kv}: {ms:8.3f} ms/layer, {row['s_all_layers']:.3f} s x{layers}, "
                f"{tf:6.1f} TFLOP/s = {row['fraction_of_peak']:.1%} of {BF16_DENSE_PEAK_TFLOPS:.0f}")
    K.ATTN_PREFILL_WGMMA, K.PF3_FORM = wgmma, form
    return rows
