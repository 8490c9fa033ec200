"""decode_batch (one weight sweep for B sequences) against B solo forwards, on the 27B shapes with
seeded random weights: B sequences at about `--ctx` positions each (a few positions apart, as
slots are), one committed token per sequence per call, greedy ids read back as a scheduler
round reads them.

    python3 -m q27py.bench.batch_probe                          # q4s, bf16 KV, ctx 2K, B 1 2 4 8 16
    python3 -m q27py.bench.batch_probe --tier q4s --kv fp8 --ctx 2048 32768 --lanes 1 8 16 --json out.json

Per (ctx, B): ms per call of decode_batch (host loop: table upload, graph replay, the B ids
download) and its device time (CUDA events around the upload + replay), aggregate tokens/s, and
the same B tokens as B solo forward() calls (each with its own per-state graph and id download:
what every slot does today), so "speedup" is what the batched round buys at that B. KV and GDN
contents are random (timing does not depend on them); positions are rewound after each call.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from q27py.gpu.runtime import Runtime


def _randomize(model, st, seed: int) -> None:
    rt = model.rt
    cp = rt.cp
    for arr in (st.k, st.v):
        if arr.dtype == cp.uint8:  # fp8 codes: any finite e4m3 (exponents stay 0)
            rs = cp.random.RandomState(seed)
            arr[...] = rs.randint(0, 0x6F, arr.shape, dtype=cp.uint8)
        elif arr.dtype == cp.uint16:
            rt.launch("quant", "fill_random_bf16", min(-(-arr.size // 256), 65535), 256,
                      (arr, np.int64(arr.size), np.uint64(seed), np.float32(-1.0), np.float32(1.0)))
    from q27py.gpu import kernels as K

    K.fill_uniform(st.gdn, seed + 1, -0.05, 0.05)
    K.fill_uniform(st.window, seed + 2, -1.0, 1.0)


def measure(model, states, ctx: int, b: int, reps: int) -> dict:
    cp = model.rt.cp
    stream = model.stream
    vocab = model.cfg.vocab_size
    sts = states[:b]
    base = [ctx - 1 - 3 * i for i in range(b)]
    rng = np.random.default_rng(b)

    def rewind():
        for st, p in zip(sts, base):
            st.position = p

    def batched():
        outs = model.decode_batch(sts, rng.integers(0, vocab, b))
        outs[0].greedy_ids()  # all B ids in one copy (what a round needs)
        return outs

    def solo():
        for st in sts:
            model.forward(st, [int(rng.integers(0, vocab))]).greedy_ids()

    for fn in (batched, solo):  # eager, capture, replays (per state for solo)
        for _ in range(3):
            rewind()
            fn()
    stream.synchronize()
    out = {"ctx": ctx, "lanes": b}
    for name, fn in (("batch", batched), ("solo", solo)):
        host, dev = [], []
        for _ in range(reps):
            rewind()
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            t0 = time.perf_counter()
            e0.record(stream)
            fn()
            e1.record(stream)
            e1.synchronize()
            host.append((time.perf_counter() - t0) * 1e3)
            dev.append(cp.cuda.get_elapsed_time(e0, e1))
        ms = float(np.median(host))
        out[f"{name}_ms"] = ms
        out[f"{name}_device_ms"] = float(np.median(dev))
        out[f"{name}_tokens_per_s"] = b / ms * 1e3
    out["speedup"] = out["solo_ms"] / out["batch_ms"]
    rewind()
    return out


def main(argv=None) -> int:
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import random_weights
    from q27py.model.config import qwen36_27b_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--tier", default="q4s")
    ap.add_argument("--kv", choices=["bf16", "fp8", "k5v3", "k3v3"], default="bf16")
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048])
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args(argv)
    rt = Runtime.get()
    cfg = qwen36_27b_config()
    t0 = time.perf_counter()
    weights = random_weights(cfg, args.tier, args.seed)
    model = FastModel(weights, max_context=max(args.ctx) + 64, kv_dtype=args.kv, chunk=64, batch_sweep=True)
    model.enable_graphs()
    states = [model.new_state() for _ in range(max(args.lanes))]
    for i, st in enumerate(states):
        _randomize(model, st, 101 + 7 * i)
    rt.cp.cuda.get_current_stream().synchronize()
    print(f"{rt.name}: 27B shapes, {args.tier} weights, {args.kv} KV, attention {model.attn_decode}"
          f"{' (mma)' if model.attn_mma else ' (split)'}, gdn_fused {model.gdn_fused}; built in "
          f"{time.perf_counter() - t0:.0f} s; {len(states)} states of {states[0].nbytes() / 2 ** 20:.0f} MiB")
    print(f"{'ctx':>6s} {'B':>3s} {'batch ms':>9s} {'dev ms':>7s} {'t/s':>7s} {'solo ms':>8s} {'dev ms':>7s} "
          f"{'t/s':>7s} {'speedup':>7s}")
    rows = []
    for ctx in args.ctx:
        for b in args.lanes:
            r = measure(model, states, ctx, b, args.reps)
            rows.append(r)
            print(f"{ctx:6d} {b:3d} {r['batch_ms']:9.3f} {r['batch_device_ms']:7.3f} {r['batch_tokens_per_s']:7.1f} "
                  f"{r['solo_ms']:8.3f} {r['solo_device_ms']:7.3f} {r['solo_tokens_per_s']:7.1f} {r['speedup']:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": rt.describe(), "tier": args.tier, "kv": args.kv, "attn_decode": model.attn_decode,
                       "attn_mma": model.attn_mma, "gdn_fused": model.gdn_fused,
                       "batch_graph_bytes": model.graphs.model_bytes, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
