"""CPU checks of decode_batch's lane kernels (no GPU needed).

The GPU tests (test_decode_batch.py) hold decode_batch bitwise to solo forwards on the device. These
hold, here, what that rests on: the lane table's layout as the kernels read it (common.cuh lane_ptr /
lane_positions), 64-bit layer offsets, that each lane wrapper passes its kernel's parameters and
launches it with the block and shared memory of the one-lane launch it stands for, and (nvcc) that
every *_lanes* entry compiles to the same floating-point instruction sequence as its one-sequence
entry -- the same math in the same order, so the same bits.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from q27py.gpu import constants as C
from q27py.gpu import forward as F
from q27py.gpu.runtime import CUDA_DIR, compile_options, source_text

sys.path.insert(0, str(Path(__file__).parent))
from nvcc_build import NVCC  # noqa: E402


# ---------------------------------------------------------------- the lane table
def test_lane_table_layout_matches_the_kernels_reading():
    rng = np.random.default_rng(0)
    n = 11
    addrs = rng.integers(1 << 40, 1 << 47, (n, C.LT_NFIELDS))
    pos = rng.integers(0, 1 << 20, n)
    ids = rng.integers(0, 248320, n)
    buf = F.pack_lane_table(addrs.tolist(), pos.tolist(), ids.tolist())
    assert buf.dtype == np.int64 and buf.size == F.lane_table_words()
    # common.cuh: lanes[b * LT_NFIELDS + field]; positions at (int*)(lanes + LANES_MAX * LT_NFIELDS)
    for b in range(n):
        for f in range(C.LT_NFIELDS):
            assert int(buf[b * C.LT_NFIELDS + f]) == int(addrs[b, f])
    words = buf.view(np.int32)
    positions = words[2 * C.LANES_MAX * C.LT_NFIELDS :][: C.LANES_MAX]
    np.testing.assert_array_equal(positions[:n], pos)
    # FastModel.lane_ids: the embed kernel's ids, LANES_MAX int32 after the positions
    at = F.lane_table_ids_offset()
    assert at == 2 * C.LANES_MAX * C.LT_NFIELDS + C.LANES_MAX
    np.testing.assert_array_equal(words[at : at + n], ids)
    assert (words[at + n : at + C.LANES_MAX] == 0).all() and (buf[n * C.LT_NFIELDS : C.LANES_MAX * C.LT_NFIELDS] == 0).all()
    assert at + C.LANES_MAX == 2 * buf.size  # nothing past the ids


def test_lane_table_refuses_bad_shapes():
    with pytest.raises(ValueError):
        F.pack_lane_table([[0] * C.LT_NFIELDS] * (C.LANES_MAX + 1), [0] * (C.LANES_MAX + 1), [0] * (C.LANES_MAX + 1))
    with pytest.raises(ValueError):
        F.pack_lane_table([[0] * C.LT_NFIELDS], [0, 1], [0, 1])
    with pytest.raises(ValueError):
        F.pack_lane_table([], [], [])


def test_layer_offsets_are_64_bit():
    """A 27B state at a long window: the last attention layer's K starts past 2^31 bytes, and the row
    the kernel addresses ((kvh * max_pos + pos) * hd + d elements past the layer base + offset) is the
    numpy element of the same [layer][kvh][pos][d] array."""
    layers, nkv, max_pos, hd, item = 16, 4, 262144, 256, 2
    shape = (layers, nkv, max_pos, hd)
    layer_stride = nkv * max_pos * hd * item  # FastState.k.strides[0] for bf16 rows
    strides = np.array([layer_stride, max_pos * hd * item, hd * item, item], dtype=np.int64)
    assert layer_stride * (layers - 1) > 2 ** 31
    for ai, kvh, p, d in [(15, 3, max_pos - 1, hd - 1), (9, 2, 123457, 17), (0, 0, 0, 0)]:
        kernel = ai * layer_stride + ((kvh * max_pos + p) * hd + d) * item  # python ints: no overflow
        assert kernel == int(np.dot(strides, np.array([ai, kvh, p, d], dtype=np.int64)))
        assert kernel < int(np.prod(shape)) * item


def test_partials_of_all_lanes_fit_and_never_overlap():
    """Lane b's partials sit at b * nq * nsplit slots (attn_*_lanes_*), where the lanes combine reads
    them; 16 lanes fit the model's buffer (attention_partials_floats at VERIFY_SPAN lanes)."""
    from q27py.gpu import kernels as K

    nq, hd = 24, 256
    for nsplit in (K.ATT_NSPLIT, 128):
        size = K.attention_partials_floats(F.VERIFY_SPAN, nq, hd, max(nsplit, K.ATT_NSPLIT))
        seen = np.zeros(size, dtype=np.int8)
        for b in range(C.LANES_MAX):
            for h in range(nq):
                for sp in range(nsplit):
                    writer = b * nq * nsplit * (hd + 2) + (h * nsplit + sp) * (hd + 2)  # body: part + lane offset
                    reader = ((b * nq + h) * nsplit + sp) * (hd + 2)  # combine_body(row = b)
                    assert writer == reader
            lo = b * nq * nsplit * (hd + 2)
            hi = lo + nq * nsplit * (hd + 2)
            assert hi <= size
            assert not seen[lo:hi].any()
            seen[lo:hi] = 1


