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


# ---- --max-slots auto on cuda (kvbudget.plan_slots): slots and window from one budget

from q27py.config import GPU_AUTO_MAX_SLOTS, GPU_AUTO_MIN_SLOTS, EngineConfig  # noqa: E402
from q27py.model.kvbudget import plan_slots, states_fit  # noqa: E402

# the 27B at q4s with bf16 KV: 69,632 B/token, 157 MB of GDN state per sequence (docs/KV.md)
BF16_27B = F.bytes_per_token("bf16", F.Q27B_KV_LAYERS, F.Q27B_KV_HEADS, F.Q27B_HEAD_DIM)
GDN_27B = 48 * (48 * 128 * 128 + 3 * 10240) * 4
MPE = 262144


def _plan(free, slots="auto", context="auto", sequences=4, graphs=260 << 20, kv=BF16_27B, mpe=MPE):
    return plan_slots(free, kv, max_slots=slots, max_context=context, max_sequences=sequences, kv_format="bf16",
                      fixed_per_sequence=GDN_27B, graph_bytes_per_state=graphs, margin_bytes=int(1.5 * GIB),
                      max_positions=mpe, cap=GPU_AUTO_MAX_SLOTS, floor=GPU_AUTO_MIN_SLOTS)


def _fits(plan, free):
    """Every live sequence's state at the window plus the margin stays within the free memory."""
    per = plan.budget.window * plan.budget.bytes_per_token + GDN_27B + (260 << 20)
    return plan.budget.sequences * per + int(1.5 * GIB) <= free


def test_auto_slots_on_a_big_card_fill_it_up_to_the_cap():
    # an H200 after q4s weights (~124 GiB free): 4 states at the model's 262,144 window leave room
    # for more; 7 bf16 states of 17.4 GiB fit, so 7 slots at the full window
    free = 124 * GIB
    plan = _plan(free)
    assert plan.budget.window == MPE and plan.budget.limited_by == "model"
    per = MPE * BF16_27B + GDN_27B + (260 << 20)
    assert plan.state_bytes == per and plan.fit == (free - int(1.5 * GIB)) // per == 7
    assert plan.slots == 7 and plan.limited_by == "memory"
    assert plan.budget.sequences == 7 and _fits(plan, free)  # the window is sized for every slot's state
    # fp8 rows are half the bytes: about twice the states fit, still memory-limited under the cap of 16
    fp8 = F.bytes_per_token("fp8", F.Q27B_KV_LAYERS, F.Q27B_KV_HEADS, F.Q27B_HEAD_DIM)
    p8 = _plan(free, kv=fp8)
    assert 2 * plan.fit - 1 <= p8.fit <= GPU_AUTO_MAX_SLOTS and p8.slots == p8.fit and p8.limited_by == "memory"
    # k3v3 rows (~14 KB per token): more fit than the cap allows
    k3 = F.bytes_per_token("k3v3", F.Q27B_KV_LAYERS, F.Q27B_KV_HEADS, F.Q27B_HEAD_DIM)
    p3 = _plan(free, kv=k3)
    assert p3.fit > GPU_AUTO_MAX_SLOTS and p3.slots == GPU_AUTO_MAX_SLOTS and p3.limited_by == "cap"
    assert p3.budget.window == MPE and p3.budget.sequences == GPU_AUTO_MAX_SLOTS


def test_auto_slots_on_a_small_card_keep_the_window_and_share_it():
    # 24 GB card: the window is memory-limited for max_sequences states, and exactly those are the slots
    free = 24 * GIB - int(15.5 * GB)
    plan = _plan(free)
    w = plan.budget.window
    assert plan.budget.limited_by == "memory" and w % 1024 == 0 and 16384 <= w < MPE
    assert plan.slots == 4 and plan.budget.sequences == 4 and _fits(plan, free)
    # the window is today's for 4 sequences (context_window), less the graphs each state now reserves
    alone = context_window(free, BF16_27B, sequences=4, fixed_per_sequence=GDN_27B + (260 << 20),
                           margin_bytes=int(1.5 * GIB), max_positions=MPE)
    assert w == alone.window


def test_auto_slots_floor_of_two_and_where_it_gives_way():
    # --max-sequences 1: the floor still sizes the window for 2 states, so a short request is not stuck
    free = 24 * GIB - int(15.5 * GB)
    plan = _plan(free, sequences=1)
    assert plan.slots == 2 and plan.budget.sequences == 2 and _fits(plan, free)
    # a card where two states of even 1,024 positions do not fit: one slot, one state, no error
    tight = int(1.5 * GIB) + GDN_27B + (260 << 20) + 1100 * BF16_27B
    one = _plan(tight, sequences=1)
    assert one.slots == 1 and one.budget.sequences == 1 and one.budget.window == 1024
    # ... but the prefix cache's own states must fit, as before: no room for 4 is an error
    with pytest.raises(ValueError, match="no room"):
        _plan(tight, sequences=4)


