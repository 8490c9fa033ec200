"""Programmatic dependent launch (EngineConfig.pdl, cuda/common.cuh pdl_entry, runtime.PdlLauncher).

A kernel launched with the attribute may start while its predecessor still runs, so every kernel
of runtime.PDL_MODULES must wait (griddepcontrol.wait) before it reads anything a predecessor
wrote: the source checks below hold that on the CPU. The GPU test holds the bits: captured steps
launched with PDL give exactly the eager run's logits (decode, verify + commit, MTP).
"""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.gpu import runtime as R


def _kernels(src: str):
    """(name, body) of every __global__ kernel in a source (macro kernels: the macro's NAME)."""
    for m in re.finditer(r"__global__", src):
        k = m.end()
        while True:
            mm = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*\(").search(src, k)
            if mm.group(1) != "__launch_bounds__":
                break
            k = src.index(")", mm.end()) + 1
        q, depth = mm.end() - 1, 0
        while True:
            depth += {"(": 1, ")": -1}.get(src[q], 0)
            if depth == 0:
                break
            q += 1
        b = src.index("{", q)
        yield mm.group(1), src[b + 1 : b + 400]


def test_every_pdl_kernel_waits_first():
    """The first statement of every PDL-launched kernel is pdl_entry(), except the GEMVs, whose
    body waits inside gemv_loop (after the weight prefetch, before the first activation load)."""
    seen = 0
    for mod in sorted(R.PDL_MODULES):
        src = (R.CUDA_DIR / f"{mod}.cu").read_text()
        for name, body in _kernels(src):
            first = body.lstrip().lstrip("\\").lstrip()
            ok = first.startswith("pdl_entry();") or (mod == "gemv" and first.startswith("gemv_body<")) or (
                mod == "gemv_wg" and first.startswith(("GWG_CALL(", "GWG_CALL_G(", "GWG_CALL_NF(", "GWG_CALL_GF(",
                                                       "GWG_CALL_WALK(", "GWG_CALL_NT("))) or (
                mod == "gemv_dp" and first.startswith(("dp_body<", "dpa_body<")))  # wg_body / gemv_body_w4 / dp*_body wait inside
            if not ok and "pdl_entry();" in first:
                # constants loaded before the wait (norm.cu: the norm weights; conv.cu: the GDN gates' weights):
                # every statement before pdl_entry() is a register array (or GatesPre) declaration or a
                # *_preload( call, nothing that could read the previous kernel's output
                pre = [p.strip() for p in first[: first.index("pdl_entry();")].split(";") if p.strip()]
                ok = bool(pre) and all("_preload(" in p or re.fullmatch(r"float \w+\[\w+\]|GatesPre \w+", p)
                                       for p in pre)
            assert ok, f"{mod}.cu {name}: first statement is not pdl_entry(): {first[:60]!r}"
            seen += 1
    assert seen >= 25
    gemv = R.source_text("gemv")  # gemv.cu with its headers (gemv_loop lives in gemv_v1.cuh)
    loop = gemv[gemv.index("void gemv_loop("):]
    loop = loop[: loop.index("\n}\n")]
    wait, prologue_end = loop.index("pdl_wait();"), loop.index("cp_async_commit();")
    first_act = min(loop.index("a8_load_act"), loop.index("a8_issue_act"))
    assert prologue_end < wait < first_act, "gemv_loop: prefetch weights, then wait, then read activations"
    assert loop.index("pdl_trigger();") > wait
    # gemv_wg.cu: the same order in wg_body (its weights only before the wait, then its activations)
    wg = (R.CUDA_DIR / "gemv_wg.cu").read_text()
    body = wg[wg.index("void wg_body("):]
    body = body[: body.index("\n}\n")]
    wait = body.index("pdl_wait();")
    assert body.index("issue(k, k, true, false);") < wait < body.index("issue(k, k, false, true);")
    assert body.index("pdl_trigger();") > wait
    # the MLP walk's entries claim their unit (an atomic on the plan's own ticket, which no predecessor writes: the
    # previous walk of the plan is a step back) before wg_body, and nothing else before its wait
    walk = wg[wg.index("#define GWG_CALL_WALK(NL, TWO, STAGES)"):]
    walk = walk[: walk.index("wg_body<")]
    assert re.sub(r"\s+", " ", walk.split("\\\n", 1)[1].replace("\\", "")).strip() == (
        "__shared__ int s_claim; if (threadIdx.x == 0) s_claim = atomicAdd(ctl, 1); __syncthreads(); "
        "const int u = s_claim, up = u < units;")
    # gemv_dp.cu: its weight rings and their scales before the wait, the activations (xq, xs) only after it
    dp = (R.CUDA_DIR / "gemv_dp.cu").read_text()
    for fn, ring in (("dp_body", "wr[i] = ld_stream16("), ("dpa_body", "kk < S - 1; kk++) issue(kk);")):
        dpb = dp[dp.index(f"void {fn}("):]
        dpb = dpb[: dpb.index("\n}\n")]
        dwait = dpb.index("pdl_wait();")
        assert dpb.index(ring) < dwait < dpb.index("dp_stage_acts<NL>(") and "xq" not in dpb[dpb.index("{"):dwait], fn
        assert "xs[" not in dpb[:dwait] and dpb.index("pdl_trigger();") > dwait, fn
    # the merged entries (GEMV_MERGE) run nothing of their own: one of the two bodies above, whole
    call = wg[wg.index("#define GWG_CALL_G(NL, TWO, SUB, STAGES, CPS)"):]
    call = call[: call.index("#else")]
    assert "gemv_body_w4<" in call and "wg_body<" in call and call.count(";") == 2
    # the norm-fold entries (NORM_FOLD): their arguments packed (no load), then wg_body, which replays the norm from
    # the residual rows only after its wait (the previous kernel wrote them)
    call = wg[wg.index("#define GWG_CALL_NF(NL, STAGES)"):]
    call = call[: call.index("#else")]
    assert "const NormFold nf{" in call and "wg_body<" in call and call.count(";") == 2
    call = wg[wg.index("#define GWG_CALL_GF(NL, STAGES)"):]
    call = call[: call.index("#else")]
    assert "const GatedFold gf{" in call and "wg_body<" in call and call.count(";") == 2
    assert body.index("wg_norm_fold(") > wait and body.index("wg_gated_fold(") > wait


def test_pdl_entry_is_arch_guarded():
    h = (R.CUDA_DIR / "common.cuh").read_text()
    for fn in ("pdl_wait", "pdl_trigger"):
        body = h[h.index(f"void {fn}()"):][:200]
        assert "__CUDA_ARCH__ >= 900" in body, f"{fn} must be a no-op below sm_90"


def test_launch_structs_match_cuda_h():
    """CUlaunchAttribute is 72 bytes (id, pad, 64-byte union); CUlaunchConfig 56 with the stream at 32."""
    assert ctypes.sizeof(R._LaunchAttribute) == 72
    assert R._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(R._LaunchConfig) == 56
    assert R._LaunchConfig.shared.offset == 24
    assert R._LaunchConfig.stream.offset == 32
    assert R._LaunchConfig.attrs.offset == 40
    assert R._LaunchConfig.nattrs.offset == 48


def test_pdl_mode_from_config_and_compile_option(monkeypatch):
    from q27py.config import Q27Config, apply_env

    assert Q27Config().engine.pdl == "early"
    assert apply_env(Q27Config(), {"Q27_PDL": "on"}).engine.pdl == "on"
    monkeypatch.setattr(R, "_PDL_MODE", None)
    with pytest.raises(ValueError):
        R.set_pdl_mode("fast")
    for mode, want in (("off", "-DPDL_EARLY=0"), ("on", "-DPDL_EARLY=0"), ("early", "-DPDL_EARLY=1")):
        R.set_pdl_mode(mode)
        opts = R.compile_options()
        assert want in opts and sum(o.startswith("-DPDL_EARLY=") for o in opts) == 1


@pytest.mark.parametrize("mode", ["on", "early"])
def test_pdl_sources_compile(mode, tmp_path, monkeypatch):
    """Both trigger placements build for a pre-Hopper and the Hopper arch (no-ops below sm_90)."""
    from tests.gpu.nvcc_build import NVCC, build

    if NVCC is None:
        pytest.skip("nvcc not found")
    monkeypatch.setattr(R, "_PDL_MODE", mode)
    for mod in ("norm", "gemv"):
        for arch in ("sm_86", "sm_90"):
            rc, log = build(tmp_path, mod, arch)
            assert rc == 0, log[-2000:]


@pytest.mark.gpu
def test_pdl_graph_replay_matches_eager(monkeypatch):
    """Captures with PDL on (q4s tier: the a8 GEMVs) replay to exactly the eager bits."""
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint

    rt = R.Runtime.get()
    if not rt.pdl_supported:
        pytest.skip("programmatic dependent launch needs sm_90")
    if R.pdl_mode() == "off":
        monkeypatch.setattr(R, "_PDL_MODE", "on")  # PDL_EARLY: whatever this process compiled with
    ckpt = Checkpoint.open(DEFAULT_MODEL_DIR)
    model = FastModel(from_checkpoint(ckpt, "q4s", progress=False), max_context=512, chunk=16)
    eager = FastModel(from_checkpoint(ckpt, "q4s", progress=False), max_context=512, chunk=16)
    model.enable_graphs()
    ids = list(range(5, 42))
    s1, s2 = model.new_state(), eager.new_state()
    model.forward(s1, ids, logits_rows="last")
    eager.forward(s2, ids, logits_rows="last")
    for step in range(5):  # step 0 eager, step 1 captures, then replays
        np.testing.assert_array_equal(model.forward(s1, [40 + step]).logits, eager.forward(s2, [40 + step]).logits)
        v1 = model.forward(s1, [50, 51, 52, 53], verify=True)
        v2 = eager.forward(s2, [50, 51, 52, 53], verify=True)
        np.testing.assert_array_equal(v1.logits, v2.logits)
        np.testing.assert_array_equal(v1.hidden, v2.hidden)
        model.commit(s1, v1.trace, 2)
        eager.commit(s2, v2.trace, 2)
    np.testing.assert_array_equal(s1.gdn.get(), s2.gdn.get())
    np.testing.assert_array_equal(s1.k.get(), s2.k.get())
    assert model.graphs.replays > 0


def test_the_nowait_probe_switch_is_off_and_the_engine_refuses_it(monkeypatch, tmp_path):
    """PDL_NOWAIT (a timing probe: griddepcontrol.wait compiled out, so a graph's kernels ignore their
    dependencies) ships 0, guards the one wait in common.cuh, and load_fast_model refuses it before it
    loads anything (a server with it would answer with wrong tokens)."""
    from q27py.config import Q27Config
    from q27py.errors import Q27Error
    from q27py.gpu import constants as C
    from q27py.gpu import forward as F

    assert C.PDL_NOWAIT == 0 and "-DPDL_NOWAIT=0" in C.defines()
    src = (R.CUDA_DIR / "common.cuh").read_text(encoding="utf-8")
    assert src.count("griddepcontrol.wait;") == 1  # no other wait that the switch would miss
    # the one wait sits in pdl_wait_if; pdl_wait (the GEMVs') keeps it unless PDL_NOWAIT is 1 or 3, pdl_entry (every
    # other kernel's) unless it is 1 or 2 -- so with 0 both wait, as without the switch
    wait = src[src.index("void pdl_wait()") :].split("\n", 1)[0]
    assert "pdl_wait_if(PDL_NOWAIT != 1 && PDL_NOWAIT != 3)" in wait
    entry = src[src.index("void pdl_entry()") :]
    entry = entry[: entry.index("\n}\n")]
    assert entry.count("pdl_wait_if(PDL_NOWAIT == 0 || PDL_NOWAIT == 3)") == 2 and "pdl_wait()" not in entry
    monkeypatch.setattr(C, "PDL_NOWAIT", 1)
    cfg = Q27Config()
    cfg.engine.model_dir = str(tmp_path / "absent")
    with pytest.raises(Q27Error, match="PDL_NOWAIT"):
        F.load_fast_model(cfg)