class _FakeState:
    def __init__(self, position):
        self.position = position


def test_check_batch():
    mk = lambda *p: [_FakeState(x) for x in p]  # noqa: E731
    ids = F.check_batch(mk(0, 5, 9), [1, 2, 3], 16, 10, 100)
    assert ids.dtype == np.int64 and ids.tolist() == [1, 2, 3]
    s = _FakeState(1)
    for states, ids, why in [
        ([], [], "empty"),
        (mk(*range(17)), list(range(17)), "over max_batch"),
        (mk(1, 2), [1], "ids short"),
        (mk(1, 2), [1, 100], "id out of range"),
        (mk(1, 2), [-1, 3], "negative id"),
        ([s, s], [1, 2], "a state twice"),
        (mk(1, 10), [1, 2], "context overflow"),
    ]:
        with pytest.raises(ValueError):
            F.check_batch(states, ids, 16, 10, 100)
            pytest.fail(why)


# ---------------------------------------------------------------- wrappers vs kernels
class _Recorder:
    """Runtime.get() stand-in: records launches instead of running them."""

    def __init__(self):
        self.calls = []
        self.sm_count, self.smem_optin, self.cc = 132, 227 * 1024, (9, 0)

    def launch(self, module, kernel, grid, block, args, shared_mem=0):
        grid = tuple(grid) if isinstance(grid, tuple) else (grid,)
        self.calls.append(types.SimpleNamespace(module=module, kernel=kernel, grid=grid, block=block, args=args,
                                                smem=shared_mem))


def _params(module: str, kernel: str) -> int:
    """Parameter count of an extern "C" kernel (plain or macro-built) in cuda/<module>.cu."""
    src = re.sub(r"//[^\n]*", "", source_text(module))  # comments (they hold commas)
    m = re.search(r'__global__ void (?:__launch_bounds__\([^)]*\) )?' + re.escape(kernel) + r"\(", src)
    if m is None:  # a macro instantiation: NAME's macro's parameter list
        inst = re.search(r"(\w+)\(" + re.escape(kernel) + r"\b", src)
        assert inst, kernel
        body = src[src.index(f"#define {inst.group(1)}("):]
        m = re.search(r"NAME\(", body)
        start = m.end()
        text = body
    else:
        start = m.end()
        text = src
    depth, i = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    plist = text[start : i - 1].replace("\\", " ")
    return len([p for p in plist.split(",") if p.strip()])


@pytest.fixture
def rec(monkeypatch):
    from q27py.gpu import kernels as K

    r = _Recorder()
    monkeypatch.setattr(K.Runtime, "get", staticmethod(lambda: r))
    return r


