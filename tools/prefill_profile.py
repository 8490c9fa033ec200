"""Per-kernel device time of eager prefills (one device call): the 27B random-weights bench model
(as tools/device_prefill.py builds it, resident bf16 expansions as the device_wave `prefill` stage
enables them), one warm-up prefill, then under Runtime.profile_kernels():
  (a) a prefill of N tokens from an empty state, for each N in --tokens;
  (b) the warm agent turn: --warm-new tokens on top of a state holding --warm-context, run through
      the engine the way `q27py bench replay` runs a turn (LocalEngine + replay.first_token: prefix
      reuse, the decoder's chunked prefill with its MTP warm-up, one token picked).
Per run: the top labels (count, ms, share, TFLOP/s where known), the families, and the attention /
GEMM rates. An interval is the device timeline between two events, so where the GPU waited on the
host (a sync between the engine's chunks) that idle time lands on the next launch. Full JSON to
$OUT/prefill_profile.json.

    PYTHONPATH=. python3 tools/prefill_profile.py [--tokens 8192 32768] [--warm-context 24471] [--warm-new 807]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# label module -> family; gated_rmsnorm (norm.cu) belongs to the GDN block; the rest is "other"
# (gemm: every linear layer's work, cuBLAS and its expansions / conversions / epilogues, mma GEMM, GEMV)
FAMILY = {**dict.fromkeys(("cublas", "blas", "dequant", "gemm", "gemv", "gemv2", "gemv_wg", "quant"), "gemm"),
          **dict.fromkeys(("attention", "attention_prefill", "attention_prefill2", "attention_prefill3", "rope",
                           "kv_rotated"), "attention"),
          **dict.fromkeys(("gdn", "gdn_chunk", "gdn_chunk2", "gdn_decode", "conv"), "gdn"),
          "norm": "norm", "embed": "norm"}
FAMILIES = ("gemm", "attention", "gdn", "norm", "other")
ATTN_PREFILL_MODULES = ("attention_prefill", "attention_prefill2", "attention_prefill3")


def module_of(label: str) -> str:
    """A label's module ("module:kernel")."""
    return label.partition(":")[0]


def family(label: str) -> str:
    kernel = label.partition(":")[2]
    return "gdn" if kernel == "gated_rmsnorm" else FAMILY.get(module_of(label), "other")


def attention_flops(cfg, pos: int, t: int, layers: int) -> float:
    """Causal attention FLOPs of t queries at positions pos..pos+t-1: query p sees p + 1 keys, so the
    keys summed over the queries are t * S_avg = t * pos + t (t + 1) / 2; QK^T and PV are 2 FLOPs per
    multiply-add each: 4 * t * S_avg * head_dim * n_q_heads per attention layer."""
    return 4.0 * (t * pos + t * (t + 1) / 2) * cfg.head_dim * cfg.num_attention_heads * layers


def gemm_flops(tokens: int, rows: int, cols: int) -> float:
    """One matrix over T tokens: 2 * T * rows * cols. blas.py's marks report the same per cuBLAS call
    as run (k padded to kpad, SwiGLU's rows to whole tiles); this is the model's useful count."""
    return 2.0 * tokens * rows * cols


@contextmanager
def recording_calls(model, calls: list):
    """Log (kind, position, rows) of every main / MTP forward while open (the attention FLOPs)."""
    fwd, mtp = model.forward, model.mtp_forward

    def forward(state, ids, *a, **k):
        calls.append(("main", int(state.position), int(np.asarray(ids).size)))
        return fwd(state, ids, *a, **k)

    def mtp_forward(kv, hidden, next_ids, start, *a, **k):
        calls.append(("mtp", int(start), int(np.asarray(next_ids).size)))
        return mtp(kv, hidden, next_ids, start, *a, **k)

    model.forward, model.mtp_forward = forward, mtp_forward  # instance attributes shadow the methods
    try:
        yield
    finally:
        del model.forward, model.mtp_forward


