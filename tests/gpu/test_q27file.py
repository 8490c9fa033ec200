"""The .q27 container: CPU round trip of the bytes (header, alignment, packed blobs), and on a
GPU, a model loaded from the file computes the same bits as one quantized on load."""

from __future__ import annotations

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.gpu import layout as L
from q27py.io.checkpoint import Checkpoint
from q27py.gpu.q27pack import recipe, write
from q27py.io.q27file import ALIGN, Q27File


@pytest.fixture(scope="module")
def q4s_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("q27") / "tiny-q4s.q27"
    write(path, Checkpoint.open(DEFAULT_MODEL_DIR), "q4s", progress=False)
    return path


def test_header_covers_the_recipe_with_aligned_blobs(q4s_file):
    qf = Q27File(q4s_file)
    ckpt = Checkpoint.open(DEFAULT_MODEL_DIR)
    assert qf.tier == "q4s" and qf.has_mtp == ckpt.has_mtp
    assert qf.names() == [it.name for it in recipe(ckpt.config, ckpt.has_mtp)]
    ends = []
    for name in qf.names():
        for off, n in qf.blob_ranges(name):
            assert off % ALIGN == 0
            ends.append((off, off + n))
    ends.sort()
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), "blobs overlap"
    assert qf.config == ckpt.config


def test_matrix_blobs_equal_the_layout_packer(q4s_file):
    qf = Q27File(q4s_file)
    ckpt = Checkpoint.open(DEFAULT_MODEL_DIR)
    gate = ckpt.get("layers.0.mlp.gate_proj.weight")
    up = ckpt.get("layers.0.mlp.up_proj.weight")
    want = L.pack_matrix(L.interleave_gate_up(gate, up), L.FMT_Q4)
    codes, scales = qf.blobs("layers.0.mlp.gate_up")
    np.testing.assert_array_equal(codes, want.codes)
    np.testing.assert_array_equal(scales.view(np.uint32), want.scales)
    kv = qf.entry("layers.3.attn.kv")["meta"]
    assert kv["fmt"] == L.FMT_Q8  # q4s keeps attention k/v at 8 bits
    assert qf.entry("layers.0.gdn.ab")["meta"]["fmt"] == L.FMT_BF16
    neg_a = qf.blobs("layers.0.gdn.neg_a")[0].view(np.float32)
    np.testing.assert_array_equal(neg_a, (-np.exp(ckpt.get("layers.0.linear_attn.A_log", np.float64))).astype(np.float32))


@pytest.mark.gpu
def test_q27_file_model_matches_quantize_on_load(q4s_file):
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint, from_q27file

    ids = [int(x) for x in np.random.default_rng(1).integers(0, 16000, 20)]
    a = FastModel(from_q27file(q4s_file, progress=False), max_context=128)
    b = FastModel(from_checkpoint(Checkpoint.open(DEFAULT_MODEL_DIR), "q4s", progress=False), max_context=128)
    np.testing.assert_array_equal(a.forward(a.new_state(), ids).logits, b.forward(b.new_state(), ids).logits)
