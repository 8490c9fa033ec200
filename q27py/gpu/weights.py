"""Model weights on the GPU: tier recipes, quantize-on-load from a Hugging Face checkpoint
(tensor by tensor, never the whole bf16 model in memory), and seeded random weights made on
the device for benchmarks.

Fused matrices (docs/QUANT.md): GDN `qkvz` = [in_proj_qkv; in_proj_z], GDN `ab` =
[in_proj_b; in_proj_a] (always bf16: the decay/beta gates are tiny and sensitive),
attention `q` = q_proj, `kv` = [k_proj; v_proj], MLP `gate_up` = gate/up rows interleaved
per 8 (the GEMV's SwiGLU epilogue), then o_proj / out_proj / down_proj alone.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np

from q27py.gpu import kernels as K
from q27py.gpu import layout as L
from q27py.gpu.runtime import Runtime
from q27py.io.q27file import TIERS, Q27File, role_format
from q27py.model.config import FULL, ModelConfig

def table_format(tier: str) -> int:
    return {"bf16": K.TAB_BF16, "q8": K.TAB_Q8}[TIERS[tier]["embed"]]


def fmt_code(name: str) -> int:
    return L.FMT_NAMES[name]


@dataclass
class AttnW:
    q: K.GpuMatrix
    kv: K.GpuMatrix
    o: K.GpuMatrix
    q_norm: object
    k_norm: object


@dataclass
class GdnW:
    qkvz: K.GpuMatrix
    ab: K.GpuMatrix
    out: K.GpuMatrix
    conv_w: object  # [C, K] fp32
    neg_a: object  # [HV] fp32: -exp(A_log)
    dt_bias: object
    norm_w: object  # [dv]


@dataclass
class LayerW:
    kind: str  # FULL or linear
    input_ln: object
    post_ln: object
    gate_up: K.GpuMatrix
    down: K.GpuMatrix
    attn: AttnW | None = None
    gdn: GdnW | None = None

    def matrices(self) -> list[K.GpuMatrix]:
        mats = [self.gate_up, self.down]
        if self.attn is not None:
            mats += [self.attn.q, self.attn.kv, self.attn.o]
        if self.gdn is not None:
            mats += [self.gdn.qkvz, self.gdn.ab, self.gdn.out]
        return mats


@dataclass
class MtpW:
    fc: K.GpuMatrix
    pre_e: object
    pre_h: object
    norm: object
    layer: LayerW


@dataclass
class ModelWeights:
    cfg: ModelConfig
    tier: str
    embed: K.GpuTable
    final_norm: object
    lm_head: K.GpuMatrix
    layers: list[LayerW]
    mtp: MtpW | None = None
    info: dict = field(default_factory=dict)

    def matrices(self) -> list[K.GpuMatrix]:
        """Every matrix a prefill chunk multiplies (the layers', the MTP head's fc and layer; not the
        lm_head, which prefill runs as a GEMV over the rows it wants): the expansion cache's set."""
        mats = [m for lw in self.layers for m in lw.matrices()]
        if self.mtp is not None:
            mats += [self.mtp.fc] + self.mtp.layer.matrices()
        return mats

    def stream_bytes(self) -> int:
        """Weight bytes one full forward streams (every layer matrix + lm_head; no embedding table)."""
        return sum(m.nbytes for lw in self.layers for m in lw.matrices()) + self.lm_head.nbytes

    def mtp_step_bytes(self) -> int:
        if self.mtp is None:
            return 0
        return self.mtp.fc.nbytes + sum(m.nbytes for m in self.mtp.layer.matrices()) + self.lm_head.nbytes

    def total_bytes(self) -> int:
        n = self.stream_bytes() + self.embed.nbytes
        if self.mtp is not None:
            n += self.mtp.fc.nbytes + sum(m.nbytes for m in self.mtp.layer.matrices())
        return n


