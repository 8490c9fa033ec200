"""CPU-side checks of the CUDA sources: every kernel file compiles (nvcc, when present) exactly
as NVRTC will see it, and the packed layout's decode matches its own spec (no GPU needed)."""

from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from q27py.gpu import constants as C
from q27py.gpu import layout as L
from q27py.gpu.runtime import CUDA_DIR, KERNEL_FILES, compile_options, source_text

sys.path.insert(0, str(Path(__file__).parent))  # the build helper beside this file (tests/ is no package)
import nvcc_build  # noqa: E402
import nvrtc_build  # noqa: E402
from nvcc_build import NVCC  # noqa: E402
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")  # the portable path builds everywhere; sm_90 is the H200


def test_every_cuda_file_is_listed():
    on_disk = sorted(p.stem for p in CUDA_DIR.glob("*.cu"))
    assert on_disk == sorted(KERNEL_FILES)


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ["sm_90"])
def test_kernels_compile_with_nvcc(tmp_path, arch):
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda n: (n, *nvcc_build.build(tmp_path, n, arch)), KERNEL_FILES))
    failed = [(n, err[-2000:]) for n, rc, err in results if rc != 0]
    assert not failed, failed


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ARCHS)
def test_gemv_kernels_build_without_spills(tmp_path, arch):
    """Both GEMV generations build for every supported arch, and v2 keeps every stream loop in
    registers: a spill would put local-memory traffic beside the weight stream (its pipeline
    depths in the constants table are sized to fit the launch bounds)."""
    for name in ("gemv", "gemv2"):
        rc, err = nvcc_build.build(tmp_path, name, arch)
        assert rc == 0, err[-2000:]
        rep = nvcc_build.ptxas_report(err)
        if name == "gemv2":
            assert len(rep) == 6, rep
            assert all(spill == 0 for _, spill in rep.values()), rep
        else:  # the default a8 q4 kernels (decode and verify on every card) stay in registers too
            assert all(rep[k][1] == 0 for k in ("gemv8_q4_nt1", "gemv8_q4_nt2")), rep


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ARCHS)
def test_gdn_decode_builds_without_spills(tmp_path, arch):
    """The fused GDN step keeps its state columns in registers at its launch bounds (32 warps:
    64 registers): a spill would add local-memory traffic beside the state stream."""
    rc, err = nvcc_build.build(tmp_path, "gdn_decode", arch)
    assert rc == 0, err[-2000:]
    rep = nvcc_build.ptxas_report(err)
    assert sorted(rep) == ["gdn_decode_k1", "gdn_decode_k2", "gdn_decode_k4",
                           "gdn_decode_lanes_k1", "gdn_decode_lanes_k2", "gdn_decode_lanes_k4"], rep
    assert all(spill == 0 for _, spill in rep.values()), rep


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ARCHS)
def test_attention_mma_kernels_build_without_spills(tmp_path, arch):
    """The tensor-core decode attention keeps its O^T and Q fragments in registers under the
    168-register bound of a 12-warp CTA on every arch (the d256 hi + lo pair is built for sm_90+
    only: below it the entry traps and kernels.attention_mma picks the _bq variant)."""
    rc, err = nvcc_build.build(tmp_path, "attention", arch)
    assert rc == 0, err[-2000:]
    rep = {k: v for k, v in nvcc_build.ptxas_report(err).items() if k.startswith("attn_mma")}
    # 16 kernels + the combine, their decode_batch (lane table) and verify_batch (group table) twins
    assert len(rep) == 51 and sum(k.startswith("attn_mma_lanes_") for k in rep) == 16, sorted(rep)
    assert sum(k.startswith("attn_mma_groups_") for k in rep) == 16, sorted(rep)
    assert all(spill == 0 for _, spill in rep.values()), rep
    assert all(regs <= 168 for regs, _ in rep.values()), rep


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch", ARCHS)
def test_swiglu_kernels_build_for_every_arch(tmp_path, arch):
    """The prefill SwiGLU kernels (cuda/dequant.cu), the bf16 gate_up route's included (swiglu_tiles_zbf16*:
    EngineConfig.prefill_gate_up_bf16), build for every supported arch in registers (the other cuda/ files are
    built for sm_90 above)."""
    rc, err = nvcc_build.build(tmp_path, "dequant", arch)
    assert rc == 0, err[-2000:]
    rep = {k: v for k, v in nvcc_build.ptxas_report(err).items() if k.startswith("swiglu_tiles")}
    assert sorted(rep) == ["swiglu_tiles", "swiglu_tiles_bf16", "swiglu_tiles_scaled", "swiglu_tiles_zbf16",
                           "swiglu_tiles_zbf16_bf16"], rep
    assert all(spill == 0 for _, spill in rep.values()), rep


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_sources_need_the_constants_table(tmp_path):
    """A kernel built without the table's -D defines must fail: the numbers are not hidden in the
    sources (guards against a re-added #ifndef default)."""
    src = tmp_path / "gemv2.cu"
    src.write_text(source_text("gemv2"), encoding="utf-8")
    r = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", "-cubin", "-o", str(tmp_path / "x.cubin"), str(src)],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "G2_WARPS" in r.stderr