def _cases():
    """(lanes wrapper call, one-sequence wrapper call) pairs at the 27B shapes, one lane."""
    from q27py.gpu import kernels as K

    nq, nkv, hd, rd, hk, hv, dk, dv, kw = 24, 4, 256, 64, 16, 48, 128, 128, 4
    x = object()
    span, max_pos = 16, 4096
    return [
        (lambda: K.qk_norm_rope_store_lanes(x, 1, x, 1, x, x, 1e-6, nq, nkv, hd, rd, x, x, 8, x, 1, True, max_pos, 1),
         lambda: K.qk_norm_rope_store(x, 1, x, 1, x, x, 1e-6, nq, nkv, hd, rd, x, x, x, 1, x, x, True, max_pos, 1)),
        (lambda: K.qk_norm_rope_store_fp8_lanes(x, 1, x, 1, x, x, 1e-6, nq, nkv, hd, rd, x, x, 8, 4, x, 1, max_pos, 1),
         lambda: K.qk_norm_rope_store_fp8(x, 1, x, 1, x, x, 1e-6, nq, nkv, hd, rd, x, x, x, 1, x, x, x, x, max_pos, 1)),
        (lambda: K.attention_lanes(x, 2, x, 8, 4, "bf16", max_pos, nq, nkv, hd, span, x, x, 2, x, 2, 1),
         lambda: K.attention(x, 2, x, x, True, max_pos, nq, nkv, hd, x, span, x, x, 2, x, 2, 1)),
        (lambda: K.attention_lanes(x, 2, x, 8, 4, "fp8", max_pos, nq, nkv, hd, span, x, x, 2, x, 2, 1),
         lambda: K.attention_fp8(x, 2, x, x, x, x, max_pos, nq, nkv, hd, x, span, x, x, 2, x, 2, 1)),
        (lambda: K.attention_mma_lanes(x, 2, x, 8, 4, False, max_pos, nq, nkv, hd, span, x, x, 2, x, 2, 1),
         lambda: K.attention_mma(x, 2, x, x, None, None, False, max_pos, nq, nkv, hd, x, span, x, x, 2, x, 2, 1)),
        (lambda: K.attention_mma_lanes(x, 2, x, 8, 4, True, max_pos, nq, nkv, hd, span, x, x, 2, x, 2, 1),
         lambda: K.attention_mma(x, 2, x, x, x, x, True, max_pos, nq, nkv, hd, x, span, x, x, 2, x, 2, 1)),
        (lambda: K.gdn_conv_lanes(x, 1, x, 8, x, x, 1, x, x, hk, hv, dk, dv, kw, x, x, 1),
         lambda: K.gdn_conv(x, 1, x, x, x, 1, x, x, hk, hv, dk, dv, kw, x, x, 1)),
        (lambda: K.gdn_conv_commit_lanes(x, 8, x, 1, 2 * hk * dk + hv * dv, kw, 1),
         lambda: K.gdn_conv_commit(x, 0, x, 1, 0, 2 * hk * dk + hv * dv, kw, 1, n=1)),
        (lambda: K.gdn_step_lanes(x, 8, x, x, x, 1, hk, hv, dk, dv, 1),
         lambda: K.gdn_step(x, 0, x, 0, x, 0, x, 1, hk, hv, dk, dv, 1, emit=True, write_state=True)),
        (lambda: K.gdn_decode_fused_lanes(x, 1, x, 8, 8, x, x, 1, x, x, hk, hv, dk, dv, kw, x, x, x, 1, x, 1e-6, x, 1,
                                          x, 1),
         lambda: K.gdn_decode_fused(x, 1, x, x, x, 1, x, x, hk, hv, dk, dv, kw, x, x, x, x, 1, x, 1e-6, x, 1, x, 1,
                                    True)),
    ]


