"""The fp8 prefill route (EngineConfig.prefill_gemm "fp8": cuBLASLt e4m3 GEMM, q27py/gpu/blas.py
prefill_gemm_fp8) on the device, in one run:

    PYTHONPATH=. python3 tools/fp8_prefill.py [--skip-quality] [--skip-e2e]

1. correctness: one q4 and one q8 matrix, the fp8 route against a float64 product of the same
   e4m3-rounded operands (the route's own spec: only accumulation order may differ) and against
   the bf16 route (the tolerance class), each mode (store, add, SwiGLU);
2. speed per 27B linear shape at T = 4096 and 8192: bf16 route vs fp8 route, TFLOP/s, expansion
   included (against 790 bf16 / 1,979 fp8 dense TFLOP/s);
3. prefill 8K and 32K end to end on the 27B shapes (q4s random weights), both routes;
4. quality on the trained model (bundled q36-tiny-agent, q4s): prefill logits of held-out text
   (this repository's source), fp8 route vs bf16 route -- KL mean / p99.9, top-1 agreement, NLL.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def e4m3_round(x: np.ndarray) -> np.ndarray:
    from q27py.model.kvformat import e4m3_decode, e4m3_encode

    return e4m3_decode(e4m3_encode(x)).astype(np.float64)


def correctness() -> dict:
    from q27py.gpu import blas
    from q27py.gpu import kernels as K
    from q27py.gpu import layout as L
    from q27py.gpu.runtime import Runtime

    cp = Runtime.get().cp
    rng = np.random.default_rng(3)
    out = {}
    for fmt_name, fmt in (("q4", L.FMT_Q4), ("q8", L.FMT_Q8)):
        rows, cols, ntok = 512, 1024, 192
        w = rng.standard_normal((rows, cols)).astype(np.float32) * np.exp(rng.uniform(-2, 1, (rows, 1))).astype(np.float32)
        x = rng.standard_normal((ntok, cols)).astype(np.float32)
        x[7] *= 300.0  # an outlier token: per-token scales keep the others normal
        codes, scales = L.quantize(w, fmt)
        pm = L.pack_matrix(w, fmt)
        gm = K.upload_packed(pm)
        wq = L.dequantize(codes, scales, pm.shape.group).astype(np.float64)  # exact code * scale
        e = blas.weight_fp8_exponent(gm)
        w8 = e4m3_round(wq * 2.0 ** -e) * 2.0 ** e
        amax = np.abs(x).max(axis=1, keepdims=True)
        ex = np.frexp(amax)[1] - 8
        x8 = e4m3_round(x.astype(np.float64) * 2.0 ** -ex) * 2.0 ** ex
        want8 = x8 @ w8.T
        want16 = x.astype(np.float64) @ wq.T
        xd = cp.asarray(np.pad(x, ((0, 0), (0, gm.shape.kpad - cols))))
        r = {}
        for mode in ("store", "add"):
            y0 = rng.standard_normal((ntok, rows)).astype(np.float32)
            y = cp.asarray(y0)
            gm.mode = K.MODE_ADD if mode == "add" else K.MODE_STORE
            blas.prefill_gemm_fp8(gm, xd, xd.shape[1], ntok, y, rows)
            got = y.get().astype(np.float64) - (y0 if mode == "add" else 0)
            scale = np.abs(want8).max()
            r[mode] = {"err_vs_fp8_spec": float(np.abs(got - want8).max() / scale),
                       "err_vs_bf16_math": float(np.abs(got - want16).max() / scale)}
        gm.mode = K.MODE_STORE
        out[fmt_name] = r
        print(f"correctness {fmt_name}: " + "; ".join(f"{k}: vs fp8 spec {v['err_vs_fp8_spec']:.2e}, vs exact "
                                                       f"{v['err_vs_bf16_math']:.2e}" for k, v in r.items()))
    return out


def speed(b) -> list[dict]:
    from q27py.bench.random_weights import time_eager
    from q27py.gpu import blas

    cp = b.cp
    rows_out = []
    x = cp.empty((8192, 17408 + 64), dtype=cp.float32)
    from q27py.gpu import kernels as K

    K.fill_uniform(x, 5, -1.0, 1.0)
    for name, rows, cols, count, gm in b.linear_shapes():
        if not K.gemm_supported(gm):  # bf16 matrices stay on the GEMV in both routes
            continue
        y = cp.empty((8192, gm.shape.row_tiles * 16), dtype=cp.float32)
        for t in (4096, 8192):
            def timed(fn, reps=4):
                return time_eager(fn, b.stream, reps)

            plain = K.GpuMatrix(gm.shape, gm.codes, gm.scales, K.MODE_STORE, None)
            ldy = y.shape[1]
            with b.stream:
                ms16 = timed(lambda: blas.prefill_gemm(plain, x, x.shape[1], t, y, ldy))
                ms8 = timed(lambda: blas.prefill_gemm_fp8(plain, x, x.shape[1], t, y, ldy))
            flop = 2.0 * rows * cols * t
            r = {"matrix": name, "tokens": t, "bf16_ms": ms16, "fp8_ms": ms8, "bf16_TFLOPs": flop / ms16 / 1e9,
                 "fp8_TFLOPs": flop / ms8 / 1e9}
            rows_out.append(r)
            print(f"  {name:<12} T={t}: bf16 route {r['bf16_TFLOPs']:.0f} TFLOP/s, fp8 route {r['fp8_TFLOPs']:.0f} "
                  f"TFLOP/s ({ms16 / ms8:.2f}x)")
    return rows_out


def e2e(b) -> list[dict]:
    from q27py.gpu import kernels as K

    out = []
    for n in (8192, 32768):
        row = {"tokens": n}
        for route in ("auto", "fp8"):
            K.PREFILL_GEMM = route
            row[route] = b.prefill(n)["tokens_per_s"]
        K.PREFILL_GEMM = "auto"
        out.append(row)
        print(f"prefill {n}: bf16 route {row['auto']:.0f} tok/s, fp8 route {row['fp8']:.0f} tok/s "
              f"({row['fp8'] / row['auto']:.2f}x)")
    return out


def quality(tokens: int = 2048) -> dict:
    from q27py import DEFAULT_MODEL_DIR
    from q27py.gpu import kernels as K
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint
    from q27py.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(Path(DEFAULT_MODEL_DIR))
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted((ROOT / "q27py" / "engine").glob("*.py")))
    ids = tok.encode(text)[:tokens]
    w = from_checkpoint(Checkpoint.open(Path(DEFAULT_MODEL_DIR)), "q4s", progress=False)
    logits = {}
    for route in ("auto", "fp8"):
        K.PREFILL_GEMM = route
        m = FastModel(w, max_context=len(ids) + 64, kv_dtype="bf16", chunk=512)
        st = m.new_state()
        rows = []
        for s in range(0, len(ids) - 1, 512):  # 512-token chunks: each on the GEMM route, all rows back
            piece = ids[s:s + 512]
            rows.append(m.forward(st, piece, logits_rows="all").logits.astype(np.float64))
        logits[route] = np.concatenate(rows)[: len(ids) - 1]
        del m
    K.PREFILL_GEMM = "auto"

    def lsm(x):
        mx = x.max(-1, keepdims=True)
        return x - mx - np.log(np.exp(x - mx).sum(-1, keepdims=True))

    lp, lq = lsm(logits["auto"]), lsm(logits["fp8"])
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    tgt = np.asarray(ids[1:])
    r = {"positions": int(len(tgt)), "kl_mean": float(kl.mean()), "kl_p999": float(np.quantile(kl, 0.999)),
         "kl_max": float(kl.max()), "top1_agree": float((lp.argmax(-1) == lq.argmax(-1)).mean()),
         "nll_bf16": float(-lp[np.arange(len(tgt)), tgt].mean()), "nll_fp8": float(-lq[np.arange(len(tgt)), tgt].mean())}
    print(f"quality (q36-tiny-agent q4s, {r['positions']} positions): KL mean {r['kl_mean']:.2e} p99.9 "
          f"{r['kl_p999']:.2e} max {r['kl_max']:.2e}, top-1 agree {r['top1_agree']:.4f}, NLL bf16 {r['nll_bf16']:.4f} "
          f"fp8 {r['nll_fp8']:.4f}")
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = {"correctness": correctness()}
    if not args.skip_quality:
        res["quality"] = quality()
    from q27py.bench.random_weights import Bench

    t0 = time.perf_counter()
    b = Bench(tier="q4s", max_context=32768 + 64, log=lambda *a: None)
    print(f"27B random weights built in {time.perf_counter() - t0:.1f} s")
    res["speed"] = speed(b)
    if not args.skip_e2e:
        res["e2e"] = e2e(b)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
