"""Device measurements for the KV formats (run by tools/device_kv.sh on a GPU; JSON on stdout).

  attention   decode / verify attention kernels alone at the 27B shapes (24 q heads, 4 kv heads,
              head_dim 256, 17 layers per step) at 2K / 32K / 128K, bf16 vs fp8 KV
  decode      the whole random-weight 27B decode step (q4s) at 2K / 32K / 128K and verify W=16 at
              32K, bf16 vs fp8 KV (the issue's bar: fp8 at 32K >= 1.3x bf16 at 32K)
  window      --max-context auto at the 27B shapes with random weights: size the window for N
              sequences, allocate all N states at it, run a decode and a verify at the window's
              last positions through CUDA graphs, report free memory left (the safety margin check)

    PYTHONPATH=. python3 tools/kv_device.py attention decode window [--sequences 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONTEXTS = (2048, 32768, 131072)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def time_ms(cp, fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(3):
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(cp.cuda.get_elapsed_time(a, b) / reps)
    return float(np.median(times))


def attention_bench() -> list[dict]:
    import cupy as cp

    from q27py.gpu import kernels as K
    from q27py.model import kvformat as F

    nq, nkv, hd, layers = 24, 4, 256, 17
    out = []
    for ctx in CONTEXTS:
        max_pos = ctx + 16
        q = cp.asarray(np.random.default_rng(0).standard_normal((16, nq * hd)).astype(np.float32))
        qg = cp.asarray(np.random.default_rng(1).standard_normal((16, 2 * nq * hd)).astype(np.float32))
        o = cp.zeros((16, nq * hd), cp.float32)
        part = cp.zeros(K.attention_partials_floats(16, nq, hd), cp.float32)
        pos = cp.asarray(np.array([ctx - 1], np.int32))
        rows = (np.random.default_rng(2).standard_normal((nkv, 4096, hd))).astype(np.float32)
        reps = -(-max_pos // 4096)
        kb = cp.asarray(np.tile(np.asarray(F.bf16_round(rows)).view(np.uint32) >> 16, (1, reps, 1))[:, :max_pos].astype(np.uint16))
        codes, exps = F.fp8_quantize(rows)
        k8 = cp.asarray(np.tile(codes, (1, reps, 1))[:, :max_pos])
        e8 = cp.asarray(np.tile(exps, (1, reps))[:, :max_pos])
        for lanes in (1, 16):
            run_bf16 = lambda: [K.attention(q, nq * hd, kb, kb, True, max_pos, nq, nkv, hd, pos, 16, part, qg, 2 * nq * hd,  # noqa: E731
                                            o, nq * hd, lanes) for _ in range(layers)]
            run_fp8 = lambda: [K.attention_fp8(q, nq * hd, k8, k8, e8, e8, max_pos, nq, nkv, hd, pos, 16, part, qg,  # noqa: E731
                                               2 * nq * hd, o, nq * hd, lanes) for _ in range(layers)]
            b, f = time_ms(cp, run_bf16), time_ms(cp, run_fp8)
            read_b = layers * 2 * nkv * ctx * hd * 2
            read_f = layers * 2 * nkv * ctx * (hd + 1)
            row = {"context": ctx, "lanes": lanes, "bf16_ms": b, "fp8_ms": f, "speedup": b / f,
                   "bf16_GBps": read_b / b / 1e6, "fp8_GBps": read_f / f / 1e6}
            log(f"attention x{layers} ctx {ctx:>6} lanes {lanes:2d}: bf16 {b:.3f} ms  fp8 {f:.3f} ms  ({b / f:.2f}x)")
            out.append(row)
        del kb, k8, e8
        cp.get_default_memory_pool().free_all_blocks()
    return out


def decode_bench() -> dict:
    import cupy as cp

    from q27py.bench.random_weights import Bench
    from q27py.gpu.forward import FastModel

    bench = Bench(tier="q4s", max_context=max(CONTEXTS) + 64, log=log)
    out = {}
    for kv in ("bf16", "fp8"):
        if kv != "bf16":
            bench.model = FastModel(bench.weights, max_context=max(CONTEXTS) + 64, kv_dtype=kv, chunk=1024)
            bench.stream = bench.model.stream
            bench.state = bench.model.new_state()
            bench._randomize_state(bench.state, 0)
        rows = {}
        for ctx in CONTEXTS:
            d = bench.decode(ctx, steps=20)
            rows[str(ctx)] = {"ms": d["ms_per_token_device"], "tokens_per_s": d["tokens_per_s"],
                              "attention_ms": d["breakdown_ms"].get("attention")}
            log(f"decode {kv} ctx {ctx}: {d['ms_per_token_device']:.3f} ms/token")
        ver = bench.verify(32768, widths=(16,))
        rows["verify16_32768_ms"] = ver[0]["ms"]
        out[kv] = rows
        del bench.state
        cp.get_default_memory_pool().free_all_blocks()
    out["fp8_over_bf16_decode_32k"] = out["bf16"]["32768"]["ms"] / out["fp8"]["32768"]["ms"]
    out["fp8_over_bf16_verify16_32k"] = out["bf16"]["verify16_32768_ms"] / out["fp8"]["verify16_32768_ms"]
    log(f"decode at 32K: fp8 {out['fp8_over_bf16_decode_32k']:.2f}x bf16 (bar 1.3x)")
    return out


def window_check(sequences: int, kv: str) -> dict:
    import cupy as cp

    from q27py.config import EngineConfig
    from q27py.gpu.forward import FastModel, size_context_to_memory
    from q27py.gpu.weights import random_weights
    from q27py.model.config import qwen36_27b_config

    cp.get_default_memory_pool().free_all_blocks()  # the previous format's model and states are gone
    cfg = qwen36_27b_config()
    t0 = time.perf_counter()
    model = FastModel(random_weights(cfg, "q4s", 0), max_context=cfg.max_position_embeddings, kv_dtype=kv, chunk=1024)
    e = EngineConfig(max_sequences=sequences)
    size_context_to_memory(model, e)
    budget = model.context_budget
    model.enable_graphs()
    states = [model.new_state() for _ in range(sequences)]  # every sequence at the full window
    last = states[-1]
    w = budget.window
    last.position = w - 20
    ids = np.arange(100, 103)
    model.forward(last, ids[:1])  # one decode step at the window's end
    tr = model.forward(last, list(range(200, 216)), verify=True)  # a full-width verify up to w - 3
    model.commit(last, tr.trace, 16)
    model.stream.synchronize()
    free, total = cp.cuda.runtime.memGetInfo()
    res = {"kv": kv, "sequences": sequences, "window": w, "limited_by": budget.limited_by,
           "bytes_per_token": budget.bytes_per_token, "free_after_bytes": int(free), "total_bytes": int(total),
           "margin_bytes": e.kv_safety_margin_bytes, "seconds": time.perf_counter() - t0}
    log(f"window {kv}: {budget.describe()}; after allocating {sequences} states and running at position {w - 3}: "
        f"{free / 2**30:.2f} GiB free")
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts", nargs="*", default=["attention", "decode", "window"])
    p.add_argument("--sequences", type=int, default=8, help="window check: sequences sharing the card")
    p.add_argument("--kv", default="bf16,fp8", help="window check: formats")
    args = p.parse_args()
    result = {}
    if "attention" in args.parts:
        result["attention"] = attention_bench()
    if "decode" in args.parts:
        result["decode"] = decode_bench()
    if "window" in args.parts:
        result["window"] = [window_check(args.sequences, kv) for kv in args.kv.split(",")]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
