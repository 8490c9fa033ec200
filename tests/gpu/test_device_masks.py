"""Device-side output-constraint masks (issue 16): cuda/sampling.cu top2_partial_masked against the
host's masked pick, bitwise (ties to the lowest allowed id, as numpy.argmax on the row with refused
ids at -inf), and constrained greedy decoding on the fast path with EngineConfig.device_masks on
giving the host path's tokens, speculation on and off, without downloading logits rows.

Device command: python3 -m pytest -q tests/gpu/test_device_masks.py"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))


@pytest.fixture(scope="module")
def cp():
    import cupy

    from q27py.gpu.runtime import Runtime

    Runtime.get().warm_all()
    return cupy


def _masks(rng, v, n):
    from q27py.engine.constraint import pack_bits

    kinds = [rng.random(v) < 0.5, rng.random(v) < 0.002, np.ones(v, dtype=bool), np.zeros(v, dtype=bool)]
    kinds[3][[0, v - 1, v // 2]] = True  # three ids: the ends of the row and one in the middle
    # a constraint never refuses every id; at v = 31 the sparse kind drew none (device run 3 failed
    # on that, not on the kernel: numpy's argmax of an all -inf row is 0, which the mask refuses)
    kinds[1][rng.integers(0, v)] = True
    kinds[2][rng.integers(0, v, 50)] = False
    return [kinds[i % len(kinds)] for i in range(n)], np.stack([pack_bits(kinds[i % len(kinds)]) for i in range(n)])


@pytest.mark.parametrize("v", [248320, 4097, 31])
def test_masked_top2_equals_host_masked_argmax(cp, v):
    from q27py.engine.constraint import masked_argmax
    from q27py.gpu import kernels as K

    rng = np.random.default_rng(v)
    rows, n = 6, 8
    x = rng.integers(-4, 4, (rows, v)).astype(np.float32)  # many ties
    x[1, :] = -1e30  # (finite: a row of -inf has no numpy.argmax rule over the allowed ids)
    x[1, rng.integers(0, v, 5)] = 2.0
    x[2, v // 2] = np.inf
    keeps, words = _masks(rng, v, n)
    row_idx = np.asarray([(5 * i) % rows for i in range(n)], dtype=np.int32)  # every row, out of order, reused
    part = cp.zeros((n, K.TOP2_BLOCKS, 2), dtype=cp.uint64)
    ids = cp.full(n, -7, dtype=cp.int32)
    top1 = cp.zeros(n, dtype=cp.float32)
    margin = cp.zeros(n, dtype=cp.float32)
    K.top2_masked(cp.asarray(x), v, v, n, cp.asarray(row_idx), cp.asarray(words), words.shape[1], part, ids, top1,
                  margin)
    got = ids.get()
    for i in range(n):
        want = masked_argmax(x[row_idx[i]], words[i])
        assert got[i] == want, (i, got[i], want)
        assert keeps[i][got[i]]
        assert top1.get()[i] == x[row_idx[i], want]


@pytest.fixture(scope="module")
def gpu_setup():
    from test_output_control import Setup

    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint
    from q27py.model.checkpoint import Checkpoint

    s = Setup(DEFAULT_MODEL_DIR)
    s.model = FastModel(from_checkpoint(Checkpoint.open(DEFAULT_MODEL_DIR), "bf16", progress=False), max_context=1024,
                        kv_dtype="f32", chunk=64)
    s.model.enable_graphs()
    return s


@pytest.mark.parametrize("which", ["cc:Bash", "cc:Title", "tools"])
def test_fast_path_device_masks_equal_host_masks(gpu_setup, which, monkeypatch):
    from tool_schemas import CORPUS

    from q27py.engine.api import SamplingParams
    from q27py.engine.grammar import json_grammar, tool_call_grammar
    from q27py.gpu.forward import FastModel

    if which == "tools":
        g, budget = tool_call_grammar({"Bash": CORPUS["cc:Bash"], "Read": CORPUS["cc:Read"]}), 90
    else:
        g, budget = json_grammar(CORPUS[which]), 60
    reads = {"n": 0}
    fetch = FastModel._fetch_logits

    def counted(self, rows):
        reads["n"] += 1
        return fetch(self, rows)

    for spec in (False, True):
        host, _ = gpu_setup.run(g, "Answer in JSON:", budget, SamplingParams(), spec=spec)
        monkeypatch.setattr(FastModel, "_fetch_logits", counted)
        reads["n"] = 0
        dev, _ = gpu_setup.run(g, "Answer in JSON:", budget, SamplingParams(), spec=spec, device_masks=True)
        monkeypatch.setattr(FastModel, "_fetch_logits", fetch)
        assert dev == host, (spec, which)
        # (one download: the prefill's last row, which the decoders' first pick takes on the host)
        assert reads["n"] <= 1, "a device-masked decode downloaded logits rows"