@pytest.mark.parametrize("i", range(10))
def test_lane_wrappers_launch_as_the_one_lane_launch(rec, i):
    lanes_call, solo_call = _cases()[i]
    lanes_call()
    got = rec.calls[:]
    rec.calls.clear()
    solo_call()
    want = rec.calls[:]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.module == w.module
        assert g.kernel.replace("_lanes", "") == w.kernel, (g.kernel, w.kernel)
        assert len(g.args) == _params(g.module, g.kernel), g.kernel
        assert len(w.args) == _params(w.module, w.kernel), w.kernel
        # same block and shared memory; the grid adds the lane dimension where the one-lane launch
        # has none, or is the same (lanes in its lane dimension)
        assert g.block == w.block and g.smem == w.smem, g.kernel
        assert g.grid[: len(w.grid)] == w.grid or g.grid == w.grid, (g.kernel, g.grid, w.grid)


# ---------------------------------------------------------------- the same math (nvcc)
_ROOTS = {"add", "sub", "mul", "fma", "div", "rcp", "sqrt", "rsqrt", "ex2", "lg2", "sin", "cos", "max", "min", "neg",
          "abs", "cvt", "setp", "selp", "copysign", "tanh", "testp"}


def _entries(ptx: str) -> dict[str, str]:
    out = {}
    for m in re.finditer(r"\.entry (\w+)\(", ptx):
        i = ptx.index("{", ptx.index(")", m.start()))
        depth = 0
        for j in range(i, len(ptx)):
            depth += {"{": 1, "}": -1}.get(ptx[j], 0)
            if depth == 0:
                break
        out[m.group(1)] = ptx[m.start() : j + 1]
    return out


