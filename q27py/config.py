"""Every runtime knob, typed, in one place.

Flags (q27py/commands/*) and environment variables map into these dataclasses
here and nowhere else: `apply_env` is the only reader of os.environ for knobs.
The model's own architecture lives in q27py/model/config.py (ModelConfig),
read from the checkpoint's config.json; nothing here describes the model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from q27py import DEFAULT_MODEL_DIR
from q27py.errors import ConfigError


# EngineConfig.mtp_defer_rows' default (the field says why); SpecDecoder's default too.
MTP_DEFER_ROWS = 32768


@dataclass
class SpecConfig:
    """Self-speculative decoding (MTP draft ladder + suffix drafter).

    Defaults are measured on held-out code with q36-tiny-code (the bundled model then) and priced with
    the CUDA path's measured round costs (docs/PERF.md, "Speculative decoding
    (reference path)"; tools/spec_measure.py). Deeper or wider settings commit
    more tokens per round but cost more per round than they gain there.
    """

    enabled: bool | None = None  # None: on when the checkpoint has an MTP head
    max_depth: int = 3  # MTP ladder depth ceiling (1..7)
    adaptive_depth: bool = True  # let the controller move depth within 1..max_depth (saves lanes at deep levels)
    confidence_margin: float = 0.0  # stop drafting at the first draft whose top1-top2 logit margin is below
    # this; 0 = off: every margin measured lost more tokens/round than the lanes it saved
    suffix: bool = True  # suffix drafter on/off
    suffix_min_match: int = 4  # shortest context-tail match that may propose
    max_verify_width: int = 8  # lanes in one verify (pending token + drafts); bounds suffix proposals. At most
    # 16, the reference path's row-independent size (wider verifies would not be bitwise plain decoding)
    arbitration: str = "agree"  # per-round drafter choice: agree | suffix_first | mtp
    # (engine/drafters.py DraftPlanner; "agree" measured above "suffix_first" in tokens/round and lanes)
    # Pause the MTP ladder after this many ladder rounds in a row accepted no draft (0 = never): each
    # such round paid an MTP pass and a verify lane for nothing, and under "agree" the ladder's
    # disagreement vetoed the suffix drafter (the tiny agent model's traces end in a loop of 30+ such
    # rounds that the suffix drafter would have taken 8 tokens at a time; docs/PERF.md f6). Paused
    # rounds take the suffix proposal alone, or decode plainly without one; every pause_probe_every-th
    # runs a one-draft ladder round (arbitrated as usual), and an accepted draft ends the pause.
    # Greedy output is unchanged (drafts never change it).
    pause_after: int = 4
    pause_probe_every: int = 4
    trace: bool = False  # record every round's drafter, drafts and accepted count in the stats


@dataclass
class EngineConfig:
    """What model runs where, and how much of it fits."""

    model_dir: Path = DEFAULT_MODEL_DIR
    device: str = "cpu"  # "cpu" (numpy) or "cuda" (CuPy RawModule kernels)
    dtype: str = "float32"  # reference path compute dtype: float32 | float64 | bfloat16 (bf16-rounded)
    # "fast" or "reference" (the readable numpy spec, q27py/model/reference.py). On the CPU, fast is
    # q27py/model/fastcpu.py (float32 only); on cuda, the RawModule kernels. auto = fast, except that
    # a CPU dtype other than float32 runs the reference (the only path that computes in it).
    backend: str = "auto"
    tier: str | None = None  # weight tier when quantizing a bf16 checkpoint on load (q4s | q5f | q8 | None)
    # tokens per sequence (clamped to the model's max_position_embeddings). "auto": on CUDA the
    # window the card's free memory holds (q27py/model/kvbudget.py); on the CPU CPU_MAX_CONTEXT.
    max_context: int | str = "auto"
    # KV cache format: auto | bf16 | fp8 | k5v3 | k3v3 (q27py/model/kvformat.py, docs/KV.md).
    # auto: what the device's fast path serves best (kvbudget.auto_kv_format); on the CPU the
    # reference keeps rows in its compute dtype.
    kv: str = "auto"
    # bytes the context auto-sizing leaves free on the card (graph instantiation, allocator slack)
    kv_safety_margin_bytes: int = 1536 << 20
    max_sequences: int = 4  # live sequences kept for prefix reuse (at least max_slots: live_sequences())
    # Requests generating at once (continuous batching, engine/scheduler.py); the rest queue FIFO.
    # "auto": on cuda sized from free memory at load (kvbudget.plan_slots: at most GPU_AUTO_MAX_SLOTS,
    # at least GPU_AUTO_MIN_SLOTS when memory allows; each slot owns one sequence state and its
    # graphs), GPU_MAX_SLOTS where nothing measured memory; CPU_MAX_SLOTS on the CPU.
    max_slots: int | str = "auto"
    # cuda: device memory one sequence state's CUDA graphs take, per model layer (the MTP layer
    # counts as one): GraphCache keys graphs by state (decode, each verify width, prefill tails,
    # commit, MTP passes and chains), and a graph's size follows its kernel nodes, ~16 per layer.
    # Measured (docs/PERF.md, 2026-12-06 third session, H100): a 64-layer graph of the 27B takes ~0.77 MiB
    # (a solo speculating stream of 512 tokens: 13 graphs, 10.0 MiB; model-level graphs 0.74 MiB each), so
    # 1.5 MiB per layer is ~98 MiB a state, room for ~125 such graphs (was 4 MiB per layer, 260 MiB: an
    # assumption of ~60 graphs at 2 KB a node, doubled). GraphCache holds each state's graphs to this budget:
    # past it a new key runs eagerly (counted), so a state with more keys costs speed, never KV memory.
    graph_bytes_per_layer: int = 3 << 19
    prefill_chunk: int = 2048  # tokens per prefill chunk (CPU paths)
    # cuda: tokens per fast-path forward launch. Large, because the cuBLAS prefill route expands
    # each packed matrix to bf16 once per launch (~20 ms for the 27B), amortized over the chunk.
    gpu_prefill_chunk: int = 4096
    # cuda: "auto" (cuBLAS on bf16 expansions for big chunks) | "kernel" (mma.sync only) | "fp8" (sm_89+:
    # cuBLASLt on e4m3 weights and per-token e4m3 activations, power-of-two scales; its own tolerance
    # class, gated on the trained model: tools/fp8_prefill.py, docs/QUANT.md "fp8 prefill")
    prefill_gemm: str = "auto"
    # cuda, those chunks: how the small bf16 matrices (the GDN gates' in_proj_b / in_proj_a, 96 x 5120 on the
    # 27B) multiply. Each fp32 activation split exactly into three bf16 terms, x = hi + mid + lo, and W x as bf16
    # products on tensor cores, W hi accumulated in 320-column pieces: "bf16x3f" (the default) in one fused
    # kernel per matrix (cuda/dequant.cu gemm3_small_m*: the split in registers, no planes or partials in memory;
    # q27py/gpu/blas.py prefill_gemm_bf16x3f); "bf16x3" as a split pass, cuBLAS GEMMs and a combine
    # (prefill_gemm_split3). "f32": the pedantic fp32 SGEMM on fp32 weight copies (94 MB; ~32 TFLOP/s, 12.2 ms of
    # an 8K prefill on the 27B, H100). All fp32-grade against float64 (tests/gpu/test_prefill_split3.py holds both
    # three-term routes to the SGEMM's error: 2.0e-7 to 3.0e-7 relative L2 at 96 x 5120, device run q3); their
    # bits differ. Chunks of >= 128 tokens only: decode, verify and the canonical gates' prompts never take any.
    # Why "bf16x3f": 8.1 ms for the 96 launches of an 8K prefill where the SGEMM took 12.2 (run q2, before the
    # row-half split), +1.0% on the whole 8K prefill (run q3: 11,079 -> 11,195 tok/s, H100). History: "bf16x3"
    # failed two of its own tests once (run j6: -ftz=true zeroed subnormal remainders; a q4s tolerance that was the
    # bf16 tier's), both fixed and passing since run j9; it never measured faster than the SGEMM end to end.
    prefill_small_gemm: str = "bf16x3f"
    # cuda, cuBLAS route: expand the next matrix to bf16 on a side stream while the current one's GEMM
    # runs (two weight buffers, ~2 x 356 MB on the 27B) instead of taking turns (q27py/gpu/blas.py
    # ExpandAhead). Off until measured on the device: same launches, same bits.
    prefill_expand_ahead: bool = False
    # cuda, cuBLAS route, prefill chunks of >= 128 tokens: the MLP's gate_up GEMM writes gate and up as bf16 (fp32
    # accumulation, one round to nearest each) and SwiGLU reads those (q27py/gpu/blas.py _gemm_expanded): half the
    # bytes of that pass. On by default since 2026-12-06 (issue 14): +3.0% on an 8K prefill of the 27B (device run q1,
    # H100: 11,203 -> 11,542 tok/s; +2.6% on the H200, run n5), and with the other levers of that session it is what
    # brings the 8K prefill to the bar. Its own tolerance class (docs/QUANT.md "bf16 gate_up before SwiGLU"): on the
    # trained tiny model, KL mean 2.45e-5 (q4s) / 2.17e-5 (q8), top-1 agreement 99.76% / 99.66%, NLL +0.0002 /
    # -0.0001 (run q3), ~4x the KL of the single bf16 rounding of the SwiGLU output; inside the a8 tier's accepted
    # gate on every measure (mean KL ~10x under it on the device, 35-40x in the CPU study). Decode, verify and prompts under 128 tokens never take it: the canonical gates' md5s PASS either
    # way. False gives the fp32 gate_up rows back.
    prefill_gate_up_bf16: bool = True
    # cuda, cuBLAS route: keep up to this many GiB of the bf16 expansions resident (one per matrix,
    # in first-use order; the 27B's all take 49.5 GB = 46.1 GiB), so chunks and interleaved pieces after the first
    # skip the ~20 ms expansion (q27py/gpu/blas.py ExpansionCache). The auto slot / context sizing
    # reserves it. 0 = off. "auto" (the default): whatever is left once the window the card would give
    # without it holds max(max_sequences, the slot floor) states (forward.auto_weight_cache_bytes): a
    # small card keeps its window and slots and gets none; an H200 gets all of them and fewer extra slots.
    prefill_weight_cache_gb: float | str = "auto"

    cpu_prefill_chunk: int = 256  # at most this on the CPU path: the cancel flag is checked between chunks
    # cuda: GDN prefill runs through the chunked tensor-core kernel ("chunked", chunks aligned to
    # absolute positions; within fp32 rounding of the sequential kernel), the three-kernel chunked
    # pipeline ("chunked2": parallel pre-pass / sequential state pass / parallel output pass, same
    # alignment and class, ~410 MB scratch at the 27B's 4096-lane chunk) or the per-token kernel
    # ("sequential": bitwise the decode step). docs/PERF.md "GDN chunked prefill". chunked2 is the
    # default since device runs c4-c5 (exact decays under strong gating; 2.85x the sequential kernel
    # per layer at 8K, prefill 8K 6,594 -> 7,856 tok/s; the four gates keep their bits).
    gdn_prefill: str = "chunked2"
    # cuda, chunked2 prefill chunks: the GDN output norm (gated RMSNorm x SiLU(z)) inside the pipeline's output
    # pass (cuda/gdn_chunk2.cu gdn2_out_gated_*) instead of a kernel of its own after it: the O rows stay on
    # chip (no fp32 round trip through memory), the same bits (tests/gpu/test_gdn_chunk.py).
    gdn_out_fused: bool = True
    # cuda, chunked2 prefill chunks: the output pass's products (O = e^G Q S_c + (M o Q K^T) V_new) as one TF32
    # product each instead of three (3xTF32, the fp32-grade class the state recurrence keeps): a third of that pass's
    # tensor-core work (cuda/gdn_chunk2.cu gdn2_out1_*). Its own tolerance class, "tf32 out" (docs/QUANT.md): O
    # within ~1e-3 relative of the fp32-grade pass, below the bf16 rounding its consumer (the output projection's
    # bf16 input) applies anyway; no state, snapshot or decode step changes. Measured 2026-12-07 (H100): O 3.8-4.2e-4
    # relative L2 off float64, tiny-model KL mean 2.07e-5 / top-1 0.9990 (the bf16 gate_up class), gates unchanged;
    # 8K and 32K prefill +0.8% alone, +1.2% on top of prefill_gdn_state_tf32. On by default since 2026-12-08 with the
    # state class (issue 14: both together 8K 11,716 -> 12,156 tok/s on an H100; the forward, prefix, prefill BLAS
    # tests and the four gates pass with both on). False gives the fp32-grade output pass back.
    prefill_gdn_out_tf32: bool = True
    # cuda, chunked2 GDN prefill: True runs the W / U pre-pass and the state recurrence with one TF32 product a mma
    # instead of three (cuda/gdn_chunk2.cu gdn2_prep1_* / gdn2_state1_*_w8: a third of their tensor-core work, and a
    # third of the state pass's dependent mma chain per chunk). Its own tolerance class, "tf32 state" (docs/QUANT.md):
    # W, U, V_new, every chunk's start state and the final state move by ~2-5e-4 relative (no growth with the chunk
    # count over 4K tokens in the spec's study, gdn_chunked_wy(tf32=...)), so the decode steps and prefix snapshots
    # after such a prefill carry it; a prefill cut at multiples of 64 still gives one run's bits (snapshots restore
    # exactly). Measured 2026-12-08 (H100): the state pass 0.959 -> 0.592 ms per 27B layer at 8K, prefill 8K +2.5%
    # (32K +2.1%); device quality on the tiny model KL mean 2.0e-5, p99.9 2.0e-4, top-1 0.9985 (inside the a8 gate,
    # the "tf32 out" class's size). On by default (issue 14); False gives the fp32-grade passes back.
    prefill_gdn_state_tf32: bool = True
    # cuda: prefill attention kernel. "v1" (cuda/attention_prefill.cu: Q and P as bf16 hi + lo,
    # fp32-grade) or "v2" (cuda/attention_prefill2.cu: single bf16 Q and P, cp.async + ldmatrix,
    # 128-row tiles, key blocks for long contexts; bf16 / fp8 KV, fp32 KV keeps v1). v2 is the
    # default since device run 3 (2.3-3x v1: docs/PERF.md "attention prefill v2"); v1 stays selectable.
    attn_prefill: str = "v2"
    # cuda, attn_prefill "v2" with bf16 KV at head dim 256 on sm_90 (H100 / H200): run it as the wgmma
    # kernel (cuda/attention_prefill3.cu, built for sm_90a): v2's tiles, key blocks and rounding, two
    # warpgroups reading K and V straight from shared memory. Other cards, fp8 KV and other head dims
    # keep the mma.sync kernel. The default since device run j1: bitwise v2 in every GPU test case,
    # 1.40-1.44x its speed (docs/PERF.md "Session of 2026-12-05 (evening)").
    attn_prefill_wgmma: bool = True
    checkpoint_every: int = 4096  # prefix reuse: GDN snapshot every N prefill tokens (0 = off)
    # ... but a grid checkpoint that would cut a prefill piece shorter than this many tokens (after the
    # resume point, before the prompt's end, or beside a system / stable boundary) is taken at that
    # boundary instead (engine/prefix_cache.py snapshot_positions): a warm turn resumed 105 tokens
    # before a grid point runs as one forward, not 105 + the rest (a cuda piece under 128 tokens
    # misses the cuBLAS route, gpu/blas.py MIN_TOKENS, and each piece adds a host sync). 0 = off:
    # every checkpoint cuts at its grid position. Boundary (system / stable) marks never move.
    checkpoint_min_piece: int = 128
    # Prompt rows whose MTP warm-up may wait until the first token is out, all slots together (0 = none
    # wait: every prefill piece's MTP rows are written as the piece ends). The first token is chosen
    # from the main model's last logits row alone; the MTP head's KV rows of the prompt (engine/drafters.py
    # MTPLadder, ~0.1 s of a cold 25K-token 27B prompt on the H200) are needed only by the first draft,
    # so the speculative decoder writes them after the first token, with the same calls in the same
    # order (the same bits: outputs and drafts never change). A waiting row keeps its prompt piece's
    # hidden row alive, hidden_size fp32 (the 27B: 20 KiB a row, 640 MiB at 32,768): device memory the
    # slot / context sizing does not reserve (it comes out of kv_safety_margin_bytes' slack) while a
    # prompt prefills. 32,768 covers a cold prompt up to 32K tokens (the 25K target) whole; past the
    # bound the earliest pieces' rows are written eagerly, as with 0. Lower it on a card sized tight.
    mtp_defer_rows: int = MTP_DEFER_ROWS
    prefix_cache_dir: Path | None = None  # persistent prefix cache (opt-in)
    prefix_cache_max_bytes: int = 8 << 30
    # cuda fast path GEMV: "a8" (cuda/gemv.cu gemv8_*: int8 activations per 64-k chunk on q4/q8 weights,
    # mma.m16n8k32; bf16 weights keep v1), "v1" (bf16 activations, the fp32-grade path) or "v2"
    # (cuda/gemv2.cu). a8 is its own tolerance class, the default since its quality gate held on the
    # trained model (tools/a8_quality.py: greedy equal, NLL within 0.001, KL 2.5e-4; docs/QUANT.md)
    gemv: str = "a8"
    # cuda, v1 / a8 GEMV: each decode-step GEMV's last wave prefetches into L2 the first bytes
    # (MiB, summed over the next launch's first-wave tiles) that the next GEMV of the step reads, so
    # the DRAM streams through the gap between them (cuda/gemv.cu gemv_prefetch). 0 = off. A hint:
    # the bits never change. Capped at a third of the card's L2. Off: measured on the H200 (device
    # run g1, docs/PERF.md) 8 MiB neutral, 16-32 MiB 3-4% slower at decode 2K.
    gemv_prefetch_mb: float = 0.0
    # cuda, a8 GEMV on q4 weights on sm_90 (H100 / H200): which launch widths run the warpgroup-MMA kernel
    # (cuda/gemv_wg.cu, built for sm_90a; bitwise the mma.sync kernel's outputs at every width, so the
    # choice is speed only): "all" (every q4 launch; the default since 2026-12-06's sixth session: with gate_up's
    # tail split, constants GEMV_TAIL_CTAS, "auto" sent its half units at 2-8 lanes to the mma.sync kernel and
    # verify W=8 ran 8.76 ms against 8.56 under "all", docs/PERF.md), "auto" (1 lane, 9-16 lanes, and the lm_head
    # at any width), "off", "wide" (every q4 launch of 9-16 lanes).
    gemv_wgmma: str = "all"
    # cuda: the GDN decode / verify step (conv, gates, delta rule, gated norm, window commit) as one
    # kernel (cuda/gdn_decode.cu, bitwise the kernel chain) instead of four launches. Off until the
    # device run has held it bitwise and measured it (docs/PERF.md).
    gdn_fused: bool = False
    # cuda: a constrained greedy pick takes the masked device argmax (a packed bitmask uploaded,
    # one id back: cuda/sampling.cu top2_partial_masked) instead of downloading its logits row.
    # Off until measured on the device (issue 16); the host path serves the CPU backend always.
    device_masks: bool = False
    # cuda fast path decode / verify attention: "split" (the per-lane split-K kernel, cuda/attention.cu
    # attn_split_*) or "mma" (attn_mma_*: tensor cores, one CTA per kv head and split for every lane, the
    # KV read once per round). mma is the default since device run 3 (3x at 32K, 18x at W=16; docs/PERF.md)
    # for bf16 KV, and for fp8 KV with attn_decode_fp8 (below).
    # mma sums in another order (Q and P as bf16 hi + lo): tolerance-equal to split, not bitwise.
    attn_decode: str = "mma"
    # fp8 KV takes attn_decode's kernel too (attn_mma_fp8_*) when it is "mma". On since device run c3:
    # the 27B probe's fp8 rows run clean (the earlier illegal address was the probe's inputs racing
    # its round's stream, issue 17), 66 attn_mma + 16 fp8 forward GPU tests pass, and decode with fp8
    # KV at 32K / 128K drops from 11.27 / 20.72 ms (split) to 8.37 / 11.19 ms (docs/PERF.md).
    # Env Q27_ATTN_DECODE_FP8=0 keeps fp8 on the split kernel.
    attn_decode_fp8: bool = True
    # cuda, sm_90+: captured decode / verify / MTP graphs launch their kernels with programmatic
    # dependent launch (cuLaunchKernelEx + griddepcontrol, cuda/common.cuh pdl_entry): each kernel
    # starts while the one before drains, and a GEMV streams its first weight stages before waiting
    # for its activations. "off" | "on" (every kernel waits, then lets the next launch) | "early"
    # (the short kernels let the next launch before their wait). Eager launches never use it; below
    # sm_90 the mode is ignored. "on" since device run c1: decode 2K 7.85 -> 7.39 ms, bits unchanged
    # (gates PASS); "early" then measured the same (docs/PERF.md "PDL"). "early" since 2026-12-06 (fifth
    # session, run r2, H100): with the 3-CTA gemv_wg entries the next GEMV's CTAs now stream their first
    # weight stages in the tail of the one before: decode 2K 7.75 -> 7.45 ms (-3.9%), verify W=16 10.98 ->
    # 10.54, the 16-lane batched round 13.01 -> 12.60; a kernel still waits before it reads or writes
    # anything its predecessors touch, so the bits are the same.
    pdl: str = "early"
    # Batched decode rounds (issue 15, engine/scheduler.py): when two or more slots are decoding, a
    # round runs one plain-decode lane per slot through ONE model.decode_batch (the weights swept
    # once for all of them: a 27B step is weight-bound, so B lanes cost about one). Off: every slot
    # runs its own forward. None (auto): on for cuda (device run c6: C=2 1.75x C=1, 8 streams 502
    # t/s against 116; every token bitwise its solo run's), off on the CPU, where a batch is a loop
    # of solo forwards (no bandwidth to share) and would only cost the speculation shared rounds
    # give up (batch_spec).
    batch_rounds: bool | None = None
    # What speculation does while two or more slots decode (engine/share_policy.py). A shared round
    # runs every sharing slot as one lane group of ONE weight sweep: its pending token plus, where the
    # model has verify_batch (model.verify_lanes > 0: the CPU paths; cuda with verify_groups), up to
    # its share of the sweep's flat width in drafts (16 lanes / sharing slots), verified and
    # committed per slot; without drafts a plain decode lane, its drafters fed so they are right
    # when it runs its own round again. "adaptive" (default): each round splits the slots between
    # the sweep and their own speculative rounds taken in turn, by the tokens per second each has
    # measured (two streams with the trained MTP head and plain lanes: solo rounds in turn; sixteen:
    # the sweep). "drafts": every decoding slot shares, its group carrying drafts (the sweep alone,
    # for measuring it). "solo-only": every decoding slot shares with plain lanes (speculation for a
    # slot alone). Only speed changes: a slot's tokens are the same either way. Without speculation
    # it is "solo-only".
    batch_spec: str = "adaptive"
    # Prefill tokens per round for a prompt prefilling while other slots decode (0 = off: always the
    # full engine_prefill_chunk). A 4096-token cuda chunk of the 27B holds the running streams
    # ~0.7 s per round; 512 gave a 109 ms p50 gap beside a 32K prefill (run c6), so cuda's auto
    # (None) is 384; the CPU's (cpu_prefill_chunk 256) is already small: 0. Pieces tile the full
    # chunk's grid (every full-chunk cut stays a cut), so alone nothing changes; beside decoders the
    # prompt's rounding changes as a prefix-restore split changes it (tokens equal, not guaranteed
    # bitwise on a near tie: the prefill tolerance class).
    interleave_chunk: int | None = None
    # ... and that piece is interleave_chunk at position 0, interleave_chunk / (1 + p / this) at
    # position p (0: fixed pieces, the default). A piece's attention grows with the keys it reads, so
    # shrinking it keeps the wait flatter in theory; measured (run c10, 768 / (1 + p / 13,600) against
    # fixed 384): gap p50 87 ms (94), but max 188 ms (130), long TTFT 9.0 s (8.2), short TTFT 183 ms
    # (130) -- worse on three of four, so fixed pieces stay the default (docs/PERF.md).
    interleave_halving: int = 0
    # ... and the piece adapts so that a round beside decoding slots (their wait between tokens) takes
    # about this long: after each such round the scheduler scales the next piece by budget / the
    # round's wall time (damped: x0.5-2 per round, between interleave_chunk / 8 and 4x), and while
    # two prompts prefill only the shorter one takes a piece (a title-sized request does not stack
    # on the long one's piece). 0 = fixed pieces; None = auto (cuda: GPU_INTERLEAVE_BUDGET_MS; cpu: 0).
    # Measured beside a 32K prefill (runs e10-e12, docs/PERF.md): a 75 ms budget held the gap p50 at
    # 75 ms but not its max (117 ms against 106 for fixed 384-token pieces), and the long prompt's TTFT
    # went 8.3 -> 12.5 s: a piece is mostly fixed cost (~60 ms at 32K context: 320 / 352 / 384 tokens
    # gave p50 89 / 92 / 94 ms; the bf16 expansion is ~20 of it), so smaller pieces only add pieces.
    # Off by default; worth a re-measure with prefill_weight_cache_gb on.
    interleave_budget_ms: float | None = None
    # cuda: FastModel.decode_batch runs up to 16 sequences' next tokens in one weight sweep (lane
    # kernels read each sequence's state from a lane table; bitwise the per-sequence forwards: 81
    # GPU tests, run c6). Off: max_batch = 1, every sequence its own forward.
    batch_sweep: bool = True
    # cuda: FastModel.verify_batch (the shared sweep with drafts, batch_spec "adaptive" / "drafts"):
    # every sharing slot's verify lanes (its pending token and drafts) in one weight sweep, the GDN and
    # conv steps run per lane group by the group entries of cuda/gdn.cu and cuda/conv.cu. On by default since
    # the H200 run of 2026-12-06 (docs/PERF.md, tools/device_wave.sh groupsbench): spec replay, groups / plain
    # shared sweep 1.96x at C=2, 1.42x at 4, 1.12x at 8, 0.99x at 16; the load bench with recorded acceptance
    # 211 -> 388 t/s at C=2, 359 -> 517 at 4, 413 -> 438 at 8, 574 -> 609 at 16. Its GPU tests pass bitwise
    # (tests/gpu/test_verify_groups_gpu.py, H100 and H200), and so do the gates and the GPU suite with it on.
    # Off: verify_lanes 0, shared rounds carry plain lanes only. The CPU paths always have verify_batch.
    verify_groups: bool = True

    def shared_rounds(self) -> bool:
        """batch_rounds with auto resolved for this device."""
        return self.device == "cuda" if self.batch_rounds is None else bool(self.batch_rounds)

    def interleave(self) -> int:
        """interleave_chunk with auto resolved for this device."""
        if self.interleave_chunk is None:
            return GPU_INTERLEAVE_CHUNK if self.device == "cuda" else 0
        return int(self.interleave_chunk)

    def interleave_budget(self) -> float:
        """interleave_budget_ms with auto resolved for this device (0 where pieces are off)."""
        if self.interleave() <= 0:
            return 0.0
        if self.interleave_budget_ms is None:
            return GPU_INTERLEAVE_BUDGET_MS if self.device == "cuda" else 0.0
        return float(self.interleave_budget_ms)

    def slots(self, sized: int | None = None) -> int:
        """Requests generating at once: max_slots, or for "auto" the count the model sized from
        memory at load (`sized`: FastModel.sized_slots), else the device's default."""
        if not isinstance(self.max_slots, int):
            if self.device == "cpu":
                return CPU_MAX_SLOTS
            return max(1, int(sized)) if sized else GPU_MAX_SLOTS
        return max(1, self.max_slots)

    def live_sequences(self, sized: int | None = None) -> int:
        """Sequence states the engine keeps (prefix cache; the CUDA window is sized for this many):
        every slot needs its own, so never fewer than slots()."""
        return max(1, self.max_sequences, self.slots(sized))

    def engine_prefill_chunk(self) -> int:
        """Tokens per prefill piece the decoder feeds the model on this device."""
        return self.gpu_prefill_chunk if self.device == "cuda" else self.prefill_chunk

    def check_batching(self) -> None:
        """Reject batch settings with no meaning (the engine calls this when it is built)."""
        if self.batch_spec not in BATCH_SPEC_CHOICES:
            raise ConfigError(f"batch_spec must be one of {', '.join(BATCH_SPEC_CHOICES)}, not {self.batch_spec!r}")
        if not isinstance(self.interleave_halving, int) or self.interleave_halving < 0:
            raise ConfigError(f"interleave_halving must be a token count >= 0 (0 = fixed pieces), not {self.interleave_halving!r}")
        if self.interleave_chunk is not None and (not isinstance(self.interleave_chunk, int) or self.interleave_chunk < 0):
            raise ConfigError(f"interleave_chunk must be a token count >= 0 (0 = off), not {self.interleave_chunk!r}")
        w = self.prefill_weight_cache_gb
        if w != "auto" and (isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0):
            raise ConfigError(f"prefill_weight_cache_gb must be GiB >= 0 (0 = off) or 'auto', not {w!r}")
        b = self.interleave_budget_ms
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not b >= 0):
            raise ConfigError(f"interleave_budget_ms must be milliseconds >= 0 (0 = fixed pieces), not {b!r}")

    def check_prefix_reuse(self) -> None:
        """Reject prefix-reuse settings with no meaning (the engine calls this when it is built)."""
        for name in ("checkpoint_every", "checkpoint_min_piece"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"{name} must be a token count >= 0 (0 = off), not {v!r}")


