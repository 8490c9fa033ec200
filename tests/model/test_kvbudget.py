"""Context auto-sizing (q27py/model/kvbudget.py) with fake memory numbers, the per-arch KV choice,
and the --kv / --max-context flags and environment variables."""

from __future__ import annotations

import argparse

import pytest

from q27py.commands.engine_flags import add_engine_arguments, apply_engine_arguments
from q27py.config import CPU_MAX_CONTEXT, Q27Config, apply_env, fixed_max_context, parse_max_context
from q27py.model import kvformat as F
from q27py.model.kvbudget import GIB, auto_kv_format, card_capacity, context_window

GB = 10 ** 9


def test_window_is_free_minus_reserved_over_bytes_per_token():
    b = context_window(10 * GIB, 1000, kv_format="x", scratch_bytes=GIB, graph_bytes=GIB // 2,
                       margin_bytes=GIB // 2, align=1)
    assert b.window == 8 * GIB // 1000 and b.limited_by == "memory"
    assert b.reserved_bytes == 2 * GIB
    # every sequence owns a window and its fixed GDN state
    b2 = context_window(10 * GIB, 1000, sequences=4, fixed_per_sequence=GIB // 4, margin_bytes=GIB, align=1)
    assert b2.window == (10 * GIB - GIB - GIB) // 4000
    assert b2.window * 4 * 1000 + 2 * GIB <= 10 * GIB


def test_window_aligns_down_and_caps_at_the_model():
    b = context_window(GIB, 1000, align=1024)
    assert b.window % 1024 == 0 and b.window <= GIB // 1000 < b.window + 1024
    capped = context_window(100 * GIB, 1000, max_positions=262144)
    assert capped.window == 262144 and capped.limited_by == "model"
    assert "262,144 tokens" in capped.describe()


def test_no_room_is_a_clear_error():
    with pytest.raises(ValueError, match="no room for a KV cache"):
        context_window(GIB, 1000, margin_bytes=GIB)
    with pytest.raises(ValueError):
        context_window(GIB, 0)


def test_auto_kv_format_per_arch():
    assert auto_kv_format((9, 0)) == "fp8"
    assert auto_kv_format((8, 9)) == "fp8"
    assert auto_kv_format((12, 0)) == "fp8"
    assert auto_kv_format((8, 6)) == "k5v3"
    assert auto_kv_format((8, 0)) == "k5v3"
    # only what the kernels read is ever chosen
    assert auto_kv_format((8, 6), implemented=("bf16", "fp8")) == "fp8"
    assert auto_kv_format((9, 0), implemented=("bf16",)) == "bf16"


def test_262k_window_fits_a_32gb_card_with_q4s_weights_and_k3v3():
    # 27B: 17 KV layers x 4 heads x 256; q4s weights resident ~15.5 GB (docs/KV.md); GDN state per
    # sequence 48 layers x 48 heads x 128 x 128 fp32 + conv windows; 2 GiB for context, scratch, graphs, margin
    gdn = 48 * (48 * 128 * 128 + 3 * 10240) * 4
    tokens = card_capacity(32 * GIB, int(15.5 * GB), "k3v3", F.Q27B_KV_LAYERS, F.Q27B_KV_HEADS, F.Q27B_HEAD_DIM,
                           overhead_bytes=2 * GIB, fixed_per_sequence=gdn)
    assert tokens >= 262144
    assert 262144 * F.bytes_per_token("k3v3", 17, 4, 256) < 3.5 * GB
    # and bf16 KV does not reach it on that card
    bf16 = card_capacity(32 * GIB, int(15.5 * GB), "bf16", 17, 4, 256, overhead_bytes=2 * GIB, fixed_per_sequence=gdn)
    assert bf16 < 262144


def parse(argv):
    p = argparse.ArgumentParser()
    add_engine_arguments(p, serving=True)
    return p.parse_args(argv)


def test_flags_map_into_the_config():
    cfg = Q27Config()
    assert cfg.engine.max_context == "auto" and cfg.engine.kv == "auto"
    assert fixed_max_context(cfg.engine) == CPU_MAX_CONTEXT  # the CPU path keeps its fixed default
    apply_engine_arguments(cfg, parse(["--kv", "k3v3", "--max-context", "4096"]))
    assert cfg.engine.kv == "k3v3" and cfg.engine.max_context == 4096 and fixed_max_context(cfg.engine) == 4096
    apply_engine_arguments(cfg, parse(["--max-context", "auto", "--kv", "FP8"]))
    assert cfg.engine.max_context == "auto" and cfg.engine.kv == "fp8"


@pytest.mark.parametrize("argv", [["--kv", "int4"], ["--max-context", "0"], ["--max-context", "lots"]])
def test_bad_flags_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2


def test_environment_variables():
    cfg = apply_env(Q27Config(), {"Q27_KV": "k5v3", "Q27_MAX_CONTEXT": "auto"})
    assert cfg.engine.kv == "k5v3" and cfg.engine.max_context == "auto"
    cfg = apply_env(Q27Config(), {"Q27_MAX_CONTEXT": "8192"})
    assert cfg.engine.max_context == 8192
    with pytest.raises(ValueError):
        parse_max_context("-5")


def test_fast_path_kv_resolution():
    from q27py.errors import ConfigError
    from q27py.gpu.forward import AUTO_FAST_KV_FORMATS, FAST_KV_FORMATS, resolve_fast_kv

    assert resolve_fast_kv("auto", "bf16", (9, 0)) == "f32"  # bf16 weights keep the golden-test fp32 rows
    assert resolve_fast_kv("auto", "q4s", (9, 0)) in AUTO_FAST_KV_FORMATS
    assert resolve_fast_kv("fp8", "q4s", (8, 0)) == "fp8"  # the portable conversion runs on Ampere
    assert "fp8" in FAST_KV_FORMATS
    for fmt in ("k5v3", "k3v3"):  # the rotated formats run on the CUDA path (FastModel._attention_rotated)
        assert resolve_fast_kv(fmt, "q4s", (8, 6)) == fmt
        assert resolve_fast_kv(fmt, "bf16", (9, 0)) == fmt  # an explicit format wins over the golden-test rows
    assert set(FAST_KV_FORMATS) == {"bf16", "fp8", "k5v3", "k3v3"}  # every kvformat format but none other
    with pytest.raises(ConfigError, match="k4v4"):
        resolve_fast_kv("k4v4", "q4s", (9, 0))  # an unknown name: a clear error
