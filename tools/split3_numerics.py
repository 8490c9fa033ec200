"""CPU numerics behind q27py/gpu/blas.py prefill_gemm_split3 (the small bf16 matrices' three-term route):
relative L2 error against float64 of

  - "sgemm": a sequential round-to-nearest fp32 FMA chain per output (what a pedantic SGEMM does without split-K),
  - "split3 kp=N": x = hi + mid + lo in bf16, W hi in K pieces of N columns, W mid / W lo over the full K, each
    product accumulated by an emulated tensor core, then lo + mid, the hi pieces in order, round to nearest
    (N = K: the plain three-GEMM form),
  - "stacked": [hi | mid | lo] against [W | W | W] in one accumulation,

under emulated tensor-core accumulations (published models: Fasi et al. 2021, Khattak & Mikaitis 2025): each
MMA step adds a block of `bs` exact products to the fp32 accumulator, every term truncated to `extra` bits past
the largest one's 24, and the sum rounded toward zero. Which (bs, extra) a given card implements is not known
here; the route's piece size (blas.SPLIT3_PIECE_CHUNKS) is chosen so every model stays at or under the sgemm row.

    python3 tools/split3_numerics.py [--k 640 5120] [--tokens 40] [--pieces 256 320 512 1024]

--model-drift: what an fp32-grade change of the gates does to a whole model's logits (the q4s logits note in
tests/gpu/test_prefill_split3.py). The bundled model on the CPU fast path (FastCPUModel, one 300-token prompt),
with every matrix but the gates' ab fed bf16-rounded activations (as q4s's cuBLAS route feeds its q4 / q8
matrices) or not (the bf16 tier), ab computed as: x @ W^T in float32 (the reference run), in float64 rounded once,
in float32 over K reversed (both fp32-grade), and from bf16 activations (a 2^-9 error, a broken route). Prints
each run's max |logit difference| from the reference over the logit scale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # q27py, for --model-drift

MODELS = ((16, 0), (16, 3), (8, 3), (4, 3))  # (products per MMA step, extra alignment bits)


def bf16(a) -> np.ndarray:
    """Round to nearest even bf16, as float32 (f32_to_bf16_rows)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)).view(np.float32)


def split3(x) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    hi = bf16(x)
    r = (x - hi).astype(np.float32)
    mid = bf16(r)
    return hi, mid, bf16((r - mid).astype(np.float32))


def _rz32(a: np.ndarray) -> np.ndarray:
    f = a.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(a)
    f[over] = np.nextafter(f[over], np.float32(0))
    return f


def tc_gemm(x, w, bs: int, extra: int) -> np.ndarray:
    """[N][M] = x [N][K] . w [M][K]^T, bf16 operands, through the emulated tensor-core accumulation."""
    c = np.zeros((x.shape[0], w.shape[0]), np.float32)
    xd, wd = x.astype(np.float64), w.astype(np.float64)
    for k0 in range(0, x.shape[1], bs):
        terms = np.concatenate([xd[:, None, k0:k0 + bs] * wd[None, :, k0:k0 + bs], c.astype(np.float64)[:, :, None]], 2)
        mx = np.abs(terms).max(axis=2)
        q = np.exp2(np.floor(np.log2(np.where(mx > 0, mx, 1.0))) - 23 - extra)[:, :, None]
        c = _rz32((np.trunc(terms / q) * q).sum(axis=2))
    return c


def sgemm(x, w) -> np.ndarray:
    acc = np.zeros((x.shape[0], w.shape[0]), np.float32)
    xd, wd = x.astype(np.float64), w.astype(np.float64)
    for k in range(x.shape[1]):
        acc = (acc.astype(np.float64) + xd[:, k:k + 1] * wd[None, :, k]).astype(np.float32)  # one rounding: FMA
    return acc


def split3_route(x, w, kp: int, bs: int, extra: int) -> np.ndarray:
    hi, mid, lo = split3(x)
    s = (tc_gemm(lo, w, bs, extra) + tc_gemm(mid, w, bs, extra)).astype(np.float32)
    h = None
    for k0 in range(0, x.shape[1], kp):
        p = tc_gemm(hi[:, k0:k0 + kp], w[:, k0:k0 + kp], bs, extra)
        h = p if h is None else (h + p).astype(np.float32)
    return (h + s).astype(np.float32)


def stacked(x, w, bs: int, extra: int) -> np.ndarray:
    return tc_gemm(np.concatenate(split3(x), 1), np.concatenate([w, w, w], 1), bs, extra)


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def model_drift(tokens: int = 300) -> None:
    from q27py import DEFAULT_MODEL_DIR
    from q27py.model.fastcpu import FastCPUModel

    class Emulated(FastCPUModel):
        round_acts, ab = True, "f32"

        def _linear(self, x, name):
            w = self.w[name]
            y = ((bf16(x) if self.round_acts else x) @ w.T).astype(np.float32)
            if name.endswith("fused.weight"):  # a GDN layer's qkv | z | b | a: the last 2 hv rows are ab
                nab = 2 * self.cfg.linear_num_value_heads
                wab = w[-nab:]
                y[:, -nab:] = {"f32": lambda: x @ wab.T,
                               "f64": lambda: x.astype(np.float64) @ wab.T.astype(np.float64),
                               "reversed": lambda: x[:, ::-1] @ wab.T[::-1],
                               "bf16 x": lambda: bf16(x) @ wab.T}[self.ab]()
            return y

    model = Emulated.load(DEFAULT_MODEL_DIR)
    ids = np.random.default_rng(13).integers(0, 16000, tokens).tolist()
    for round_acts in (False, True):
        Emulated.round_acts = round_acts
        out = {}
        for ab in ("f32", "f64", "reversed", "bf16 x"):
            Emulated.ab = ab
            out[ab] = np.asarray(model.forward(model.new_state(), ids, logits_rows="last").logits, np.float64)
        scale = np.abs(out["f32"]).max()
        print(f"activations {'bf16 (q4s)' if round_acts else 'fp32 (bf16 tier)'}: " + ", ".join(
            f"ab {k} {np.abs(v - out['f32']).max() / scale:.2g}" for k, v in out.items() if k != "f32"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, nargs="+", default=[640, 5120])
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--pieces", type=int, nargs="+", default=[256, 320, 512, 1024])
    ap.add_argument("--stacked", action="store_true", help="also the [hi | mid | lo] x [W | W | W] form")
    ap.add_argument("--model-drift", action="store_true", help="the whole-model logits experiment (module doc)")
    a = ap.parse_args()
    if a.model_drift:
        model_drift()
        return
    print("models (bs, extra bits): " + "  ".join(f"{m}" for m in MODELS))
    for k in a.k:
        rng = np.random.default_rng(k)
        w = bf16(rng.standard_normal((a.rows, k)) * 0.05)
        x = rng.standard_normal((a.tokens, k)).astype(np.float32)
        ref = x.astype(np.float64) @ w.T.astype(np.float64)
        print(f"K = {k}: sgemm {rel(sgemm(x, w), ref):.2e}")
        for kp in sorted({p for p in a.pieces if p < k} | {k}):
            errs = [rel(split3_route(x, w, kp, bs, e), ref) for bs, e in MODELS]
            print(f"  split3 kp={kp:5d}: " + "  ".join(f"{v:.2e}" for v in errs))
        if a.stacked:
            print("  stacked:       " + "  ".join(f"{rel(stacked(x, w, bs, e), ref):.2e}" for bs, e in MODELS))


if __name__ == "__main__":
    main()