class _Progress:
    """A one-line progress bar on stderr for long loads (silent when not a terminal or disabled)."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label, self.done = max(total, 1), label, 0
        self.enabled = enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def step(self, n: int = 1) -> None:
        self.done += n
        if self.enabled:
            frac = self.done / self.total
            bar = "#" * int(30 * frac)
            sys.stderr.write(f"\r{self.label} [{bar:<30}] {100 * frac:5.1f}% {time.perf_counter() - self.t0:6.1f}s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


# ---------------------------------------------------------------- from a checkpoint
class _Loader:
    def __init__(self, ckpt, tier: str, progress: _Progress):
        self.ckpt, self.tier, self.progress = ckpt, tier, progress
        self.cp = Runtime.get().cp

    def vec(self, name: str):
        self.progress.step()
        return self.cp.asarray(self.ckpt.get(name, np.float32).reshape(-1))

    def _rows_on_device(self, names: list[str], interleave: bool = False):
        """Concatenate the named [rows, K] tensors on the host in their stored dtype, upload once."""
        bf16 = all(self.ckpt.stored_dtype(n) == "BF16" for n in names)
        parts = [self.ckpt.raw(n) if bf16 else self.ckpt.get(n, np.float32) for n in names]
        parts = [p.reshape(p.shape[0], -1) for p in parts]
        host = L.interleave_gate_up(*parts) if interleave else (parts[0] if len(parts) == 1 else np.concatenate(parts))
        self.progress.step(len(names))
        return self.cp.asarray(np.ascontiguousarray(host)), bf16, host.shape

    def matrix(self, names: list[str], role: str, in_mtp: bool = False, mode: int = K.MODE_STORE,
               interleave: bool = False, out_rows: int | None = None) -> K.GpuMatrix:
        src, bf16, (rows, cols) = self._rows_on_device(names, interleave)
        fmt = fmt_code(role_format(self.tier, role, in_mtp))
        m = K.pack_on_gpu(src, rows, cols, fmt, src_bf16=bf16, mode=mode, out_rows=out_rows)
        del src
        return m

    def table(self, name: str) -> K.GpuTable:
        bf16 = self.ckpt.stored_dtype(name) == "BF16"
        host = self.ckpt.raw(name) if bf16 else self.ckpt.get(name, np.float32)
        src = self.cp.asarray(np.ascontiguousarray(host))
        self.progress.step()
        return K.table_on_gpu(src, host.shape[0], host.shape[1], table_format(self.tier), src_bf16=bf16)


def _layer_from_ckpt(ld: _Loader, cfg: ModelConfig, p: str, kind: str, in_mtp: bool) -> LayerW:
    inter = cfg.intermediate_size
    gate_up = ld.matrix([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], "mlp_gate_up", in_mtp,
                        mode=K.MODE_SWIGLU, interleave=True, out_rows=inter)
    down = ld.matrix([p + "mlp.down_proj.weight"], "mlp_down", in_mtp, mode=K.MODE_ADD)
    lw = LayerW(kind, ld.vec(p + "input_layernorm.weight"), ld.vec(p + "post_attention_layernorm.weight"), gate_up, down)
    if kind == FULL:
        a = p + "self_attn."
        lw.attn = AttnW(
            q=ld.matrix([a + "q_proj.weight"], "attn_q", in_mtp),
            kv=ld.matrix([a + "k_proj.weight", a + "v_proj.weight"], "attn_kv", in_mtp),
            o=ld.matrix([a + "o_proj.weight"], "attn_o", in_mtp, mode=K.MODE_ADD),
            q_norm=ld.vec(a + "q_norm.weight"),
            k_norm=ld.vec(a + "k_norm.weight"),
        )
    else:
        a = p + "linear_attn."
        cp = ld.cp
        a_log = ld.ckpt.get(a + "A_log", np.float64).reshape(-1)
        lw.gdn = GdnW(
            qkvz=ld.matrix([a + "in_proj_qkv.weight", a + "in_proj_z.weight"], "gdn_qkvz", in_mtp),
            ab=ld.matrix([a + "in_proj_b.weight", a + "in_proj_a.weight"], "gdn_ab", in_mtp),
            out=ld.matrix([a + "out_proj.weight"], "gdn_out", in_mtp, mode=K.MODE_ADD),
            conv_w=cp.asarray(ld.ckpt.get(a + "conv1d.weight", np.float32).reshape(cfg.gdn_conv_dim, -1)),
            neg_a=cp.asarray((-np.exp(a_log)).astype(np.float32)),
            dt_bias=ld.vec(a + "dt_bias"),
            norm_w=ld.vec(a + "norm.weight"),
        )
        ld.progress.step(2)
    return lw


def from_checkpoint(ckpt, tier: str = "bf16", progress: bool = True) -> ModelWeights:
    """Quantize/pack a Hugging Face checkpoint on the GPU, one (fused) tensor at a time."""
    if tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r}; known: {sorted(TIERS)}")
    cfg = ckpt.config
    bar = _Progress(len(ckpt.names()), f"loading {tier}", progress)
    ld = _Loader(ckpt, tier, bar)
    embed = ld.table("embed_tokens.weight")
    lm_names = ["embed_tokens.weight"] if cfg.tie_word_embeddings else ["lm_head.weight"]
    lm_head = ld.matrix(lm_names, "lm_head")
    layers = [_layer_from_ckpt(ld, cfg, f"layers.{i}.", kind, False) for i, kind in enumerate(cfg.layer_types)]
    mtp = None
    if ckpt.has_mtp:
        mtp = MtpW(
            fc=ld.matrix(["mtp.fc.weight"], "mtp_fc", True),
            pre_e=ld.vec("mtp.pre_fc_norm_embedding.weight"),
            pre_h=ld.vec("mtp.pre_fc_norm_hidden.weight"),
            norm=ld.vec("mtp.norm.weight"),
            layer=_layer_from_ckpt(ld, cfg, "mtp.layers.0.", FULL, True),
        )
    bar.close()
    Runtime.get().cp.cuda.get_current_stream().synchronize()
    return ModelWeights(cfg, tier, embed, ld.vec("norm.weight"), lm_head, layers, mtp, {"source": str(ckpt.model_dir)})


# ---------------------------------------------------------------- seeded random (benchmarks)
def random_weights(cfg: ModelConfig, tier: str = "q4s", seed: int = 0, with_mtp: bool = True) -> ModelWeights:
    """Full-size random weights made on the device: codes uniform, scales sized so each matrix
    keeps activations O(1) (values are meaningless; the bytes and shapes are the model's)."""
    rt = Runtime.get()
    cp = rt.cp
    counter = [seed * 1000003]

    def nxt() -> int:
        counter[0] += 7919
        return counter[0]

    def mat(rows, cols, role, in_mtp=False, mode=K.MODE_STORE, out_rows=None):
        fmt = fmt_code(role_format(tier, role, in_mtp))
        # weight std ~ 1/sqrt(cols) so activations stay O(1) layer after layer
        target = 1.0 / np.sqrt(cols)
        scale = {L.FMT_Q4: target / 4.6, L.FMT_Q8: target / 74.0, L.FMT_BF16: target * 1.7}[fmt]
        return K.random_matrix(rows, cols, fmt, nxt(), scale, mode, out_rows)

    def vec(n, lo, hi):
        a = cp.empty(n, dtype=cp.float32)
        K.fill_uniform(a, nxt(), lo, hi)
        return a

    h, inter = cfg.hidden_size, cfg.intermediate_size

    def layer(kind, in_mtp):
        lw = LayerW(kind, vec(h, -0.1, 0.1), vec(h, -0.1, 0.1),
                    mat(2 * L.round_up(inter, 8), h, "mlp_gate_up", in_mtp, K.MODE_SWIGLU, inter),
                    mat(h, inter, "mlp_down", in_mtp, K.MODE_ADD))
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if kind == FULL:
            lw.attn = AttnW(mat(2 * nq * hd, h, "attn_q", in_mtp), mat(2 * nkv * hd, h, "attn_kv", in_mtp),
                            mat(h, nq * hd, "attn_o", in_mtp, K.MODE_ADD), vec(hd, -0.1, 0.1), vec(hd, -0.1, 0.1))
        else:
            hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
            c = cfg.gdn_conv_dim
            lw.gdn = GdnW(mat(c + hv * dv, h, "gdn_qkvz", in_mtp), mat(2 * hv, h, "gdn_ab", in_mtp),
                          mat(h, hv * dv, "gdn_out", in_mtp, K.MODE_ADD), vec(c * cfg.linear_conv_kernel_dim, -0.5, 0.5),
                          vec(hv, -1.0, -0.05), vec(hv, -1.0, 1.0), vec(dv, 0.8, 1.2))
        return lw

    embed_fmt = table_format(tier)
    v = cfg.vocab_size
    if embed_fmt == K.TAB_Q8:
        codes = cp.empty(v * h, dtype=cp.int8)
        rt.launch("quant", "fill_random_u32", min(-(-(codes.size // 4) // 256), 65535), 256,
                  (codes, np.int64(codes.size // 4), np.uint64(nxt())))
        groups = -(-h // 128)
        sc = cp.empty(v * groups, dtype=cp.uint16)
        rt.launch("quant", "fill_random_scales", min(-(-(sc.size // 2) // 256), 65535), 256,
                  (sc, np.int64(sc.size // 2), np.uint64(nxt()), np.float32(0.005), np.float32(0.015)))
        embed = K.GpuTable(K.TAB_Q8, codes, h, sc, 128, groups)
    else:
        data = cp.empty(v * h, dtype=cp.uint16)
        rt.launch("quant", "fill_random_bf16", min(-(-data.size // 256), 65535), 256,
                  (data, np.int64(data.size), np.uint64(nxt()), np.float32(-1.0), np.float32(1.0)))
        embed = K.GpuTable(K.TAB_BF16, data, h)
    layers = [layer(kind, False) for kind in cfg.layer_types]
    lm_head = mat(v, h, "lm_head")
    mtp = None
    if with_mtp and cfg.mtp_num_hidden_layers:
        mtp = MtpW(mat(h, 2 * h, "mtp_fc", True), vec(h, -0.1, 0.1), vec(h, -0.1, 0.1), vec(h, -0.1, 0.1),
                   layer(FULL, True))
    cp.cuda.get_current_stream().synchronize()
    return ModelWeights(cfg, tier, embed, vec(h, -0.1, 0.1), lm_head, layers, mtp, {"source": f"random seed {seed}"})


# ---------------------------------------------------------------- from a .q27 file
def from_q27file(path, progress: bool = True) -> ModelWeights:
    """Load a repacked file: one host-to-device copy per blob, nothing re-quantized."""
    qf = Q27File(path)
    cp = Runtime.get().cp
    cfg = qf.config
    bar = _Progress(len(qf.names()), f"loading {qf.path.name}", progress)

    def vec(name):
        bar.step()
        e = qf.entry(name)
        return cp.asarray(qf.blobs(name)[0].view(np.float32).reshape(e["meta"]["shape"]))

    def mat(name):
        bar.step()
        meta = qf.entry(name)["meta"]
        blobs = qf.blobs(name)
        shape = L.matrix_shape(meta["rows"], meta["cols"], meta["fmt"], meta["group"])
        scales = cp.asarray(blobs[1].view(np.uint32)) if meta["fmt"] != L.FMT_BF16 else None
        return K.GpuMatrix(shape, cp.asarray(blobs[0]), scales, meta["mode"], meta["out_rows"])

    def layer(p, kind):
        lw = LayerW(kind, vec(p + "input_ln"), vec(p + "post_ln"), mat(p + "mlp.gate_up"), mat(p + "mlp.down"))
        if kind == FULL:
            lw.attn = AttnW(mat(p + "attn.q"), mat(p + "attn.kv"), mat(p + "attn.o"), vec(p + "attn.q_norm"),
                            vec(p + "attn.k_norm"))
        else:
            lw.gdn = GdnW(mat(p + "gdn.qkvz"), mat(p + "gdn.ab"), mat(p + "gdn.out"), vec(p + "gdn.conv_w"),
                          vec(p + "gdn.neg_a"), vec(p + "gdn.dt_bias"), vec(p + "gdn.norm_w"))
        return lw

    meta = qf.entry("embed")["meta"]
    blobs = qf.blobs("embed")
    if meta["fmt"] == "bf16":
        embed = K.GpuTable(K.TAB_BF16, cp.asarray(blobs[0].view(np.uint16)), meta["cols"])
    else:
        embed = K.GpuTable(K.TAB_Q8, cp.asarray(blobs[0].view(np.int8)), meta["cols"], cp.asarray(blobs[1].view(np.uint16)),
                           meta["group"], meta["groups"])
    bar.step()
    layers = [layer(f"layers.{i}.", kind) for i, kind in enumerate(cfg.layer_types)]
    mtp = None
    if qf.has_mtp:
        mtp = MtpW(mat("mtp.fc"), vec("mtp.pre_e"), vec("mtp.pre_h"), vec("mtp.norm"), layer("mtp.layer.", FULL))
    weights = ModelWeights(cfg, qf.tier, embed, vec("final_norm"), mat("lm_head"), layers, mtp, {"source": str(qf.path)})
    bar.close()
    cp.cuda.get_current_stream().synchronize()
    return weights
