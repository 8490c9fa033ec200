"""Device measurements for the KV formats (run by tools/device_kv.sh on a GPU; JSON on stdout).

  attention   decode / verify attention kernels alone at the 27B shapes (24 q heads, 4 kv heads,
              head_dim 256, 17 layers per step) at 2K / 32K / 128K, 1 and 16 lanes, every format
              (bf16, fp8, k5v3, k3v3; --formats), each against bf16
  decode      the whole random-weight 27B step (q4s): decode and verify W=16 (+ commit) at 2K / 32K /
              128K for every format, ratios against bf16 (the issue's bar: fp8 decode at 32K >= 1.3x
              bf16 at 32K)
  prefill     prefill tokens/s at 8K and 32K for every format (the tiled attention over each format)
  window      --max-context auto at the 27B shapes with random weights: size the window for N
              sequences, allocate all N states at it, run a decode and a verify at the window's
              last positions through CUDA graphs, report free memory left (the safety margin check)

    PYTHONPATH=. python3 tools/kv_device.py attention decode prefill window [--sequences 8]
        [--formats bf16,fp8,k5v3,k3v3] [--kv bf16,fp8,k5v3,k3v3]
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
FORMATS = ("bf16", "fp8", "k5v3", "k3v3")
PREFILL_TOKENS = (8192, 32768)


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


def attention_payloads(rows: np.ndarray, max_pos: int, formats) -> dict:
    """Device KV for each format from 4096 distinct rows per kv head, tiled to max_pos positions:
    the run function of one layer's attention for (q, qg, out, part, pos, lanes)."""
    import cupy as cp

    from q27py.gpu import kernels as K
    from q27py.model import kvformat as F

    nkv, _, hd = rows.shape
    reps = -(-max_pos // rows.shape[1])
    tile = lambda a: cp.asarray(np.tile(a, (1, reps) + (1,) * (a.ndim - 2))[:, :max_pos])  # noqa: E731
    nq = 24
    out = {}
    for fmt in formats:
        if fmt == "bf16":
            kb = tile((np.asarray(F.bf16_round(rows)).view(np.uint32) >> 16).astype(np.uint16))
            out[fmt] = (lambda kb: lambda q, qg, o, part, pos, lanes: K.attention(
                q, nq * hd, kb, kb, True, max_pos, nq, nkv, hd, pos, 16, part, qg, 2 * nq * hd, o, nq * hd,
                lanes))(kb)
        elif fmt == "fp8":
            codes, exps = F.fp8_quantize(rows)
            k8, e8 = tile(codes), tile(exps)
            out[fmt] = (lambda k8, e8: lambda q, qg, o, part, pos, lanes: K.attention_fp8(
                q, nq * hd, k8, k8, e8, e8, max_pos, nq, nkv, hd, pos, 16, part, qg, 2 * nq * hd, o, nq * hd,
                lanes))(k8, e8)
        else:
            f = F.get_format(fmt)
            kc, kn = F.lm_quantize(rows, f.k_bits)
            vc, vn = F.lm_quantize(rows, f.v_bits)
            dev = (tile(kc), tile(vc), tile(kn.view(np.uint16)), tile(vn.view(np.uint16)))
            kt, vt = K.rotated_kv_tables(f.k_bits)[0], K.rotated_kv_tables(f.v_bits)[0]
            out[fmt] = (lambda dev, f, kt, vt: lambda q, qg, o, part, pos, lanes: K.attention_rotated(
                q, nq * hd, *dev, f.k_bits, f.v_bits, kt, vt, max_pos, nq, nkv, hd, pos, 16, part, qg, 2 * nq * hd,
                o, nq * hd, lanes))(dev, f, kt, vt)
    return out


def attention_bench(formats=FORMATS) -> list[dict]:
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
        runs = attention_payloads(rows, max_pos, formats)
        for lanes in (1, 16):
            row = {"context": ctx, "lanes": lanes}
            for fmt, run in runs.items():
                ms = time_ms(cp, lambda: [run(q, qg, o, part, pos, lanes) for _ in range(layers)])
                read = layers * ctx * F.bytes_per_token(fmt, 1, nkv, hd)
                row[f"{fmt}_ms"] = ms
                row[f"{fmt}_GBps"] = read / ms / 1e6
            for fmt in runs:
                if fmt != "bf16" and "bf16_ms" in row:
                    row[f"{fmt}_speedup"] = row["bf16_ms"] / row[f"{fmt}_ms"]
            if "fp8_speedup" in row:
                row["speedup"] = row["fp8_speedup"]  # the earlier runs' key (bf16 / fp8)
            log(f"attention x{layers} ctx {ctx:>6} lanes {lanes:2d}: "
                + "  ".join(f"{fmt} {row[f'{fmt}_ms']:.3f} ms" for fmt in runs))
            out.append(row)
        del runs
        cp.get_default_memory_pool().free_all_blocks()
    return out


def format_benches(formats):
    """(format, Bench) for each format in turn: one random-weight 27B q4s (built once), a FastModel per
    format with the engine's prefill chunk, its state randomized; the previous format's state is
    freed before the next is allocated (a 128K state is 9 GB in bf16)."""
    import cupy as cp

    from q27py.bench.random_weights import Bench
    from q27py.config import EngineConfig
    from q27py.gpu.forward import FastModel

    chunk = EngineConfig().gpu_prefill_chunk
    bench = Bench(tier="q4s", max_context=max(CONTEXTS) + 64, chunk=chunk, log=log)
    for kv in formats:
        if kv != "bf16":
            del bench.state
            bench.model = None
            cp.get_default_memory_pool().free_all_blocks()
            bench.model = FastModel(bench.weights, max_context=max(CONTEXTS) + 64, kv_dtype=kv, chunk=chunk)
            bench.stream = bench.model.stream
            bench.state = bench.model.new_state()
            bench._randomize_state(bench.state, 0)
        yield kv, bench
    del bench.state
    cp.get_default_memory_pool().free_all_blocks()


def decode_bench(formats=FORMATS) -> dict:
    out = {}
    for kv, bench in format_benches(formats):
        rows = {}
        for ctx in CONTEXTS:
            d = bench.decode(ctx, steps=20)
            rows[str(ctx)] = {"ms": d["ms_per_token_device"], "tokens_per_s": d["tokens_per_s"],
                              "attention_ms": d["breakdown_ms"].get("attention")}
            log(f"decode {kv} ctx {ctx}: {d['ms_per_token_device']:.3f} ms/token")
        for ctx in CONTEXTS:
            ver = bench.verify(ctx, widths=(16,))
            rows[f"verify16_{ctx}_ms"] = ver[0]["ms"]
            log(f"verify W=16 {kv} ctx {ctx}: {ver[0]['ms']:.3f} ms/round")
        out[kv] = rows
    for kv in formats:
        if kv == "bf16" or "bf16" not in out:
            continue
        for ctx in CONTEXTS:
            k = f"{ctx // 1024}k"
            out[f"{kv}_over_bf16_decode_{k}"] = out["bf16"][str(ctx)]["ms"] / out[kv][str(ctx)]["ms"]
            out[f"{kv}_over_bf16_verify16_{k}"] = out["bf16"][f"verify16_{ctx}_ms"] / out[kv][f"verify16_{ctx}_ms"]
        log(f"decode at 32K: {kv} {out[f'{kv}_over_bf16_decode_32k']:.2f}x bf16"
            + (" (bar 1.3x)" if kv == "fp8" else "")
            + f"; verify W=16 at 32K {out[f'{kv}_over_bf16_verify16_32k']:.2f}x")
    return out


def prefill_bench(formats=FORMATS) -> dict:
    out = {}
    for kv, bench in format_benches(formats):
        out[kv] = {}
        for n in PREFILL_TOKENS:
            r = bench.prefill(n)
            out[kv][str(n)] = {"seconds": r["seconds"], "tokens_per_s": r["tokens_per_s"]}
            log(f"prefill {kv} {n} tokens: {r['seconds']:.2f} s ({r['tokens_per_s']:.0f} tok/s)")
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
    p.add_argument("parts", nargs="*", default=["attention", "decode", "prefill", "window"])
    p.add_argument("--sequences", type=int, default=8, help="window check: sequences sharing the card")
    p.add_argument("--formats", default=",".join(FORMATS), help="attention / decode / prefill: formats (bf16 first)")
    p.add_argument("--kv", default=",".join(FORMATS), help="window check: formats")
    args = p.parse_args()
    formats = tuple(args.formats.split(","))
    result = {}
    if "attention" in args.parts:
        result["attention"] = attention_bench(formats)
    if "decode" in args.parts:
        result["decode"] = decode_bench(formats)
    if "prefill" in args.parts:
        result["prefill"] = prefill_bench(formats)
    if "window" in args.parts:
        result["window"] = [window_check(args.sequences, kv) for kv in args.kv.split(",")]
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
