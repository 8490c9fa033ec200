"""`q27py bench --random-weights 27b`: full Qwen3.6-27B shapes, seeded random weights made on
the GPU, timings stated against the physical limits measured in the same run.

Reported (each with achieved GB/s or TFLOP/s and the fraction of the measured ceiling):
  copy bandwidth (device-to-device, read + write bytes)   -> the HBM roofline used below
  gemv sweeps: every layer's gate/up matrix at 1, 8, 16 lanes (weights only, no L2 reuse)
  decode t/s at context 2K and 32K (device time per step in a CUDA graph, and host loop)
  verify round (W lanes + commit) for W = 1..16 at 2K
  kernels per decode step and per verify round (every launch recorded into the step's graph),
    by family; the GDN kernel chain vs the fused GDN step (cuda/gdn_decode.cu) at 1 / 8 / 16 lanes
  one MTP draft step
  prefill tok/s at 2K, 8K, 32K
  memory per sequence at the given contexts
Byte counts per step: weights streamed (stream_bytes) + KV read (2 x ctx x kv heads x
head_dim x 2 B per attention layer) + GDN state read and written.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

from q27py.gpu import kernels as K
from q27py.gpu.layout import FMT_BF16 as L_FMT_BF16
from q27py.gpu.layout import round_up
from q27py.gpu.forward import FastModel
from q27py.gpu.graphs import capture
from q27py.gpu.runtime import Runtime, pdl_mode
from q27py.gpu.weights import random_weights
from q27py.model.config import qwen36_27b_config

BF16_DENSE_PEAK_TFLOPS = 790.0
# kernel families of one forward, for the decode time breakdown
FAMILIES = {
    "gemv": {"GemvPlan.run", "GemvPlan.run_walk"},
    "norms": {"rmsnorm", "embed"},
    "gdn": {"gdn_conv", "gdn_conv_commit", "gdn_step", "gdn_prefill", "gated_rmsnorm", "gdn_decode_fused",
            "gdn_conv_lanes", "gdn_conv_commit_lanes", "gdn_step_lanes", "gdn_decode_fused_lanes"},
    "attention": {"qk_norm_rope_store", "attention", "attention_prefill", "qk_norm_rope_store_fp8", "attention_fp8",
                  "attention_prefill_fp8", "qk_norm_rope_store_rot", "attention_rotated", "attention_prefill_rotated",
                  "attention_prefill2", "attention_mma", "qk_norm_rope_store_lanes", "qk_norm_rope_store_fp8_lanes",
                  "attention_lanes", "attention_mma_lanes"},
    "argmax": {"top2"},
}  # the box's measured cuBLAS-class bf16 GEMM (KINDS.md); spec dense ~990


# kernel launches by family (Runtime.count_launches keys (module, kernel)); gated_rmsnorm lives in
# norm.cu but belongs to the GDN block, as in FAMILIES
MODULE_FAMILY = {"gemv": "gemv", "gemv2": "gemv", "gemm": "gemv", "norm": "norms", "embed": "norms", "conv": "gdn",
                 "gdn": "gdn", "gdn_decode": "gdn", "gdn_chunk": "gdn", "rope": "attention", "attention": "attention",
                 "attention_prefill": "attention", "sampling": "argmax"}


def launch_families(tally) -> dict:
    out: dict[str, int] = {}
    for (module, kernel), n in sorted(tally.items()):
        fam = "gdn" if kernel == "gated_rmsnorm" else MODULE_FAMILY.get(module, module)
        out[fam] = out.get(fam, 0) + n
    return out


def captured(enqueue, stream) -> tuple[object, dict]:
    """(graph of enqueue's launches, its kernel count: total and by family)."""
    rt = Runtime.get()
    with rt.count_launches() as tally:
        with stream:
            g = capture(enqueue, stream)
    return g, {"total": sum(tally.values()), "by_family": launch_families(tally)}


def _time_graph(graph, stream, reps: int) -> float:
    """Median milliseconds per replay over `reps` replays, timed in 3 batches with CUDA events."""
    cp = Runtime.get().cp
    for _ in range(3):  # warm-up: clocks up, caches and TLBs settled
        graph.launch(stream)
    stream.synchronize()
    batches = []
    per = max(1, reps // 3)
    for _ in range(3):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(stream)
        for _ in range(per):
            graph.launch(stream)
        e1.record(stream)
        e1.synchronize()
        batches.append(cp.cuda.get_elapsed_time(e0, e1) / per)
    return float(np.median(batches))


def time_eager(fn, stream, reps: int = 5) -> float:
    """Milliseconds per call of fn (eager launches on stream), one warm call first, CUDA events."""
    cp = Runtime.get().cp
    fn()
    stream.synchronize()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record(stream)
    for _ in range(reps):
        fn()
    e1.record(stream)
    e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) / reps


def copy_bandwidth(nbytes: int = 4 << 30) -> dict:
    """Device-to-device copy (read + write bytes counted) and a streaming-read probe (cuda/probe.cu)."""
    rt = Runtime.get()
    cp = rt.cp
    src = cp.empty(nbytes // 4, dtype=cp.float32)
    K.fill_uniform(src, 1, -1.0, 1.0)
    dst = cp.empty_like(src)
    sink = cp.zeros(1, dtype=cp.uint32)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        g = capture(lambda: cp.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, 3, stream.ptr), stream)
        ms = _time_graph(g, stream, 30)
        ms_read = read_probe_ms(src, sink, stream)
    return {"bytes_moved": 2 * nbytes, "ms": ms, "GBps": 2 * nbytes / ms / 1e6,
            "read_bytes": nbytes, "read_ms": ms_read, "read_GBps": nbytes / ms_read / 1e6}


def read_probe_ms(src, sink, stream, reps: int = 30) -> float:
    """Milliseconds of one streaming read of `src` (cuda/probe.cu, 16-byte loads): the roofline."""
    rt = Runtime.get()
    n16 = src.nbytes // 16
    g = capture(lambda: rt.launch("probe", "read_bw", rt.sm_count * 8, 256, (src, np.int64(n16), sink)), stream)
    return _time_graph(g, stream, reps)


def fmt_ms(d: dict) -> str:
    return " ".join(f"{k} {v:.3f}" for k, v in d.items())


def L_round(k: int) -> int:
    return round_up(k, 64)


VERIFY_BREAKDOWN_WIDTHS = (1, 8, 16)  # verify rounds also timed family by family (the decode step always is)


@contextmanager
def only_family(keep: set):
    """Every kernel family of FAMILIES other than `keep` becomes a no-op inside the block (the
    per-family breakdowns of decode and prefill time)."""
    saved = {}
    for names in FAMILIES.values():
        if names is keep:
            continue
        for name in names:
            obj, attr = (K.GemvPlan, name.split(".")[1]) if name.startswith("GemvPlan.") else (K, name)
            saved[(obj, attr)] = getattr(obj, attr)
            setattr(obj, attr, lambda *a, **k: None)
    try:
        yield
    finally:
        for (obj, attr), fn in saved.items():
            setattr(obj, attr, fn)


class Bench:
    def __init__(self, tier: str = "q4s", seed: int = 0, max_context: int = 32768 + 64, chunk: int = 4096, log=print):
        self.rt = Runtime.get()
        self.cp = self.rt.cp
        self.log = log
        self.cfg = qwen36_27b_config()
        t0 = time.perf_counter()
        self.weights = random_weights(self.cfg, tier, seed)
        self.build_s = time.perf_counter() - t0
        # Q27_ATTN_DECODE=mma times the tensor-core decode / verify attention (q27py/bench/attn_probe.py
        # times that family alone at 2K / 32K / 128K, bf16 and fp8)
        self.attn_decode = K.attn_decode_default()
        self.model = FastModel(self.weights, max_context=max_context, kv_dtype="bf16", chunk=chunk,
                               attn_decode=self.attn_decode)
        self.stream = self.model.stream
        self.state = self.model.new_state()
        self._randomize_state(self.state, seed)
        # Q27_PDL=on|early: the captured steps launch with programmatic dependent launch (graphs.capture)
        self.result: dict = {"tier": tier, "device": self.rt.describe(), "attn_decode": self.attn_decode,
                             "pdl": pdl_mode(), "weights_build_s": self.build_s,
                             "stream_bytes": self.weights.stream_bytes(), "mtp_step_weight_bytes": self.weights.mtp_step_bytes(),
                             "total_weight_bytes": self.weights.total_bytes()}

    def _randomize_state(self, st, seed: int) -> None:
        rt = self.rt
        for arr in (st.k, st.v, st.mtp_k, st.mtp_v):
            if arr is None:
                continue
            if arr.dtype == self.cp.uint8:  # fp8: any finite e4m3 (exponents stay 0 = 2^0); rotated codes: any byte
                rs = self.cp.random.RandomState(seed + 17)
                arr[...] = rs.randint(0, 0x6F, arr.shape, dtype=self.cp.uint8) | (rs.randint(0, 2, arr.shape, dtype=self.cp.uint8) << 7)
                continue
            rt.launch("quant", "fill_random_bf16", min(-(-arr.size // 256), 65535), 256,
                      (arr, np.int64(arr.size), np.uint64(seed + 17), np.float32(-1.0), np.float32(1.0)))
        for name, arr in st.side_arrays().items():
            if name.endswith(".norm"):  # rotated KV: fp16 norm 16.0 (a unit-variance row of d = 256)
                arr.fill(0x4C00)
        K.fill_uniform(st.gdn, seed + 19, -0.05, 0.05)
        K.fill_uniform(st.window, seed + 23, -1.0, 1.0)
        self.cp.cuda.get_current_stream().synchronize()

    # ---------------------------------------------------------------- pieces
    def kv_bytes(self, ctx: int) -> int:
        """KV bytes one step reads at ctx (main layers; the cache's own format)."""
        c, m = self.cfg, self.model
        per_tok = m.memory_per_sequence(1) - m.memory_per_sequence(0)
        return ctx * per_tok * len(c.full_layers) // (len(c.full_layers) + (1 if m.has_mtp else 0))

    def gdn_bytes(self) -> int:
        c = self.cfg
        return 2 * 4 * len(c.linear_layers) * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim

    def _set(self, st, pos: int, ids) -> None:
        m = self.model
        with self.stream:
            m.ids[: len(ids)].set(np.asarray(ids, np.int32), stream=self.stream)
            st.ctl.set(np.array([pos, pos, 1, 0], np.int32), stream=self.stream)
        self.stream.synchronize()

    def gemv_sweep(self, lanes=(1, 8, 16)) -> list[dict]:
        m = self.model
        out = []
        plans = [p["up"] for p in m.layer_plans]
        nbytes = sum(p.nbytes for p in plans)
        for n in lanes:
            with self.stream:
                g = capture(lambda: [p.run(m.x, m.hp, n) for p in plans], self.stream)
            ms = _time_graph(g, self.stream, 30)
            out.append({"lanes": n, "matrices": len(plans), "bytes": nbytes, "ms": ms, "GBps": nbytes / ms / 1e6})
            self.log(f"  gemv gate_up x{len(plans)} lanes={n:2d}: {ms:.3f} ms  {nbytes / ms / 1e6:.0f} GB/s")
        return out

    def decode(self, ctx: int, steps: int = 30) -> dict:
        m, st = self.model, self.state
        self._set(st, ctx - 1, [7])
        st.position = ctx - 1
        g, kernels = captured(lambda: m.enqueue_main(st, 1, False, np.array([0])), self.stream)
        # each replay writes the same position: fine for timing, the work per step is the same
        ms = _time_graph(g, self.stream, steps)
        nbytes = self.weights.stream_bytes() + self.kv_bytes(ctx) + self.gdn_bytes()
        # host loop: ids/pos upload, graph launch, token download, per token
        t0 = time.perf_counter()
        n_host = 10
        for i in range(n_host):
            with self.stream:
                m.ids[:1].set(np.array([7 + i], np.int32), stream=self.stream)
                g.launch(self.stream)
                m.tok[:1].get(stream=self.stream)
        host_ms = (time.perf_counter() - t0) / n_host * 1e3
        # where the time goes: the same step with only one kernel family left in
        breakdown = {fam: self._time_only(keep, lambda: m.enqueue_main(st, 1, False, np.array([0])), 12)
                     for fam, keep in FAMILIES.items()}
        non_gemv = sum(v for k, v in breakdown.items() if k != "gemv")
        return {"context": ctx, "ms_per_token_device": ms, "tokens_per_s": 1e3 / ms, "ms_per_token_host_loop": host_ms,
                "ms_without_gemv": non_gemv, "breakdown_ms": breakdown, "bytes_per_step": nbytes,
                "GBps": nbytes / ms / 1e6, "kernels_per_step": kernels["total"],
                "kernels_by_family": kernels["by_family"], "gdn_fused": m.gdn_fused}

    def _time_only(self, keep: set, enqueue, reps: int) -> float:
        """Graph time of `enqueue` with every kernel family outside `keep` turned into a no-op."""
        with only_family(keep):
            with self.stream:
                g = capture(enqueue, self.stream)
            return _time_graph(g, self.stream, reps)

    def verify(self, ctx: int = 2048, widths=range(1, 17)) -> list[dict]:
        m, st = self.model, self.state
        out = []
        for w in widths:
            self._set(st, ctx - 1, list(range(5, 5 + w)))

            def round_():
                m.enqueue_main(st, w, True, np.arange(w))
                m.enqueue_commit(st)

            g, kernels = captured(round_, self.stream)
            ms = _time_graph(g, self.stream, 15)
            nbytes = self.weights.stream_bytes() + self.kv_bytes(ctx) + 2 * self.gdn_bytes()
            row = {"width": w, "ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6,
                   "kernels_per_round": kernels["total"], "kernels_by_family": kernels["by_family"]}
            extra = ""
            if w in VERIFY_BREAKDOWN_WIDTHS:  # where a wider round's extra time goes, family by family
                row["breakdown_ms"] = {fam: self._time_only(keep, round_, 8) for fam, keep in FAMILIES.items()}
                extra = "; by family " + fmt_ms(row["breakdown_ms"])
            out.append(row)
            self.log(f"  verify W={w:2d}: {ms:.3f} ms, {kernels['total']} kernels{extra}")
        return out

    def gdn_fused_compare(self, ctx: int = 2048, widths=(1, 8, 16), warps=(None, 4, 8, 16, 32)) -> list[dict]:
        """Decode step and verify rounds with the GDN chain vs the fused kernel (FastModel.gdn_fused)
        at each warps-per-block choice, in one run: device ms and kernels per step / round."""
        from q27py.gpu import constants as C

        m, st = self.model, self.state
        saved = (m.gdn_fused, m.gdn_fused_warps)
        out = []
        try:
            for wp in warps:
                m.gdn_fused, m.gdn_fused_warps = (False, C.GDN_FD_WARPS) if wp is None else (True, wp)
                row = {"fused": wp is not None, "warps": wp}
                self._set(st, ctx - 1, [7])
                g, k = captured(lambda: m.enqueue_main(st, 1, False, np.array([0])), self.stream)
                row["decode_ms"], row["decode_kernels"] = _time_graph(g, self.stream, 30), k["total"]
                for w in widths:
                    self._set(st, ctx - 1, list(range(5, 5 + w)))

                    def round_():
                        m.enqueue_main(st, w, True, np.arange(w))
                        m.enqueue_commit(st)

                    g, k = captured(round_, self.stream)
                    row[f"verify_w{w}_ms"], row[f"verify_w{w}_kernels"] = _time_graph(g, self.stream, 15), k["total"]
                out.append(row)
                self.log(f"  GDN {'fused, ' + str(wp) + ' warps' if wp else 'chain':<16}: decode {row['decode_ms']:.3f} ms "
                         f"({row['decode_kernels']} kernels); " + "; ".join(
                             f"W={w} {row[f'verify_w{w}_ms']:.3f} ms ({row[f'verify_w{w}_kernels']})" for w in widths))
        finally:
            m.gdn_fused, m.gdn_fused_warps = saved
        return out

    def mtp_step(self, ctx: int = 2048) -> dict:
        m, st = self.model, self.state
        self._set(st, ctx - 1, [5])
        with self.stream:
            m.mtp_ids[:1].set(np.array([9], np.int32), stream=self.stream)
            g = capture(lambda: m.enqueue_mtp(st, 1), self.stream)
        ms = _time_graph(g, self.stream, 30)
        nbytes = self.weights.mtp_step_bytes() + self.kv_bytes(ctx) // len(self.cfg.full_layers)
        return {"context": ctx, "ms": ms, "bytes": nbytes, "GBps": nbytes / ms / 1e6}

    def prefill(self, n: int) -> dict:
        m = self.model
        st = m.new_state()
        ids = np.random.default_rng(n).integers(0, self.cfg.vocab_size, n)
        m.forward(st, ids[: m.chunk], logits_rows="last")  # warm (compiles, first launches)
        st.reset()
        self.stream.synchronize()
        t0 = time.perf_counter()
        m.forward(st, ids, logits_rows="last")
        self.stream.synchronize()
        s = time.perf_counter() - t0
        flops = 2.0 * (self.weights_params()) * n
        del st
        return {"tokens": n, "seconds": s, "tokens_per_s": n / s, "weight_TFLOPs": flops / s / 1e12}

    def prefill_breakdown(self, n: int) -> dict:
        """Prefill seconds of n tokens with only one kernel family left in (eager, as the engine runs it)."""
        m = self.model
        ids = np.random.default_rng(n + 1).integers(0, self.cfg.vocab_size, n)
        out = {}
        for fam, keep in FAMILIES.items():
            if fam == "argmax":
                continue
            with only_family(keep):
                st = m.new_state()
                self.stream.synchronize()
                t0 = time.perf_counter()
                m.forward(st, ids, logits_rows="last")
                self.stream.synchronize()
                out["gemm" if fam == "gemv" else fam] = time.perf_counter() - t0
                del st
        flops = {"gemm": 2.0 * self.weights_params() * n, "attention": self.attention_flops(n)}
        return {"tokens": n, "seconds": out,
                "TFLOPs": {k: flops[k] / out[k] / 1e12 for k in flops if out.get(k)}}

    def attention_flops(self, n: int) -> float:
        """Causal attention matrix FLOP of an n-token prefill (QK^T and PV, half the square)."""
        c = self.cfg
        return 4.0 * c.num_attention_heads * c.head_dim * (n * (n + 1) / 2) * len(c.full_layers)

    def linear_shapes(self) -> list[tuple[str, int, int, int, object]]:
        """(name, rows, cols, count, a packed matrix of that shape) for every linear of the main stack."""
        shapes: dict[tuple[int, int], list] = {}
        for lw in self.weights.layers:
            mats = [("gate_up", lw.gate_up), ("down", lw.down)]
            if lw.attn is not None:
                mats += [("attn_q", lw.attn.q), ("attn_kv", lw.attn.kv), ("attn_o", lw.attn.o)]
            if lw.gdn is not None:
                mats += [("gdn_qkvz", lw.gdn.qkvz), ("gdn_ab", lw.gdn.ab), ("gdn_out", lw.gdn.out)]
            for name, gm in mats:
                key = (gm.nout if gm.mode != K.MODE_SWIGLU else gm.shape.rows, gm.shape.cols)
                e = shapes.setdefault(key, [name, key[0], key[1], 0, gm])
                e[3] += 1
        return [tuple(v) for v in shapes.values()]

    def prefill_gemm_routes(self, tokens=(64, 128, 256, 512, 1024, 2048, 4096, 8192)) -> list[dict]:
        """Per linear shape and chunk size: the mma.sync kernel, cuBLAS on the bf16 expansion
        (expansion included), and plain cuBLAS bf16 on pre-expanded weights (the peer/ceiling)."""
        from q27py.gpu import blas

        cp = self.cp
        out = []
        tmax = max(tokens)
        kmax = max(c for _, _, c, _, _ in self.linear_shapes())
        x = cp.empty((tmax, L_round(kmax)), dtype=cp.float32)
        K.fill_uniform(x, 5, -1.0, 1.0)
        for name, rows, cols, count, gm in self.linear_shapes():
            kpad = gm.shape.kpad
            y = cp.empty((tmax, gm.shape.row_tiles * 16), dtype=cp.float32)
            wb = blas.dequantize_to_bf16(gm, cp.empty(gm.shape.row_tiles * 16 * kpad, dtype=cp.uint16))
            xb = blas.to_bf16(x, x.shape[1], tmax, kpad, cp.empty(tmax * kpad, dtype=cp.uint16))
            for t in tokens:
                row = {"matrix": name, "rows": rows, "cols": cols, "count": count, "tokens": t}
                flop = 2.0 * rows * cols * t

                def timed(fn, reps=5):
                    return time_eager(fn, self.stream, reps)

                with self.stream:
                    plain = K.GpuMatrix(gm.shape, gm.codes, gm.scales, K.MODE_STORE, None)
                    ldy = y.shape[1]
                    if gm.shape.fmt != L_FMT_BF16:
                        saved = K.PREFILL_GEMM
                        try:
                            K.PREFILL_GEMM = "kernel"
                            row["kernel_ms"] = timed(lambda: K.gemm(plain, x, x.shape[1], t, y, ldy))
                        finally:
                            K.PREFILL_GEMM = saved
                        row["cublas_expand_ms"] = timed(lambda: blas.prefill_gemm(plain, x, x.shape[1], t, y, ldy))
                    row["cublas_bf16_ms"] = timed(lambda: blas.gemm_bf16(wb, kpad, xb, kpad, t, plain.nout, kpad, y, ldy,
                                                                         False))
                for k in ("kernel_ms", "cublas_expand_ms", "cublas_bf16_ms"):
                    if k in row:
                        row[k.replace("_ms", "_TFLOPs")] = flop / row[k] / 1e9
                out.append(row)
                self.log("  gemm %-8s %5dx%-5d T=%4d: " % (name, rows, cols, t) + "  ".join(
                    f"{k[:-7]} {row[k]:.0f}" for k in ("kernel_TFLOPs", "cublas_expand_TFLOPs", "cublas_bf16_TFLOPs")
                    if k in row) + " TFLOP/s")
            del y, wb, xb
        return out

    def linear_ceiling(self, routes: list[dict], t: int) -> dict:
        """cuBLAS bf16 time of every main-stack linear for t tokens on pre-expanded weights: the
        prefill ceiling issue 14 measures against (what an engine holding bf16 weights would pay)."""
        rows = [r for r in routes if r["tokens"] == t]
        ceil_s = sum(r["cublas_bf16_ms"] * r["count"] for r in rows) / 1e3
        return {"tokens": t, "cublas_bf16_linear_s": ceil_s, "cublas_linear_tok_s": t / ceil_s}

    def weights_params(self) -> int:
        c = self.cfg
        h, i = c.hidden_size, c.intermediate_size
        per_mlp = 3 * h * i
        gdn = h * (c.gdn_conv_dim + c.linear_num_value_heads * c.linear_value_head_dim + 2 * c.linear_num_value_heads) + \
            c.linear_num_value_heads * c.linear_value_head_dim * h
        att = h * (2 * c.num_attention_heads * c.head_dim + 2 * c.num_key_value_heads * c.head_dim) + \
            c.num_attention_heads * c.head_dim * h
        return per_mlp * c.num_hidden_layers + gdn * len(c.linear_layers) + att * len(c.full_layers)

    def run(self, decode_ctx=(2048, 32768), prefill_lens=(2048, 8192, 32768), mem_ctx=(2048, 32768, 131072),
            prefill_detail: bool = True) -> dict:
        r = self.result
        log = self.log
        r["copy"] = copy_bandwidth()
        bw = r["copy"]["GBps"]
        log(f"copy bandwidth: {bw:.0f} GB/s (read+write); streaming read {r['copy']['read_GBps']:.0f} GB/s")
        log(f"weights: {r['stream_bytes'] / 1e9:.2f} GB streamed per step, built in {self.build_s:.1f} s")
        r["gemv"] = self.gemv_sweep()
        r["decode"] = []
        for ctx in decode_ctx:
            d = self.decode(ctx)
            d["fraction_of_copy_bw"] = d["GBps"] / bw
            d["fraction_of_read_bw"] = d["GBps"] / r["copy"]["read_GBps"]
            r["decode"].append(d)
            log(f"decode ctx={ctx}: {d['tokens_per_s']:.1f} t/s ({d['ms_per_token_device']:.3f} ms device, "
                f"{d['ms_per_token_host_loop']:.3f} ms host loop; by family {fmt_ms(d['breakdown_ms'])}), "
                f"{d['GBps']:.0f} GB/s = {d['fraction_of_copy_bw']:.1%} of copy, {d['fraction_of_read_bw']:.1%} of read")
            log(f"  kernels per decode step: {d['kernels_per_step']} ("
                + " ".join(f"{k} {v}" for k, v in d["kernels_by_family"].items()) + f"; gdn_fused={d['gdn_fused']})")
        r["verify"] = self.verify()
        r["gdn_fused_compare"] = self.gdn_fused_compare()
        w1 = r["verify"][0]["ms"]
        for v in r["verify"]:
            v["vs_w1"] = v["ms"] / w1
        r["mtp"] = self.mtp_step()
        r["mtp"]["vs_w1_round"] = r["mtp"]["ms"] / w1
        log(f"MTP draft step: {r['mtp']['ms']:.3f} ms = {r['mtp']['vs_w1_round']:.2f} x W=1 round")
        r["prefill"] = []
        for n in prefill_lens:
            p = self.prefill(n)
            p["fraction_of_bf16_peak"] = p["weight_TFLOPs"] / BF16_DENSE_PEAK_TFLOPS
            r["prefill"].append(p)
            log(f"prefill {n}: {p['tokens_per_s']:.0f} tok/s ({p['weight_TFLOPs']:.1f} TFLOP/s weights)")
        if prefill_detail:
            r["prefill_routes"] = self.prefill_gemm_routes()
            r["linear_ceiling"] = self.linear_ceiling(r["prefill_routes"], 8192)
            log(f"cuBLAS bf16 linear ceiling at 8K: {r['linear_ceiling']['cublas_linear_tok_s']:.0f} tok/s")
            r["prefill_breakdown"] = []
            for n in prefill_lens:
                if n < 8192:
                    continue
                b = self.prefill_breakdown(n)
                r["prefill_breakdown"].append(b)
                log(f"prefill {n} by family (s): " + " ".join(f"{k} {v:.3f}" for k, v in b["seconds"].items()) +
                    "; TFLOP/s " + " ".join(f"{k} {v:.0f}" for k, v in b["TFLOPs"].items()))
        r["memory_per_sequence"] = {str(c): self.model.memory_per_sequence(c) for c in mem_ctx}
        r["state_bytes_allocated"] = self.state.nbytes()
        r["bars"] = self.bars()
        return r

    def bars(self) -> dict:
        r = self.result
        d2k = next(d for d in r["decode"] if d["context"] == 2048)
        w = {v["width"]: v["ms"] for v in r["verify"]}
        p8 = next((p for p in r.get("prefill", []) if p["tokens"] == 8192), None)
        return {
            "decode_2k_fraction_of_roofline": d2k["fraction_of_read_bw"], "decode_bar": 0.70,
            "verify_w8_over_w1": w[8] / w[1], "verify_w8_bar": 1.08,
            "verify_w16_over_w1": w[16] / w[1] if 16 in w else None, "verify_w16_bar": 1.15,
            "mtp_over_w1": r["mtp"]["vs_w1_round"], "mtp_bar": 0.30,
            "prefill_8k_tok_s": p8["tokens_per_s"] if p8 else None, "prefill_bar": 12000,
            "prefill_8k_vs_cublas_linear": (p8["tokens_per_s"] / r["linear_ceiling"]["cublas_linear_tok_s"]
                                            if p8 and "linear_ceiling" in r else None),
        }