def test_fixed_slots_size_the_window_as_before():
    free = 60 * GIB
    plan = _plan(free, slots=1)
    assert plan.slots == 1 and plan.limited_by == "flag" and plan.budget.sequences == 4  # max_sequences
    plan6 = _plan(free, slots=6)
    assert plan6.slots == 6 and plan6.budget.sequences == 6 and _fits(plan6, free)
    assert plan6.budget.window < plan.budget.window  # six windows share what four did


def test_fixed_context_sizes_only_the_slots():
    free = 60 * GIB  # room for more 32K states than the cap
    plan = _plan(free, context=32768)
    per = 32768 * BF16_27B + GDN_27B + (260 << 20)
    assert plan.budget.window == 32768 and plan.state_bytes == per
    assert plan.fit == states_fit(free, 32768, BF16_27B, fixed_per_sequence=GDN_27B, graph_bytes_per_state=260 << 20,
                                  margin_bytes=int(1.5 * GIB))
    assert plan.fit > GPU_AUTO_MAX_SLOTS and plan.slots == GPU_AUTO_MAX_SLOTS and plan.budget.sequences == GPU_AUTO_MAX_SLOTS
    # a window the card holds only three of: three slots
    mid = 3 * (131072 * BF16_27B + GDN_27B + (260 << 20)) + int(1.5 * GIB) + 1
    p3 = _plan(mid, context=131072)
    assert p3.slots == 3 and p3.fit == 3 and p3.budget.sequences == 4  # max_sequences kept, as before
    # not even one: one slot (the allocation error comes where it came before)
    p0 = _plan(GIB, context=131072)
    assert p0.slots == 1 and p0.fit == 0
    # a window past the model's is capped there
    assert _plan(free, context=10 ** 7).budget.window == MPE


def test_graph_memory_per_state_is_reserved_per_state():
    free = 124 * GIB
    lean, fat = _plan(free, graphs=0), _plan(free, graphs=8 * GIB)
    assert lean.fit >= fat.fit and fat.state_bytes - lean.state_bytes == 8 * GIB
    assert lean.fit == 7 and fat.fit == 4 and fat.slots == 4  # graphs the size of half a window cost slots
    # reserved: the margin plus each live state's GDN state and graphs
    assert fat.budget.reserved_bytes == int(1.5 * GIB) + fat.budget.sequences * (GDN_27B + 8 * GIB)
    assert lean.budget.reserved_bytes == int(1.5 * GIB) + lean.budget.sequences * GDN_27B
    assert "slot(s)" in fat.describe() and "limited by" in fat.describe()
    # the 27B's graphs per state: 97.5 MiB (~125 of the ~0.77 MiB graphs measured; GraphCache enforces it)
    assert EngineConfig().graph_bytes_per_layer * 65 == 195 << 19


def test_model_level_batch_graphs_are_reserved_once():
    """The decode_batch graphs (one per width, shared by every set of states) are reserved once in
    the auto sizing, beside the per-state graphs: size_context_to_memory passes them to plan_slots
    (before, the plan left them out)."""
    from types import SimpleNamespace

    from q27py.gpu.forward import size_context_to_memory
    from q27py.model.config import qwen36_27b_config
    from q27py.model.kvbudget import BATCH_GRAPH_BYTES, batch_graph_reserve

    assert batch_graph_reserve(16) == 15 * BATCH_GRAPH_BYTES and batch_graph_reserve(1) == 0
    # verify_batch's graphs (lanes, groups) and its commit graphs (groups) count too where it is on
    assert batch_graph_reserve(16, 16) == (15 + 136 + 16) * BATCH_GRAPH_BYTES
    assert batch_graph_reserve(16, 0) == batch_graph_reserve(16)
    free = 124 * GIB
    cp = SimpleNamespace(get_default_memory_pool=lambda: SimpleNamespace(free_all_blocks=lambda: None),
                         cuda=SimpleNamespace(runtime=SimpleNamespace(memGetInfo=lambda: (free, 141 * GIB))))
    kv = F.bytes_per_token("bf16", F.Q27B_KV_LAYERS, F.Q27B_KV_HEADS, F.Q27B_HEAD_DIM)

    def plan_for(max_batch, verify_lanes=0):
        # (mtp_batch_lanes 0: the MTP chain graphs are test_size_context_reserves_the_mtp_batch_graphs' subject)
        model = SimpleNamespace(rt=SimpleNamespace(cp=cp), kv_name="bf16", max_pos=MPE, cfg=qwen36_27b_config(),
                                has_mtp=True, max_batch=max_batch, verify_lanes=verify_lanes, mtp_batch_lanes=0,
                                memory_per_sequence=lambda positions: GDN_27B + positions * kv)
        size_context_to_memory(model, EngineConfig(prefill_weight_cache_gb=0))
        return model.slot_plan

    solo, batched, groups = plan_for(1), plan_for(16), plan_for(16, 16)
    assert batched.budget.reserved_bytes - solo.budget.reserved_bytes == 15 * BATCH_GRAPH_BYTES
    assert groups.budget.reserved_bytes - batched.budget.reserved_bytes == (136 + 16) * BATCH_GRAPH_BYTES