# ---------------------------------------------------------------- the constants table
_DEFINE = re.compile(r"^\s*#\s*define\s+(\w+)(\(?)\s*(.*)$", re.M)
_LOCAL_MACROS = {"FULL_MASK", "INFINITY"}  # helpers local to common.cuh, not shared with Python


def _cuda_sources() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(CUDA_DIR.glob("*.cu*"))}


def test_constants_table_is_the_only_definition():
    table = C.table()
    assert len(table) == len(set(table)) and len(table) > 20
    for fname, text in _cuda_sources().items():
        for name, paren, body in _DEFINE.findall(text):
            assert name not in table, f"{fname} defines {name}, which the constants table owns"
            if not paren and re.fullmatch(r"[-+()\w\s]*\d[\w]*\)?\s*(//.*)?", body.strip()):
                assert name in _LOCAL_MACROS, f"{fname} defines numeric constant {name}: add it to q27py/gpu/constants.py"
        assert not re.search(r"#\s*ifndef\s+(" + "|".join(table) + r")\b", text), f"{fname} keeps a default"


def test_every_table_constant_is_used_and_python_mirrors_none():
    """Each name is used by a kernel source or the Python side, and no Python module re-defines a
    table name with its own literal (kernels.py re-exports them from the table)."""
    sources = "\n".join(_cuda_sources().values())
    pkg = CUDA_DIR.parent / "q27py"
    py = {p: p.read_text(encoding="utf-8") for p in pkg.rglob("*.py") if p.name != "constants.py"}
    for name in C.table():
        used = re.search(rf"\b{name}\b", sources) or any(re.search(rf"\bC\.{name}\b", t) for t in py.values())
        assert used, f"constant {name} is used nowhere"
    literal = re.compile(r"^(\w+(?:\s*,\s*\w+)*)\s*=\s*\d[\d, ]*(?:#.*)?$", re.M)
    gpu = [p for p in py if p.parent.name == "gpu" and p.name != "layout.py"]  # layout.py is the table's own source
    for p in gpu:
        for lhs in literal.findall(py[p]):
            names = {n.strip() for n in lhs.split(",")}
            clash = names & set(C.table())
            assert not clash, f"{p.name} hand-mirrors {sorted(clash)}"


def test_compile_options_carry_the_table():
    opts = compile_options()
    assert opts[0] == "--std=c++17"
    assert f"-DG2_WARPS={C.G2_WARPS}" in opts and f"-DD_NFIELDS={C.D_NFIELDS}" in opts
    assert len([o for o in opts if o.startswith("-D")]) == len(C.table())


