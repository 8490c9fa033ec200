"""The reference model over quantized KV (EngineConfig.kv): quantize on store, dequantize on read,
the MTP layer included; prefix export/import carries the stored bytes; the format is part of the
prefix cache's compatibility hash; greedy speculation stays exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from q27py import DEFAULT_MODEL_DIR
from q27py.config import Q27Config
from q27py.engine.engine import load_model
from q27py.engine.prefix_cache import compat_hash
from q27py.model.checkpoint import Checkpoint
from q27py.model import kvformat as F
from q27py.model.reference import ReferenceModel
from q27py.model.state import QuantKVCache

IDS = [int(t) for t in np.random.default_rng(0).integers(100, 4000, 40)]


@pytest.fixture(scope="module")
def ck():
    return Checkpoint.open(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def plain(ck):
    m = ReferenceModel(ck)
    st = m.new_state()
    return m, st, m.forward(st, IDS).logits


@pytest.mark.parametrize("fmt", F.FORMATS)
def test_first_attention_layer_stores_quantized_rows(ck, plain, fmt):
    """Layer inputs before the first attention layer do not depend on the KV format, so its rows
    must be exactly quantize(the unquantized run's rows), and attention reads their dequantization."""
    _, st0, logits0 = plain
    m = ReferenceModel(ck, kv=fmt)
    st = m.new_state()
    logits = m.forward(st, IDS).logits
    first = m.cfg.full_layers[0]
    kv = st.kv[first]
    assert isinstance(kv, QuantKVCache)
    f = F.get_format(fmt)
    want = f.quantize(st0.kv[first].k[: len(IDS)], "k")
    for name, a in want.items():
        np.testing.assert_array_equal(kv.payload[f"k.{name}"][: len(IDS)], a)
    np.testing.assert_array_equal(kv.k[: len(IDS)], f.dequantize(want, "k", m.cfg.head_dim))
    # the cache changes the numbers (every format is lossy against fp32 rows) but not wildly
    diff = np.abs(logits - logits0).max()
    assert 0 < diff < 0.3 * np.abs(logits0).max()


def test_lossier_formats_move_logits_more(ck, plain):
    _, _, logits0 = plain
    diff = {}
    for fmt in ("fp8", "k3v3"):
        m = ReferenceModel(ck, kv=fmt)
        diff[fmt] = float(np.abs(m.forward(m.new_state(), IDS).logits - logits0).mean())
    assert diff["fp8"] < diff["k3v3"]


def test_mtp_kv_is_quantized(ck):
    m = ReferenceModel(ck, kv="k5v3")
    st = m.new_state()
    out = m.forward(st, IDS[:10])
    assert isinstance(st.mtp_kv, QuantKVCache)
    m.mtp_forward(st.mtp_kv, out.hidden[:9], IDS[1:10], 0, logits_rows="none")
    assert st.mtp_kv.length == 9
    codes, norm = st.mtp_kv.payload["k.codes"], st.mtp_kv.payload["k.norm"]
    assert codes.dtype == np.uint8 and codes.shape[1:] == (m.cfg.num_key_value_heads, m.cfg.head_dim * 5 // 8)
    np.testing.assert_array_equal(st.mtp_kv.k[:9], F.lm_dequantize(codes[:9], norm[:9], 5, m.cfg.head_dim))


@pytest.mark.parametrize("fmt", ["fp8", "k3v3"])
def test_prefix_export_import_is_bitwise_and_stores_the_bytes(ck, fmt):
    m = ReferenceModel(ck, kv=fmt)
    st = m.new_state()
    out = m.forward(st, IDS[:20])
    m.mtp_forward(st.mtp_kv, out.hidden[:19], IDS[1:20], 0, logits_rows="none")
    arrays = m.export_prefix(st)
    first = m.cfg.full_layers[0]
    assert f"kv.{first}.k.codes" in arrays and f"kv.{first}.k" not in arrays and "mtp.v.codes" in arrays
    st2 = m.new_state()
    m.import_prefix(st2, arrays, st.position)
    a = m.forward(st, IDS[20:24]).logits
    b = m.forward(st2, IDS[20:24]).logits
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(st.mtp_kv.k[: st.mtp_kv.length], st2.mtp_kv.k[: st2.mtp_kv.length])
    # rows of another format are refused, never reinterpreted
    other = ReferenceModel(ck, kv="fp8" if fmt != "fp8" else "k5v3")
    with pytest.raises(ValueError, match="another format"):
        other.import_prefix(other.new_state(), arrays, st.position)


def test_state_format_and_compat_hash_carry_the_kv_format(ck):
    formats = {}
    for kv in (None, "bf16", "fp8", "k5v3", "k3v3"):
        m = ReferenceModel(ck, kv=kv)
        formats[kv] = m.state_format
    assert formats[None] == "reference"  # unchanged: existing disk caches stay valid
    assert len(set(formats.values())) == 5
    hashes = {compat_hash(Path(DEFAULT_MODEL_DIR), ck.config, None, f) for f in formats.values()}
    assert len(hashes) == 5


def test_engine_config_selects_the_reference_kv_format():
    cfg = Q27Config()
    cfg.engine.kv = "fp8"
    assert load_model(cfg).kv_format == "fp8"
    cfg.engine.kv = "auto"  # on the CPU: rows in the compute dtype, as before
    assert load_model(cfg).kv_format is None


def test_greedy_speculation_exact_over_quantized_kv(ck):
    from q27py.config import SpecConfig
    from q27py.engine.api import SamplingParams
    from q27py.engine.decoder import DecodeStats, Decoder
    from q27py.engine.spec import SpecDecoder

    m = ReferenceModel(ck, kv="k3v3")
    prompt = IDS[:12] + IDS[:12]  # a repeat: the suffix drafter fires too

    def run(decoder):
        st, out = m.new_state(), []
        for chunk in decoder.run(st, prompt, 16, SamplingParams(), frozenset(), None, DecodeStats()):
            out.extend(chunk)
        return out

    plain_out = run(Decoder(m))
    assert run(SpecDecoder(m, SpecConfig(max_verify_width=6, max_depth=3))) == plain_out