def test_mtp_batch_chain_graphs_are_counted():
    """mtp_draft_batch's model-level graphs (one per ("mtp-batch", rows, chains, depth) key, captured on a
    key's second sighting) count in the batch reserve where the model batches MTP chains: before, the
    reserve priced only the decode / verify / commit graphs. The key count is what the engine can make:
    run_drafts' parts of max_batch chains cut by mtp_batch_parts to mtp_batch_lanes rows, at every depth."""
    import itertools

    from q27py.gpu.forward import MTP_CHAIN_DEPTH, mtp_batch_parts
    from q27py.model.kvbudget import (BATCH_GRAPH_BYTES, MTP_BATCH_STEP_BYTES, batch_graph_reserve,
                                      mtp_batch_graph_keys, mtp_batch_graph_reserve)

    # the defaults (and no MTP lanes, or depth 0) price no chain graphs: the old reserve
    assert batch_graph_reserve(16, 16, mtp_lanes=0, mtp_depth=8) == batch_graph_reserve(16, 16) \
        == (15 + 136 + 16) * BATCH_GRAPH_BYTES
    assert batch_graph_reserve(16, 16, mtp_lanes=16, mtp_depth=0) == batch_graph_reserve(16, 16)
    # 16 lanes, 16 chains at most: 136 (rows, chains) pairs at each of 8 depths, a depth-d graph d steps
    assert mtp_batch_graph_keys(16, 16, 8) == 136 * 8
    assert mtp_batch_graph_reserve(16, 16, 8) == 136 * (1 + 2 + 3 + 4 + 5 + 6 + 7 + 8) * MTP_BATCH_STEP_BYTES
    grown = batch_graph_reserve(16, 16, mtp_lanes=16, mtp_depth=MTP_CHAIN_DEPTH)
    assert grown - batch_graph_reserve(16, 16) == mtp_batch_graph_reserve(16, 16, MTP_CHAIN_DEPTH) > 0
    assert MTP_BATCH_STEP_BYTES * 64 == 2 * BATCH_GRAPH_BYTES  # about two layers of a decode_batch graph a step
    # the count is the keys the engine's cuts reach: every run of up to max_batch chains of 1..lanes rows each
    for max_batch, lanes in ((3, 5), (4, 4), (2, 6)):
        seen = set()
        for nchains in range(1, max_batch + 1):
            for widths in itertools.product(range(1, lanes + 1), repeat=nchains):
                for part in mtp_batch_parts(list(widths), lanes):
                    seen.add((sum(widths[i] for i in part), len(part)))
        for depth in (1, 3):
            assert mtp_batch_graph_keys(max_batch, lanes, depth) == len(seen) * depth


def test_size_context_reserves_the_mtp_batch_graphs():
    """size_context_to_memory reserves the mtp-batch chain graphs of a model that batches MTP chains
    (FastModel.mtp_batch_lanes > 0), up to MTP_CHAIN_DEPTH deep, beside the verify / commit graphs."""
    from types import SimpleNamespace

    from q27py.gpu.forward import MTP_CHAIN_DEPTH, size_context_to_memory
    from q27py.model.config import qwen36_27b_config
    from q27py.model.kvbudget import mtp_batch_graph_reserve

    kv = F.bytes_per_token("bf16", F.Q27B_KV_LAYERS, F.Q27B_KV_HEADS, F.Q27B_HEAD_DIM)

    def plan_for(free, mtp_lanes):
        cp = SimpleNamespace(get_default_memory_pool=lambda: SimpleNamespace(free_all_blocks=lambda: None),
                             cuda=SimpleNamespace(runtime=SimpleNamespace(memGetInfo=lambda: (free, 141 * GIB))))
        model = SimpleNamespace(rt=SimpleNamespace(cp=cp), kv_name="bf16", max_pos=MPE, cfg=qwen36_27b_config(),
                                has_mtp=True, max_batch=16, verify_lanes=16, mtp_batch_lanes=mtp_lanes,
                                memory_per_sequence=lambda positions: GDN_27B + positions * kv)
        size_context_to_memory(model, EngineConfig(prefill_weight_cache_gb=0))
        return model.slot_plan

    extra = mtp_batch_graph_reserve(16, 16, MTP_CHAIN_DEPTH)
    assert extra > 0
    # a memory-limited window: the same states either way, the graphs come out of the window
    without, with_mtp = plan_for(40 * GIB, 0), plan_for(40 * GIB, 16)
    assert with_mtp.budget.sequences == without.budget.sequences
    assert with_mtp.budget.reserved_bytes - without.budget.reserved_bytes == extra
    assert with_mtp.budget.limited_by == "memory" and with_mtp.budget.window < without.budget.window
    # a window the model caps: they cost a slot here (7 states of the 27B's full window fit 122.65 GiB beside
    # the decode / verify graphs, 6 beside the mtp-batch ones too)
    without, with_mtp = plan_for(int(122.65 * GIB), 0), plan_for(int(122.65 * GIB), 16)
    assert with_mtp.budget.window == without.budget.window == MPE
    assert (without.slots, with_mtp.slots) == (7, 6)
