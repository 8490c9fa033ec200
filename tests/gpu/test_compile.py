"""CPU-side checks of the CUDA sources: every kernel file compiles (nvcc, when present) exactly
as NVRTC will see it, and the packed layout's decode matches its own spec (no GPU needed)."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from q27py.gpu import layout as L
from q27py.gpu.runtime import CUDA_DIR, KERNEL_FILES, source_text

NVCC = shutil.which("nvcc")


def test_every_cuda_file_is_listed():
    on_disk = sorted(p.stem for p in CUDA_DIR.glob("*.cu"))
    assert on_disk == sorted(KERNEL_FILES)


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_kernels_compile_with_nvcc(tmp_path):
    def build(name: str):
        src = tmp_path / f"{name}.cu"
        src.write_text(source_text(name), encoding="utf-8")
        r = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", "-cubin", "-o", str(tmp_path / f"{name}.cubin"), str(src)],
                           capture_output=True, text=True)
        return name, r.returncode, r.stderr

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(build, KERNEL_FILES))
    failed = [(n, err[-2000:]) for n, rc, err in results if rc != 0]
    assert not failed, failed


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