@pytest.mark.parametrize("fmt", [L.FMT_BF16, L.FMT_Q8, L.FMT_Q4])
def test_fragment_decode_matches_layout(fmt):
    """Emulate the kernel's per-thread fragment decode (bit tricks included) on packed bytes."""
    rng = np.random.default_rng(fmt)
    rows, cols = 21, 130  # ragged on both axes: padding must decode to zero
    w = rng.standard_normal((rows, cols)).astype(np.float32)
    pm = L.pack_matrix(w, fmt)
    sh = pm.shape
    if fmt == L.FMT_BF16:
        expect = L.bf16_to_f32(L.bf16_bits(w))
    else:
        expect, _ = L.quantize(w, fmt)
    full = np.zeros((sh.row_tiles * 16, sh.kpad), dtype=np.float32)
    full[:rows, :cols] = expect
    for tile in range(sh.row_tiles):
        for chunk in range(sh.kchunks):
            got = L.emulate_fragments(pm.codes, sh, tile, chunk)
            np.testing.assert_array_equal(got, full[tile * 16 : tile * 16 + 16, chunk * 64 : chunk * 64 + 64])


@pytest.mark.parametrize("fmt", [L.FMT_BF16, L.FMT_Q8, L.FMT_Q4])
def test_unpack_inverts_pack(fmt):
    rng = np.random.default_rng(10 + fmt)
    w = rng.standard_normal((40, 256)).astype(np.float32) * 0.05
    pm = L.pack_matrix(w, fmt)
    if fmt == L.FMT_BF16:
        expect = L.bf16_to_f32(L.bf16_bits(w))
    else:
        codes, scales = L.quantize(w, fmt)
        expect = L.dequantize(codes, scales, pm.shape.group)
        # symmetric quantization error is at most half a step per weight
        step = np.repeat(scales.astype(np.float32), pm.shape.group, axis=1)[:, :256]
        assert np.all(np.abs(expect - w) <= 0.5 * step + 1e-7)
    np.testing.assert_array_equal(L.unpack(pm), expect)


def test_interleave_gate_up_groups_rows_by_eight():
    gate = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)
    up = -gate
    out = L.interleave_gate_up(gate, up)
    assert out.shape == (32, 3)
    np.testing.assert_array_equal(out[0:8], gate[0:8])
    np.testing.assert_array_equal(out[8:16], up[0:8])
    np.testing.assert_array_equal(out[16:20], gate[8:12])
    np.testing.assert_array_equal(out[24:28], up[8:12])
    assert not out[20:24].any() and not out[28:32].any()


def test_setup_cfg_installs_every_cuda_file():
    """An installed package compiles from share/q27py/cuda: every kernel file must be listed there."""
    import configparser

    from q27py.gpu.runtime import CUDA_DIR

    cfg = configparser.ConfigParser()
    cfg.read(CUDA_DIR.parent / "setup.cfg")
    listed = {line.strip().split("/")[-1] for line in cfg["options.data_files"]["share/q27py/cuda"].splitlines() if line.strip()}
    on_disk = {p.name for p in CUDA_DIR.iterdir() if p.suffix in (".cu", ".cuh")}
    assert on_disk == listed


def test_sass_loop_counter_finds_the_hot_loop():
    """tools/sass_loops.py (the device script's SASS report) on a hand-written cuobjdump excerpt:
    the loop with the HMMA is chosen over a scalar loop, its instructions and 16-B loads counted."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sass_loops", CUDA_DIR.parent / "tools" / "sass_loops.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sass = """
        Function : k_demo
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IADD3 R2, R2, 0x1, RZ ;
        /*0020*/               @P0 BRA 0x10 ;
        /*0030*/                   LDG.E.128.CONSTANT R4, desc[UR4][R8.64] ;
        /*0040*/                   LOP3.LUT R12, R4, 0xf000f, RZ, 0xc0, !PT ;
        /*0050*/                   HFMA2.BF16_V2 R12, R12, 1, -136 ;
        /*0060*/                   HMMA.16816.F32.BF16 R16, R12, R20, R16 ;
        /*0070*/              @!P1 BRA 0x30 ;
        /*0080*/                   EXIT ;
    """
    lines = mod.report(sass)
    assert lines[0].startswith("k_demo") and "5 instr" in lines[0] and "1 HMMA" in lines[0]
    assert "1 x 16-B weight loads" in lines[0] and "5.0 per 16 B" in lines[0]
    assert "HMMA:1" in lines[1] and "LDG:1" in lines[1]


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
@pytest.mark.parametrize("arch,cc", [("sm_90", (9, 0)), ("sm_86", (8, 6))])
def test_gemv_ring_bytes_match_the_host(tmp_path, monkeypatch, arch, cc):
    """The dynamic shared memory the host asks for (kernels.gemv_shared_bytes) is exactly the a8
    kernels' ring (cuda/gemv.cu RingCfg: stages x stage bytes, activations in the ring on sm_90 /
    sm_100 only): a kernel whose ring outgrew the request would write past its shared memory. The
    device compile pass names the CUDA side's numbers in a deliberate error (an incomplete template
    instantiated with them), read back here."""
    from q27py.gpu import kernels as K

    src = source_text("gemv") + """
