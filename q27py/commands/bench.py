"""`q27py bench`: benchmarks on the CUDA fast path.

  q27py bench [--random-weights 27b] [--tier q4s] [--json] full 27B shapes, random weights made on the GPU (the default)
  q27py bench shortbench [--model DIR] [--device cpu|cuda] [--json]
                                                           5 short prompts x 128 tokens through the engine
  q27py bench replay [--model DIR | --random-weights 27b] [--device cpu|cuda] [--json]
                                                           a Claude-Code-shaped session: prefix reuse and TTFT
  q27py bench grammar [--tokenizer FILE] [--json]         output-constraint cost per decode step (CPU)
  q27py bench spec-replay [--traces FILE ...] [--tier q4s] [--streams C ...] [--json]
                                                           recorded speculative rounds replayed on the 27B shapes
                                                           (--streams: C sequences, own rounds in turn vs one sweep)
  q27py bench load [--model DIR | --random-weights 27b] [--device cpu|cuda] [--streams 1 2 4 8 16] [--json]
                 [--batch-rounds 0|1] [--interleave-chunk N] [--traces FILE ... [--engine-draft-widths]]
                                                           C concurrent streams through the slot scheduler:
                                                           aggregate / per-stream t/s, TTFT, gaps, a long prefill,
                                                           batched rounds (one decode_batch for the decoding slots)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def add_arguments(p) -> None:
    from q27py.gpu.weights import TIERS

    p.add_argument("suite", nargs="?", choices=["shortbench", "replay", "grammar", "spec-replay", "load"],
                   help="shortbench, replay, grammar, spec-replay or load (default: the --random-weights kernel bench)")
    p.add_argument("--random-weights", choices=["27b"],
                   help="full Qwen3.6-27B shapes with seeded random weights (the default bench; 27b is the only size)")
    p.add_argument("--tier", choices=sorted(TIERS), default=None,
                   help="weight tier (random weights: default q4s; shortbench: the checkpoint's own bf16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="fewer points: decode at 2K, widths 1/8/16, prefill 2K")
    p.add_argument("--model", type=Path, default=None, help="model directory for shortbench")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens generated per shortbench prompt (128) / per load stream (64 on cpu, 128 on cuda)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="shortbench / replay: engine device (default cuda)")
    p.add_argument("--system-tokens", type=int, default=20000, help="replay: size of the system + tools block")
    p.add_argument("--turns", type=int, default=30, help="replay: turns in the session")
    p.add_argument("--traces", type=Path, nargs="+", default=None,
                   help="spec-replay: round traces (default: q27py/bench/data/spec_traces.json, tools/record_traces.py); "
                        "load --random-weights: speculation on, each round offering and accepting drafts as these "
                        "rounds did")
    p.add_argument("--engine-draft-widths", action="store_true",
                   help="load --traces: the engine's own drafters choose each round's drafts (on random-weight text "
                        "about half the records'); the records only force acceptance")
    p.add_argument("--streams", type=int, nargs="+", default=None, metavar="C",
                   help="load: concurrent streams per run (default 1 2 4 8 16); spec-replay: also C sequences at once, "
                        "own rounds in turn against one shared sweep (off by default)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="load: prompt tokens per stream")
    p.add_argument("--long-tokens", type=int, default=None,
                   help="load: the mixed case's long prompt (default 32768 on cuda, 2048 on cpu)")
    p.add_argument("--max-slots", default=None, metavar="N|auto",
                   help="load: the engine's slots (default auto: 4 on cpu, sized from memory on cuda)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="load: tokens per prefill step (cuda gpu_prefill_chunk / cpu_prefill_chunk)")
    p.add_argument("--no-mixed", action="store_true", help="load: skip the long-prefill case")
    p.add_argument("--short-warm", action="store_true",
                   help="load: skip the untimed full-size run before each timed one (the timed runs then also pay "
                        "the graph captures of shapes first seen in them, as before 2026-12-06)")
    p.add_argument("--batch-rounds", type=int, choices=[0, 1], default=None,
                   help="load: 1 = decoding slots share one decode_batch per round (EngineConfig.batch_rounds; "
                        "default: Q27_BATCH_ROUNDS, else off)")
    p.add_argument("--interleave-chunk", type=int, default=None, metavar="N",
                   help="load: prefill tokens per round beside decoding slots (EngineConfig.interleave_chunk; 0 = off)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="grammar: tokenizer.json(.gz) (default: the bundled full Qwen3.6 vocabulary)")


def suite(args) -> str:
    """Which bench the arguments select: no positional suite means the random-weights bench, as the help says."""
    if args.suite:
        return args.suite
    return "random-weights"


def run(args) -> int:
    log = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    which = suite(args)
    if which == "shortbench":
        from q27py.bench.shortbench import run_shortbench
        from q27py.config import Q27Config, apply_env, apply_overrides
        from q27py.engine.engine import LocalEngine

        cfg = apply_env(Q27Config())
        apply_overrides(cfg.engine, {"model_dir": args.model, "device": args.device or "cuda", "tier": args.tier})
        result = run_shortbench(LocalEngine.load(cfg), args.tokens or 128, log)
    elif which == "replay":
        result = _replay(args, log)
    elif which == "load":
        result = _load(args, log)
    elif args.suite == "grammar":
        from q27py.bench.grammar import run_grammar_bench

        result = run_grammar_bench(args.tokenizer, log)
    elif args.suite == "spec-replay":
        from q27py.bench import spec_replay

        result = [spec_replay.run(t, args.tier or "q4s", seed=args.seed, log=log, streams=args.streams)
                  for t in (args.traces or [spec_replay.TRACES])]
    else:
        from q27py.bench.random_weights import Bench

        bench = Bench(tier=args.tier or "q4s", seed=args.seed, log=log)
        if args.quick:
            bench.verify = _narrow(bench.verify)
            result = bench.run(decode_ctx=(2048,), prefill_lens=(2048,), mem_ctx=(2048, 32768))
        else:
            result = bench.run()
    if args.json:
        print(json.dumps(result, indent=1, default=float))
    return 0


def _replay(args, log) -> dict:
    """Build engines (one warm, fresh cold ones) over one shared model, then replay."""
    from q27py.bench.replay import run_replay
    from q27py.config import Q27Config, apply_env, apply_overrides
    from q27py.engine.engine import LocalEngine, load_model
    from q27py.tokenizer import Tokenizer

    cfg = apply_env(Q27Config())
    device = args.device or "cuda"
    apply_overrides(cfg.engine, {"model_dir": args.model, "device": device, "tier": args.tier,
                                 "max_context": args.system_tokens + 2048 * args.turns + 4096})
    if args.random_weights:
        from q27py.gpu.forward import FastModel, configure_memory, graph_budgets
        from q27py.gpu.weights import random_weights
        from q27py.model.config import qwen36_27b_config
        from q27py.model.tiny import FULL_TOKENIZER

        model = FastModel(random_weights(qwen36_27b_config(), args.tier or "q4s", args.seed),
                          max_context=cfg.engine.max_context, kv_dtype="bf16", chunk=cfg.engine.gpu_prefill_chunk)
        configure_memory(model, cfg.engine)  # the server's slots and weight cache at this window
        model.enable_graphs(**graph_budgets(model, cfg.engine))  # and its graph budgets
        model.rt.warm_all()
        tokenizer = Tokenizer.from_file(FULL_TOKENIZER)
    else:
        model = load_model(cfg)
        tokenizer = Tokenizer.from_model_dir(cfg.engine.model_dir)
    log(f"replay: {type(model).__name__} on {device}, system block ~{args.system_tokens} tokens, {args.turns} turns")
    result = run_replay(lambda: LocalEngine(cfg, model, tokenizer), tokenizer, args.system_tokens, args.turns,
                        seed=args.seed, log=log)
    log(f"token-weighted reuse {result['token_weighted_reuse']:.1%}; warm TTFT mean {result['warm_ttft_mean_s'] * 1000:.0f} ms; "
        f"turn of {result['turn_at_target']['prompt_tokens']} tokens: warm {result['turn_at_target']['ttft_s'] * 1000:.0f} ms, "
        f"cold {result['turn_at_target']['cold_ttft_s'] * 1000:.0f} ms")
    g = result.get("graphs")
    if g:
        log(f"graphs: {g['captures']} captured; model-level {g['model_graph_bytes'] / 2**20:.1f} MiB; the largest state's "
            f"{g['state_graph_bytes_max'] / 2**20:.1f} MiB in {g['graphs_per_state_max']} graphs (budget "
            f"{(g['state_budget'] or 0) / 2**20:.1f} MiB); {g['steps_over_budget']} steps eager for a full budget")
    return result


def _load(args, log) -> dict:
    """`bench load`: the engine from a model dir (cpu or cuda), or the 27B shapes with random weights
    on cuda (built as `bench replay` builds them); slots as the server sizes them unless --max-slots."""
    from q27py.bench.load import LONG_CPU, LONG_GPU, STREAMS, run_load
    from q27py.config import Q27Config, apply_env, apply_overrides, parse_max_slots
    from q27py.engine.engine import LocalEngine
    from q27py.tokenizer import Tokenizer

    cfg = apply_env(Q27Config())
    device = "cuda" if args.random_weights else (args.device or "cuda")
    streams = tuple(args.streams or STREAMS)
    tokens = args.tokens or (128 if device == "cuda" else 64)
    long_tokens = 0 if args.no_mixed else (args.long_tokens or (LONG_GPU if device == "cuda" else LONG_CPU))
    window = max(long_tokens, args.prompt_tokens) + tokens + 1024
    window += -window % 1024
    over = {"model_dir": args.model, "device": device, "tier": args.tier, "max_context": window,
            "checkpoint_every": 0}  # every prompt is new: no snapshots to take
    if args.max_slots is not None:
        over["max_slots"] = parse_max_slots(args.max_slots)
    if args.prefill_chunk:
        over["gpu_prefill_chunk" if device == "cuda" else "cpu_prefill_chunk"] = args.prefill_chunk
    if args.batch_rounds is not None:
        over["batch_rounds"] = bool(args.batch_rounds)
    over["interleave_chunk"] = args.interleave_chunk  # None (absent) keeps the env's / the default
    apply_overrides(cfg.engine, over)
    if args.random_weights:
        from q27py.gpu.forward import FastModel, configure_memory, graph_budgets
        from q27py.gpu.weights import random_weights
        from q27py.model.config import qwen36_27b_config
        from q27py.model.tiny import FULL_TOKENIZER

        # random weights accept no drafts: plain greedy rounds, the honest cost -- unless --traces gives
        # the trained model's recorded acceptance (bench/trace_accept.py), then speculation is on
        cfg.spec.enabled = bool(args.traces)
        model = FastModel(random_weights(qwen36_27b_config(), args.tier or "q4s", args.seed),
                          max_context=window, kv_dtype="bf16", chunk=cfg.engine.gpu_prefill_chunk)
        configure_memory(model, cfg.engine)  # the server's --max-slots auto at this window, and its weight cache
        model.enable_graphs(**graph_budgets(model, cfg.engine))  # and its graph budgets
        model.rt.warm_all()  # as load_fast_model: no compile inside a timed row
        if args.traces:
            from q27py.bench.trace_accept import TraceAcceptance, recorded_rounds

            model = TraceAcceptance(model, recorded_rounds(args.traces))
        engine = LocalEngine(cfg, model, Tokenizer.from_file(FULL_TOKENIZER))
        if args.traces and not args.engine_draft_widths:
            model.drive_widths(engine.decoder)  # each round offers its record's drafts (bench/trace_accept.py)
    else:
        if args.traces:
            raise SystemExit("bench load: --traces (recorded acceptance) is for --random-weights 27b")
        engine = LocalEngine.load(cfg)
    return run_load(engine, engine.tokenizer, streams, args.prompt_tokens, tokens, long_tokens or None,
                    mixed=not args.no_mixed, seed=args.seed, log=log, warm_full=not args.short_warm)


def _narrow(verify):
    return lambda ctx=2048, widths=(1, 8, 16): verify(ctx, widths)