def summarize(name: str, prof, calls: list, wall_s: float, cfg, shapes) -> dict:
    from q27py.gpu.forward import VERIFY_SPAN

    res, total = prof.result, prof.total_ms
    fams = {f: 0.0 for f in FAMILIES}
    for label, r in res.items():
        fams[family(label)] += r["ms"]
    # attention FLOPs: main layers per main forward, the MTP head's one layer per MTP pass; rows of
    # VERIFY_SPAN or fewer take the decode kernels, not the prefill ones
    n_full = len(cfg.full_layers)
    att_f = sum(attention_flops(cfg, p, t, n_full if kind == "main" else 1) for kind, p, t in calls if t > VERIFY_SPAN)
    att_labels = [k for k in res if module_of(k) in ATTN_PREFILL_MODULES]
    att_ms = sum(res[k]["ms"] for k in att_labels)
    main_att = [k for k in att_labels if "combine" not in k]
    gemm_labels = [k for k in res if "flops" in res[k]]
    g_f, g_ms = sum(res[k]["flops"] for k in gemm_labels), sum(res[k]["ms"] for k in gemm_labels)
    main_tokens = sum(t for kind, _, t in calls if kind == "main")  # the MTP head's linears are not in `shapes`
    useful = sum(n * gemm_flops(main_tokens, r, c) for _, r, c, n, _ in shapes)
    rows = []
    for label, r in sorted(res.items(), key=lambda kv: -kv[1]["ms"]):
        tf = r["flops"] / r["ms"] / 1e9 if "flops" in r and r["ms"] > 0 else None
        if tf is None and len(main_att) == 1 and label == main_att[0] and r["ms"] > 0:
            tf = att_f / r["ms"] / 1e9  # the attention FLOPs are the one prefill kernel's
        rows.append({"label": label, "family": family(label), "count": r["count"], "ms": r["ms"],
                     "share": r["ms"] / total if total else 0.0, "TFLOPs": tf})
    return {"run": name, "calls": calls, "wall_s": wall_s, "device_ms": total,
            "events": sum(r["count"] for r in res.values()), "off_stream": dict(prof.off_stream),
            "captured": prof.captured, "labels": rows,
            "families_ms": fams, "attention_prefill": {"flops": att_f, "ms": att_ms, "labels": att_labels,
                                                       "TFLOPs": att_f / att_ms / 1e9 if att_ms else None},
            "gemm_cublas": {"flops": g_f, "useful_main_flops": useful, "ms": g_ms,
                            "TFLOPs": g_f / g_ms / 1e9 if g_ms else None}}