CPU_MAX_CONTEXT = 32768  # the reference path's fixed window (max_context "auto" off CUDA)
GPU_INTERLEAVE_CHUNK = 384  # interleave_chunk's cuda auto: prefill tokens per round beside decoding slots
GPU_INTERLEAVE_BUDGET_MS = 0.0  # interleave_budget_ms's cuda auto: fixed pieces (measured: see the field)
# Slots on the CPU path: each slot runs its own forward in turn (no shared weight sweep there), so
# slots divide one core's tokens/s between streams rather than add to it. 4 covers what agent
# clients run at once (a session, a sub-agent, title generation, one more) with each stream kept at
# >= 1/4 speed, and equals the default max_sequences: no state beyond those the prefix cache keeps.
CPU_MAX_SLOTS = 4
# cuda, where max_slots is "auto" but nothing measured memory (a model built without
# size_to_memory: scripted engines, benches that build FastModel themselves): one slot, the old FIFO.
GPU_MAX_SLOTS = 1
# cuda "auto" bounds (kvbudget.plan_slots). At most 16: the shared weight sweep's width
# (FastModel.decode_batch, max_batch 16), so every decoding slot rides one sweep per round (8 -> 16
# streams: 800 -> 1,060 t/s in the batch probe, run c6); memory decides below that. At least 2 when
# memory allows, so a short request is not stuck behind a long generation.
GPU_AUTO_MAX_SLOTS = 16
GPU_AUTO_MIN_SLOTS = 2
KV_CHOICES = ("auto", "bf16", "fp8", "k5v3", "k3v3")
PREFILL_SMALL_GEMM_CHOICES = ("bf16x3", "bf16x3f", "f32")  # EngineConfig.prefill_small_gemm
# EngineConfig.batch_spec (engine/share_policy.py)
BATCH_SPEC_CHOICES = ("adaptive", "drafts", "solo-only")