def _fp_ops(body: str) -> list[str]:
    """The floating-point arithmetic (and mma / shuffle) instructions of a PTX entry, in order:
    what decides its bits. Loads, stores, moves and integer address math are left out."""
    ops = []
    for line in body.splitlines():
        t = line.strip().split()
        if not t or t[0].startswith("//"):
            continue
        op = t[1] if t[0].startswith("@") and len(t) > 1 else t[0]
        root = op.split(".")[0]
        if root in ("mma", "shfl", "movmatrix") or (root in _ROOTS and re.search(r"\.(f16|bf16|f32|f64)", op)):
            ops.append(op)
    return ops


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("module", ["rope", "attention", "conv", "gdn", "gdn_decode"])
def test_lane_entries_compute_what_their_one_sequence_entries_do(tmp_path, module):
    src = tmp_path / f"{module}.cu"
    src.write_text(source_text(module), encoding="utf-8")
    out = tmp_path / f"{module}.ptx"
    r = subprocess.run([NVCC, *compile_options(), "-arch=sm_90", "-ptx", "-o", str(out), str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    ent = _entries(out.read_text())
    lanes = [k for k in ent if "_lanes" in k]
    assert lanes
    counted = 0
    for k in lanes:
        solo = k.replace("_lanes", "")
        assert solo in ent, k
        a, b = _fp_ops(ent[k]), _fp_ops(ent[solo])
        assert a == b, f"{k}: {len(a)} fp instructions vs {solo}'s {len(b)}"
        counted += len(a)
    assert counted, "no floating-point instruction found: the PTX filter is broken"  # (the window copy has none)


def test_every_lane_kernel_file_is_a_pdl_module():
    from q27py.gpu.runtime import PDL_MODULES

    for p in sorted(CUDA_DIR.glob("*.cu")):
        if "_lanes" in p.read_text():
            assert p.stem in PDL_MODULES, p.stem


# ---------------------------------------------------------------- the batched forward's launches
class _Plan:
    """GemvPlan stand-in: records run(nlanes, prequantized) in the recorder's launch list."""

    a8 = True
    kpad = 64
    xq = np.zeros((16, 64), np.uint8)
    xs = np.zeros((1, 16), np.float32)

    def __init__(self, rec, name):
        self.rec, self.name = rec, name

    def fuses_quant(self, nlanes):
        return nlanes <= C.GEMV_MAX_LANES

    def quantizes_for(self, nxt, nlanes):  # a layer's gate_up writes its down's activations (GemvPlan quant_into)
        return self.name.startswith("up") and nxt.name == "down" + self.name[2:] and nxt.fuses_quant(nlanes)

    def folds_norm(self, nlanes, skip_bf16=False, norm=None):  # the shell's norms are launches (NORM_FOLD: GPU tests)
        return False

    def folds_quant(self, nlanes, rows):  # QUANT_FOLD: GPU tests
        return False

    def walks_into(self, nxt, nlanes):  # MLP_WALK: GPU tests (tests/gpu/test_mlp_walk.py)
        return False

    def take_norm_done(self):  # NORM_TAIL: GPU tests (tests/gpu/test_norm_tail.py)
        return None

    def run(self, x, ldx, nlanes, lane0=0, allow_gemm=True, prequantized=False, x_bf16=None, y_bf16=None,
            skip_bf16=False, norm=None):
        assert x_bf16 is None and y_bf16 is None, "bf16 rows are for prefill chunks only"
        assert norm is None, "folds_norm said no"
        assert not skip_bf16, "the shell's GDN gates stay on the in plan (gates_in_conv off)"
        self.rec.calls.append(types.SimpleNamespace(module="plan", kernel=self.name, grid=(nlanes, lane0),
                                                    block=prequantized, args=(), smem=0))


def _fake_model(rec, kv: str, mma: bool, fused: bool):
    """A FastModel shell at the 27B head shapes (2 GDN layers + 1 attention layer) whose buffers are
    host arrays: enough for enqueue_main / enqueue_batch to issue their launches into the recorder."""
    from q27py.model.config import FULL, LINEAR, qwen36_27b_config

    cfg = __import__("dataclasses").replace(qwen36_27b_config(), num_hidden_layers=3, hidden_size=128,
                                            intermediate_size=128, layer_types=(LINEAR, FULL, LINEAR), vocab_size=512)
    m = F.FastModel.__new__(F.FastModel)
    m.cfg, z = cfg, (lambda *s: np.zeros(s, np.float32))  # noqa: E731
    x = np.zeros(1, np.float32)
    layers, plans, gi = [], [], 0
    for li, kind in enumerate(cfg.layer_types):
        lw = types.SimpleNamespace(kind=kind, input_ln=x, post_ln=x, attn=types.SimpleNamespace(q_norm=x, k_norm=x),
                                   gdn=types.SimpleNamespace(conv_w=x, neg_a=x, dt_bias=x, norm_w=x))
        layers.append(lw)
        p = {k: _Plan(rec, f"{k}{li}") for k in ("in", "out", "up", "down")}
        if kind != FULL:
            p["gi"] = gi
            gi += 1
        plans.append(p)
    m.w = types.SimpleNamespace(layers=layers, final_norm=x,
                                embed=types.SimpleNamespace(data=x, fmt=0, ld=1, scales=None, groups=1, group=128))
    m.layer_plans, m.lm_plan = plans, _Plan(rec, "lm")
    c, hv, dv = cfg.gdn_conv_dim, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    m.hp = m.ld_qg = m.ld_xa = m.ld_xo = m.ld_act = 64
    m.ld_proj = c + hv * dv
    for name in ("h", "x", "hidden", "qg", "kvp", "qbuf", "xa", "ab", "o_gdn", "xo", "act", "cat"):
        setattr(m, name, z(16, 64))
    m.proj, m.qkvn, m.gb = z(2, 16, m.ld_proj), z(2, 16, c), z(2, 16, 2 * hv)
    m.xb = m.xob = m.actb = None  # prefill chunks' bf16 rows (none at these widths)
    m.logits, m.top2_part, m.tok, m.top1, m.margin, m.part, m.inv_freq = z(16, 8), x, x, x, x, x, x
    m.ids, m.gdn_tickets, m.gdn_tickets_lanes, m.lane_table, m.lane_ids = x, x, x, x, x
    m.kv_bits, m.kv_name, m.kv_bf16, m.max_pos, m.chunk, m.logit_rows = None, kv, kv == "bf16", 4096, 64, 16
    m.vocab = cfg.vocab_size
    m.attn_mma, m.prefill_attention, m.gdn_fused, m.gdn_fused_warps = mma, True, fused, C.GDN_FD_WARPS
    m.gates_in_conv = False
    m._norm_folded = None
    ctl = types.SimpleNamespace(data=types.SimpleNamespace(ptr=4096))
    fp8 = kv == "fp8"
    side = (z(1, 4, 8), z(1, 4, 8)) if fp8 else ()
    state = types.SimpleNamespace(k=z(1, 4, 8, 8), v=z(1, 4, 8, 8), gdn=z(2, 1), window=z(2, 1), ctl=ctl, position=100,
                                  side_rows=lambda ai: tuple(a[0] for a in side) if ai is not None else ())
    return m, state


@pytest.mark.parametrize("kv,mma,fused", [("bf16", True, False), ("bf16", False, False), ("f32", False, False),
                                          ("fp8", False, False), ("fp8", True, False), ("bf16", True, True)])
def test_batched_forward_launches_the_one_token_decode(rec, kv, mma, fused):
    """enqueue_batch(1) issues enqueue_main(t = 1)'s launches in order, each state kernel as its
    *_lanes twin with the same block and shared memory (and every GEMV plan with the same lanes and
    prequantization); at n lanes every launch's lane dimension is n."""
    m, st = _fake_model(rec, kv, mma, fused)
    m.enqueue_main(st, 1, False, np.array([0]))
    solo = rec.calls[:]
    rec.calls.clear()
    m.enqueue_batch(1, (4096, 64, 512, 256))
    lanes = rec.calls[:]
    assert len(lanes) == len(solo) > 20
    strip = lambda g: tuple(g[: max(i for i, v in enumerate(g) if v != 1) + 1]) if any(v != 1 for v in g) else (1,)  # noqa: E731
    for a, b in zip(lanes, solo):
        assert a.kernel.replace("_lanes", "") == b.kernel and a.module == b.module, (a.kernel, b.kernel)
        assert a.block == b.block and a.smem == b.smem, a.kernel
        assert strip(a.grid) == strip(b.grid), (a.kernel, a.grid, b.grid)
        if a.module != "plan":
            assert len(a.args) == _params(a.module, a.kernel), a.kernel
    renamed = {a.kernel for a in lanes if "_lanes" in a.kernel}
    want = {"gdn_decode_lanes_k4"} if fused else {"gdn_conv_lanes", "gdn_step_lanes_k4"}
    if not fused and not C.CONV_COMMIT_FOLD:  # the fold (default since 2026-12-07): the conv slides the window itself
        want.add("gdn_conv_commit_lanes")
    want |= {"qk_norm_rope_store_fp8_lanes" if kv == "fp8" else "qk_norm_rope_store_lanes"}
    want |= ({f"attn_mma_lanes_{'fp8' if kv == 'fp8' else 'bf16'}_d256", "attn_mma_combine_lanes"} if mma
             else {f"attn_split_lanes_{kv}_d8", "attn_combine_lanes"})
    assert renamed == want
    rec.calls.clear()
    m.enqueue_batch(5, (4096, 64, 512, 256))
    for a in rec.calls:
        lane_dim = {"attention": 2 if "mma_lanes" in a.kernel or "split_lanes" in a.kernel else 0,
                    "gdn": 1, "conv": 1 if "commit" in a.kernel else 0, "gdn_decode": 2}.get(a.module, 0)
        if a.module == "sampling" and a.kernel == "top2_final":
            lane_dim = 0
        assert a.grid[lane_dim] == 5, (a.kernel, a.grid)


class _FoldPlan(_Plan):
    """_Plan whose GEMVs fold the norms in front of them (constants NORM_FOLD / GATED_FOLD): run records what it was
    handed to compute itself."""

    def folds_norm(self, nlanes, skip_bf16=False, norm=None):
        return True

    def folds_gated(self, nlanes, gated):
        return True

    def folds_quant(self, nlanes, rows):
        return True

    def run(self, x, ldx, nlanes, lane0=0, allow_gemm=True, prequantized=False, x_bf16=None, y_bf16=None,
            skip_bf16=False, norm=None, gated=None):
        self.rec.calls.append(types.SimpleNamespace(module="plan", kernel=self.name, grid=(nlanes, lane0),
                                                    block=prequantized, args=(norm, gated), smem=0))


@pytest.mark.parametrize("fused", [False, True])
def test_folded_norms_leave_no_norm_launch(rec, fused):
    """With every plan folding (the GPU tests check the folds' bits): a decode step and a decode_batch round launch no
    layer norm and no GDN output norm; each layer's in / up plan gets its own norm's weights over the residual rows
    h into x, each GDN layer's out plan (chain only: the fused step writes its own) the gated norm of o_gdn; nothing
    is left pending."""
    from q27py.model.config import FULL

    m, st = _fake_model(rec, "bf16", True, fused)
    hv, dv = m.cfg.linear_num_value_heads, m.cfg.linear_value_head_dim
    for li, (lw, p) in enumerate(zip(m.w.layers, m.layer_plans)):
        lw.input_ln, lw.post_ln = np.full(1, 2 * li, np.float32), np.full(1, 2 * li + 1, np.float32)
        for k in ("in", "out", "up", "down"):
            p[k] = _FoldPlan(rec, f"{k}{li}")
            p[k].kpad = hv * dv if k == "out" else 64
    for run in (lambda: m.enqueue_main(st, 1, False, np.array([0])), lambda: m.enqueue_batch(2, (4096, 64, 512, 256))):
        rec.calls.clear()
        run()
        kernels = [c.kernel for c in rec.calls if c.module == "norm"]
        assert kernels == ["rmsnorm_rows"], kernels  # the final norm only (before the lm_head)
        plans = {c.kernel: c.args for c in rec.calls if c.module == "plan"}
        for li, lw in enumerate(m.w.layers):
            for k, w in (("in", lw.input_ln), ("up", lw.post_ln)):
                norm, gated = plans[f"{k}{li}"]
                assert norm is not None and norm.w is w and norm.h is m.h and norm.y is m.x and gated is None
            norm, gated = plans[f"out{li}"]
            assert norm is None
            assert (gated is not None and gated.o is m.o_gdn and gated.dv == dv) == (lw.kind != FULL and not fused)
        assert m._norm_folded is None


@pytest.mark.parametrize("epilogue", [False, True])
def test_down_folds_its_quant_unless_gate_up_quantized(rec, epilogue):
    """QUANT_FOLD (the GPU tests check the bits): where gate_up's epilogue does not write down's activations, a
    decode step and a decode_batch round hand each layer's down plan its SwiGLU rows to quantize itself (no norm
    weights: rows as they are, m.act at ld_act, the whole padded row); where the epilogue does (A8_FOLD bit 4),
    down runs prequantized and folds nothing."""
    m, st = _fake_model(rec, "bf16", True, False)
    for li, p in enumerate(m.layer_plans):
        for k in ("in", "out", "up", "down"):
            p[k] = _FoldPlan(rec, f"{k}{li}")
            p[k].kpad = 64 * (li + 2)  # per plan, so the row length is down's own
            if not epilogue:
                p[k].quantizes_for = lambda nxt, nlanes: False
    for run in (lambda: m.enqueue_main(st, 1, False, np.array([0])), lambda: m.enqueue_batch(2, (4096, 64, 512, 256))):
        rec.calls.clear()
        run()
        downs = {c.kernel: c for c in rec.calls if c.module == "plan" and c.kernel.startswith("down")}
        assert len(downs) == len(m.layer_plans)
        for li in range(len(m.layer_plans)):
            c = downs[f"down{li}"]
            rows, gated = c.args
            assert gated is None and c.block == epilogue  # prequantized exactly when gate_up wrote them
            if epilogue:
                assert rows is None
            else:
                assert rows is not None and rows.w is None and rows.h is m.act and rows.ldh == m.ld_act
                assert rows.hidden == 64 * (li + 2)