def short(label: str, n: int = 40) -> str:
    return label if len(label) <= n else label[: n // 2 - 2] + "~" + label[-(n - n // 2 + 1):]


def show(s: dict, top: int) -> None:
    tot = s["device_ms"]
    print(f"== {s['run']}: device {tot:.1f} ms, wall {s['wall_s'] * 1e3:.1f} ms, {s['events']} events"
          + (f", off-stream {sum(s['off_stream'].values())}" if s["off_stream"] else "")
          + (f", captured {s['captured']}" if s["captured"] else ""))
    print(f"{'label':40s} {'count':>5s} {'ms':>8s} {'share':>6s} TF/s")
    for r in s["labels"][:top]:
        tf = f"{r['TFLOPs']:4.0f}" if r["TFLOPs"] is not None else ""
        print(f"{short(r['label']):40s} {r['count']:5d} {r['ms']:8.1f} {r['share']:6.1%} {tf}".rstrip())
    print("families: " + "  ".join(f"{f} {ms:.1f} ({ms / tot:.1%})" for f, ms in s["families_ms"].items() if tot))
    a, g = s["attention_prefill"], s["gemm_cublas"]
    fmt = lambda v: f"{v:.0f}" if v is not None else "-"  # noqa: E731
    print(f"attention prefill kernels {a['ms']:.1f} ms, {a['flops'] / 1e12:.2f} TFLOP -> {fmt(a['TFLOPs'])} TFLOP/s; "
          f"cuBLAS GEMMs {g['ms']:.1f} ms, {g['flops'] / 1e12:.2f} TFLOP as run (main stack's useful "
          f"{g['useful_main_flops'] / 1e12:.2f}) -> {fmt(g['TFLOPs'])} TFLOP/s", flush=True)


def main() -> int:
    from q27py.config import EngineConfig

    ap = argparse.ArgumentParser()
    ap.add_argument("--tier", default="q4s")
    ap.add_argument("--chunk", type=int, default=EngineConfig().gpu_prefill_chunk)
    ap.add_argument("--tokens", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--warm-context", type=int, default=24471)
    ap.add_argument("--warm-new", type=int, default=807, help="0: no warm turn")
    ap.add_argument("--system", type=int, default=0, metavar="N",
                    help="the warm turn's system_len (as bench replay passes it: the engine snapshots the state there; "
                         "0: none)")
    ap.add_argument("--cache-gb", type=float, default=60.0, help="resident bf16 expansions (0: off)")
    ap.add_argument("--attn-prefill", default=None, help="prefill attention kernel (default: the engine's)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also run the warm turn under cProfile (a second turn of the same shape) and print its "
                         "N costliest functions (where the host time between the device's pieces goes)")
    args = ap.parse_args()
    # the device_wave `prefill` stage's way: the env the process's ExpansionCache reads once (blas.weight_cache)
    os.environ["Q27_PREFILL_WEIGHT_CACHE_GB"] = str(args.cache_gb)

    from q27py.bench.random_weights import Bench
    from q27py.bench.replay import first_token
    from q27py.gpu import blas
    from q27py.gpu import kernels as K

    if args.attn_prefill is not None:
        K.ATTN_PREFILL = K.attn_prefill_mode(args.attn_prefill)
    # the warm turn, and with --host-profile a second one of the same shape on top of it
    warm_end = args.warm_context + args.warm_new * (2 if args.host_profile else 1) if args.warm_new else 0
    ctx = max(args.tokens + [warm_end, args.chunk]) + 64
    b = Bench(tier=args.tier, max_context=ctx, chunk=args.chunk, log=lambda *a: print(*a, flush=True))
    m, cfg, rt = b.model, b.cfg, b.rt
    rt.warm_all()  # no compile inside a profiled run
    cache = blas.weight_cache()
    res = {"device": rt.describe(), "tier": args.tier, "chunk": m.chunk, "attn_prefill": K.ATTN_PREFILL,
           "cache_budget_gb": cache.budget / 2**30 if cache else 0.0, "runs": []}
    print(f"27B {args.tier}, chunk {m.chunk}, attn_prefill {K.ATTN_PREFILL}, weight cache budget "
          f"{res['cache_budget_gb']:.1f} GiB", flush=True)
    rng = np.random.default_rng(0)
    shapes = b.linear_shapes()

    st = m.new_state()  # warm-up: launches, scratch, and the resident expansions of every matrix it uses
    m.forward(st, rng.integers(0, cfg.vocab_size, m.chunk), logits_rows="last")
    b.stream.synchronize()
    del st
    res["cache_used_gb"] = cache.used / 2**30 if cache else 0.0

    def profiled(name: str, fn) -> None:
        calls: list = []
        b.stream.synchronize()
        t0 = time.perf_counter()
        with recording_calls(m, calls), rt.profile_kernels(stream=b.stream) as prof:
            fn()
        s = summarize(name, prof, calls, time.perf_counter() - t0, cfg, shapes)
        res["runs"].append(s)
        show(s, args.top)

    for n in args.tokens:
        st = m.new_state()
        ids = rng.integers(0, cfg.vocab_size, n)
        profiled(f"prefill {n}", lambda st=st, ids=ids: m.forward(st, ids, logits_rows="last"))
        del st
    if args.warm_new:
        from q27py.config import Q27Config, apply_env, apply_overrides
        from q27py.engine.engine import LocalEngine
        from q27py.model.tiny import FULL_TOKENIZER
        from q27py.tokenizer import Tokenizer

        ecfg = apply_env(Q27Config())  # as `bench replay` builds it (graphs off: every launch eager, timed)
        apply_overrides(ecfg.engine, {"device": "cuda", "tier": args.tier, "max_context": m.max_pos})
        engine = LocalEngine(ecfg, m, Tokenizer.from_file(FULL_TOKENIZER))
        prior = [int(v) for v in rng.integers(0, cfg.vocab_size, args.warm_context)]
        turn = prior + [int(v) for v in rng.integers(0, cfg.vocab_size, args.warm_new)]
        if prior:  # the earlier turns: the live state ends at warm_context (--warm-context 0: a cold turn)
            first_token(engine, prior, len(prior))
        r: dict = {}
        profiled(f"warm turn {args.warm_context}+{args.warm_new}",
                 lambda: r.update(first_token(engine, turn, len(turn), args.system or None)))
        res["runs"][-1]["engine"] = r
        print(f"warm turn: prompt {r['prompt_tokens']}, reused {r['cached_tokens']}, ttft {r['ttft_s'] * 1e3:.1f} ms"
              + ("" if r["cached_tokens"] == args.warm_context else "  (reuse differs from --warm-context!)"))
        if args.host_profile:
            import cProfile
            import io
            import pstats

            turn2 = turn + [int(v) for v in rng.integers(0, cfg.vocab_size, args.warm_new)]  # the same shape again
            pr = cProfile.Profile()
            pr.enable()
            r2 = first_token(engine, turn2, len(turn2))
            pr.disable()
            buf = io.StringIO()
            st2 = pstats.Stats(pr, stream=buf)
            st2.sort_stats("cumulative").print_stats(args.host_profile)
            st2.sort_stats("tottime").print_stats(args.host_profile)
            print(f"host profile of a second warm turn (prompt {r2['prompt_tokens']}, reused {r2['cached_tokens']}, "
                  f"ttft {r2['ttft_s'] * 1e3:.1f} ms under cProfile):")
            print("\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip())[:12000])
    out = os.environ.get("OUT")
    if out:
        Path(out, "prefill_profile.json").write_text(json.dumps(res, indent=1, default=float))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