def parse_max_context(value) -> int | str:
    """A --max-context / Q27_MAX_CONTEXT value: a positive token count or "auto"."""
    if isinstance(value, int) or str(value).strip().lower() != "auto":
        n = int(value)
        if n < 1:
            raise ValueError(f"max context must be >= 1 or 'auto', not {value!r}")
        return n
    return "auto"


def fixed_max_context(engine: "EngineConfig") -> int:
    """The window when nothing measures memory (the CPU path, scripted engines): a number or the default."""
    return engine.max_context if isinstance(engine.max_context, int) else CPU_MAX_CONTEXT


def parse_switch(value: str) -> bool:
    """A 0|1 environment switch (Q27_GDN_FUSED, Q27_DEVICE_MASKS, Q27_ATTN_DECODE_FP8, Q27_BATCH_ROUNDS)."""
    v = str(value).strip()
    if v not in ("0", "1"):
        raise ValueError(f"expected 0 or 1, not {value!r}")
    return v == "1"


def parse_max_slots(value) -> int | str:
    """A --max-slots / Q27_MAX_SLOTS value: a positive count, or "auto" (the device's default)."""
    if not isinstance(value, int) and str(value).strip().lower() == "auto":
        return "auto"
    n = int(value)
    if n < 1:
        raise ValueError(f"max slots must be >= 1 or 'auto', not {value!r}")
    return n