template <int A, int B, int C_, int D> struct RingShow;
#ifdef __CUDA_ARCH__
__device__ void ring_show() {
    RingShow<RingCfg<FMT_Q4, 1, true>::S * RingCfg<FMT_Q4, 1, true>::STAGE,
             RingCfg<FMT_Q4, 2, true>::S * RingCfg<FMT_Q4, 2, true>::STAGE,
             RingCfg<FMT_Q8, 1, true>::S * RingCfg<FMT_Q8, 1, true>::STAGE,
             RingCfg<FMT_Q8, 2, true>::S * RingCfg<FMT_Q8, 2, true>::STAGE> r;
}
#endif
"""
    f = tmp_path / "ring.cu"
    f.write_text(src, encoding="utf-8")
    r = subprocess.run([NVCC, *compile_options(), f"-arch={arch}", "-cubin", "-o", str(tmp_path / "r.cubin"), str(f)],
                       capture_output=True, text=True)
    m = re.search(r"RingShow<(\d+), (\d+), (\d+), (\d+)>", r.stderr)
    assert r.returncode != 0 and m, r.stderr[-1500:]
    ring = [int(v) for v in m.groups()]

    class Rt:  # gemv_shared_bytes asks the runtime for the device's compute capability
        pass

    rt = Rt()
    rt.cc = cc
    monkeypatch.setattr(K.Runtime, "get", staticmethod(lambda: rt))
    red = [C.GEMV_WARPS * K.GEMV_ROWS_PER_CTA * nt * 8 * 4 for nt in (1, 2)]
    want = [K.gemv_shared_bytes(L.FMT_Q4, 1, a8=True), K.gemv_shared_bytes(L.FMT_Q4, 2, a8=True),
            K.gemv_shared_bytes(L.FMT_Q8, 1, a8=True), K.gemv_shared_bytes(L.FMT_Q8, 2, a8=True)]
    assert want == [max(b, red[i % 2]) for i, b in enumerate(ring)], (ring, want)
    plain = C.RING_Q4 * C.GEMV_R * (K.GEMV_WPC[L.FMT_Q4] * 16 + 4) * 32 * C.GEMV_WARPS
    assert (ring[0] > plain) == (cc == (9, 0)), "the activations ride in the ring on sm_90 only (of these two)"
    if cc == (9, 0):  # two CTAs of each a8 q4 kernel still fit one SM's 228 KB (1 KB reserved per CTA)
        assert all(2 * (b + 1024) <= 228 * 1024 for b in want[:2]), want


def _cuobjdump():
    """cuobjdump: on PATH, or from the nvidia-cuda-cuobjdump wheel (.ci/run installs it and nvdisasm's as test tools), else
    None."""
    import glob
    import shutil

    found = shutil.which("cuobjdump")
    if found:
        return found
    for root in sys.path:
        hits = sorted(glob.glob(f"{root}/nvidia/cu*/bin/cuobjdump"))
        if hits:
            return hits[-1]
    return None


def test_gemv_dp_ring_loads_land_in_their_slots(tmp_path):
    """nvcc + cuobjdump: in every cuda/gemv_dp.cu entry's hot loop no register a global load writes is then copied
    into another one. The first build refilled a ring slot before its scale's last use, so ptxas loaded the new scale
    into a temporary and moved it into the slot right away: each chunk waited on a fresh global load (16 such copies
    a 16-chunk loop), which the device measured as long-scoreboard stalls and 42% of the read probe (docs/PERF.md,
    2026-12-07 sixteenth session)."""
    import os
    import shutil

    nb = nvcc_build
    tool = _cuobjdump()
    if nb.NVCC is None or tool is None:
        pytest.skip("needs nvcc and cuobjdump")
    bindir = os.path.dirname(tool)  # cuobjdump -sass runs nvdisasm: from PATH or the same wheel's bin
    env = dict(os.environ, PATH=os.environ.get("PATH", "") + os.pathsep + bindir)
    if shutil.which("nvdisasm", path=env["PATH"]) is None:
        pytest.skip("needs nvdisasm beside cuobjdump")
    r = nb.build_with(tmp_path, "gemv_dp", ["-arch=sm_90"])
    assert r.returncode == 0, r.stderr[-2000:]
    entries = re.findall(r"GEMV_DP_KERNEL\((gemv8p_\w+),", (CUDA_DIR / "gemv_dp.cu").read_text())
    assert len(entries) >= 5
    for fn in entries:
        sass = subprocess.run([tool, "-sass", "-fun", fn, str(tmp_path / "gemv_dp.cubin")], capture_output=True,
                              text=True, check=True, env=env).stdout
        insns = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass)]
        back = [(int(m.group(1), 16), a) for a, t in insns if (m := re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", t))
                and int(m.group(1), 16) < a]
        start, end = max(back, key=lambda b: b[1] - b[0])  # the unrolled chunk loop: the longest backward branch
        body = [t for a, t in insns if start <= a <= end]
        assert sum("IDP.4A" in t for t in body) >= 64, fn
        loaded = {m.group(1) for t in body if (m := re.search(r"\bLDG\S*\s+(R\d+)", t))}
        copies = [t for t in body if (m := re.search(r"\b(?:MOV|IMAD\.MOV\.U32)\s+R\d+,\s*(?:RZ,\s*RZ,\s*)?(R\d+)$", t))
                  and m.group(1) in loaded]
        assert not copies, f"{fn}: loads copied out of their registers in the hot loop: {copies[:4]}"


def test_no_structured_bindings_in_kernel_sources():
    """The runtime compiles cuda/ with NVRTC, which rejects a lambda capturing a structured binding (a C++17 rule that
    nvcc's host-side front end lets through): gemv_dp.cu's `const auto [un, c0, ...] = dp_unit(...)` built with nvcc
    in CI and failed every NVRTC build of the module on the device (2026-12-07), so warm_all() failed. Bind fields
    one by one instead."""
    import re

    from q27py.gpu.runtime import CUDA_DIR

    for f in sorted(CUDA_DIR.glob("*.cu*")):
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            assert not re.search(r"\bauto\s*&{0,2}\s*\[", line), f"{f.name}:{i}: structured binding: {line.strip()}"


@pytest.mark.skipif(nvrtc_build.find_libnvrtc() is None, reason="libnvrtc not installed (the nvidia-cuda-nvrtc wheel)")
def test_every_module_compiles_with_nvrtc():
    """Every kernel module builds with NVRTC -- the runtime's compiler on the device -- for sm_90 (sm_90a where the
    module has that build, as Runtime._arch_module asks) and for sm_86, with the runtime's options. nvcc's checks above
    do not cover it: a structured binding captured by a lambda built with nvcc and failed NVRTC, so every device start
    (warm_all) failed from e8c803a until b4991dc."""
    from q27py.gpu.runtime import ARCH_SPECIFIC

    lib = nvrtc_build.load()
    jobs = []
    for name in KERNEL_FILES:
        a = ARCH_SPECIFIC.get(name, {}).get((9, 0))
        jobs += [(name, "sm_86", ()), (name, a, ("-DQ27_ARCH_SPECIFIC",)) if a else (name, "sm_90", ())]
    with ThreadPoolExecutor(max_workers=2) as ex:  # ctypes lets go of the GIL inside NVRTC
        done = list(ex.map(lambda j: (j, nvrtc_build.compile_module(lib, *j)), jobs))
    failed = [f"{name} ({arch}): {log[-600:]}" for (name, arch, _x), (ok, log) in done if not ok]
    assert not failed, "\n".join(failed)