def parse_weight_cache_gb(value) -> float | str:
    """A Q27_PREFILL_WEIGHT_CACHE_GB value: GiB >= 0 (0 = off), or "auto" (EngineConfig says what)."""
    if str(value).strip().lower() == "auto":
        return "auto"
    gb = float(value)
    if not gb >= 0:
        raise ValueError(f"prefill weight cache must be GiB >= 0 or 'auto', not {value!r}")
    return gb


def parse_prefill_small_gemm(value: str) -> str:
    """A Q27_PREFILL_SMALL_GEMM value: one of PREFILL_SMALL_GEMM_CHOICES."""
    v = value.strip().lower()
    if v not in PREFILL_SMALL_GEMM_CHOICES:
        raise ValueError(f"prefill small GEMM must be one of {', '.join(PREFILL_SMALL_GEMM_CHOICES)}, not {value!r}")
    return v


def parse_kv(value: str) -> str:
    v = str(value).strip().lower()
    if v not in KV_CHOICES:
        raise ValueError(f"KV format must be one of {', '.join(KV_CHOICES)}, not {value!r}")
    return v


@dataclass
class ServerConfig:
    """HTTP front end."""

    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: list[str] = field(default_factory=list)
    max_body_bytes: int = 32 << 20
    header_timeout_s: float = 30.0
    body_timeout_s: float = 120.0
    default_thinking: bool = True
    default_max_tokens: int = 32768  # when a client sends none (Codex never does); clamped to the context left
    reasoning_budget: int | None = None  # force-close <think> after this many tokens (None: half of max_tokens)
    max_tokens_ceiling: int | None = None  # ceiling on any request's max_tokens, a client's own included (None: none)
    # The CPU path's values of the three above, installed by `apply_device_defaults` when the
    # engine runs on the CPU (flags still win). A small model on a laptop CPU decodes ~100-200
    # tokens/s: 32,768 tokens of a turn that never closes would hold a client for minutes. The
    # bundled q36-tiny-agent was trained on conversations of at most 8K tokens whose answers run
    # ~20-200 tokens and whose think blocks ~30-90 (its train_report.json): 1,024 tokens cover any
    # answer it gives, 256 think tokens leave room for the answer after a forced close, and
    # 4,096 bounds clients that always ask for more (Claude Code asks for 32,000).
    cpu_default_max_tokens: int = 1024
    cpu_reasoning_budget: int = 256
    cpu_max_tokens_ceiling: int = 4096
    # Keep earlier turns' thinking in the prompt (Qwen3.6 preserve_thinking): the rendered
    # history then stays byte-stable across turns, which prefix reuse needs.
    preserve_thinking: bool = True
    default_temperature: float = 0.0  # when a request sends none; 0 = greedy
    keepalive_interval_s: float = 10.0  # ping / in_progress events while the engine is silent
    shutdown_grace_s: float = 10.0  # in-flight requests get this long on SIGINT/SIGTERM
    chat_template: str | None = None  # None: chosen from the checkpoint (chat/render.py choose_dialect)
    tool_dialect: str | None = None  # "xml" | "json"; None: from the checkpoint's template text
    # GET /metrics without the API key, for scrapers that send none (Prometheus, the Kubernetes
    # inference gateway's endpoint picker); it carries counts and timings, never request content.
    metrics_without_key: bool = False


@dataclass
class Q27Config:
    engine: EngineConfig = field(default_factory=EngineConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


def _key_list(value: str) -> list[str]:
    """Q27_API_KEY: comma-separated keys. A set variable naming an empty key ("," or "a,,b") is an
    error, as an empty key file is: a server the operator meant to protect must not start open."""
    keys = [k.strip() for k in value.split(",")]
    if not all(keys):
        raise ConfigError("Q27_API_KEY holds an empty key (comma-separated keys, none of them empty)")
    return keys


# Environment variables, all here. Value: (section, field, parser).
ENV_VARS = {
    "Q27_MODEL": ("engine", "model_dir", Path),
    "Q27_DEVICE": ("engine", "device", str),
    "Q27_BACKEND": ("engine", "backend", str),
    "Q27_MAX_CONTEXT": ("engine", "max_context", parse_max_context),
    "Q27_KV": ("engine", "kv", parse_kv),
    "Q27_MAX_SLOTS": ("engine", "max_slots", parse_max_slots),
    "Q27_PREFIX_CACHE": ("engine", "prefix_cache_dir", Path),
    "Q27_CHECKPOINT_MIN_PIECE": ("engine", "checkpoint_min_piece", int),
    "Q27_MTP_DEFER_ROWS": ("engine", "mtp_defer_rows", int),
    "Q27_GEMV": ("engine", "gemv", str),
    "Q27_GEMV_PREFETCH_MB": ("engine", "gemv_prefetch_mb", float),
    "Q27_GEMV_WGMMA": ("engine", "gemv_wgmma", str),
    "Q27_GDN_PREFILL": ("engine", "gdn_prefill", str),
    "Q27_GDN_OUT_FUSED": ("engine", "gdn_out_fused", parse_switch),
    "Q27_PREFILL_GDN_OUT_TF32": ("engine", "prefill_gdn_out_tf32", parse_switch),
    "Q27_PREFILL_GDN_STATE_TF32": ("engine", "prefill_gdn_state_tf32", parse_switch),
    "Q27_GDN_FUSED": ("engine", "gdn_fused", parse_switch),
    "Q27_ATTN_PREFILL": ("engine", "attn_prefill", str),
    "Q27_ATTN_PREFILL_WGMMA": ("engine", "attn_prefill_wgmma", parse_switch),
    "Q27_DEVICE_MASKS": ("engine", "device_masks", parse_switch),
    "Q27_ATTN_DECODE": ("engine", "attn_decode", str),
    "Q27_ATTN_DECODE_FP8": ("engine", "attn_decode_fp8", parse_switch),
    "Q27_PDL": ("engine", "pdl", str),
    "Q27_PREFILL_GEMM": ("engine", "prefill_gemm", str),
    "Q27_PREFILL_SMALL_GEMM": ("engine", "prefill_small_gemm", parse_prefill_small_gemm),
    "Q27_PREFILL_EXPAND_AHEAD": ("engine", "prefill_expand_ahead", parse_switch),
    "Q27_PREFILL_GATE_UP_BF16": ("engine", "prefill_gate_up_bf16", parse_switch),
    "Q27_PREFILL_WEIGHT_CACHE_GB": ("engine", "prefill_weight_cache_gb", parse_weight_cache_gb),
    "Q27_BATCH_ROUNDS": ("engine", "batch_rounds", parse_switch),
    "Q27_BATCH_SPEC": ("engine", "batch_spec", str),
    "Q27_INTERLEAVE_CHUNK": ("engine", "interleave_chunk", int),
    "Q27_INTERLEAVE_HALVING": ("engine", "interleave_halving", int),
    "Q27_INTERLEAVE_BUDGET_MS": ("engine", "interleave_budget_ms", float),
    "Q27_BATCH_SWEEP": ("engine", "batch_sweep", parse_switch),
    "Q27_VERIFY_GROUPS": ("engine", "verify_groups", parse_switch),
    "Q27_HOST": ("server", "host", str),
    "Q27_PORT": ("server", "port", int),
    "Q27_API_KEY": ("server", "api_keys", _key_list),
    "Q27_CHAT_TEMPLATE": ("server", "chat_template", str),
    "Q27_TOOL_DIALECT": ("server", "tool_dialect", str),
}


def apply_env(cfg: Q27Config, environ: dict[str, str] | None = None) -> Q27Config:
    """Overlay environment variables onto cfg (flags are applied after, so they win)."""
    environ = os.environ if environ is None else environ
    for var, (section, name, parse) in ENV_VARS.items():
        if var in environ and environ[var] != "":
            setattr(getattr(cfg, section), name, parse(environ[var]))
    return cfg


def engine_env() -> EngineConfig:
    """The engine section of the defaults overlaid with the environment: what a module-level default of the GPU
    path reads when no engine built from flags has set it (one place instead of one apply_env per knob)."""
    return apply_env(Q27Config()).engine


def apply_device_defaults(cfg: Q27Config) -> Q27Config:
    """Install the CPU path's output limits (ServerConfig.cpu_*) when the engine runs on the CPU.
    Call after env and engine flags (which pick the device), before the server flags (which win)."""
    if cfg.engine.device == "cpu":
        s = cfg.server
        s.default_max_tokens = s.cpu_default_max_tokens
        s.reasoning_budget = s.cpu_reasoning_budget
        s.max_tokens_ceiling = s.cpu_max_tokens_ceiling
    return cfg


def apply_overrides(section_obj, values: dict) -> None:
    """Set the given dataclass fields, ignoring None (an absent flag)."""
    names = {f.name for f in fields(section_obj)}
    for key, value in values.items():
        if value is None:
            continue
        if key not in names:
            raise KeyError(f"unknown setting {key!r} for {type(section_obj).__name__}")
        setattr(section_obj, key, value)
