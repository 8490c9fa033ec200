"""Engine flags shared by `generate`, `serve` and the benches: model, device, tier, speculation, prefix cache.

Flags map into q27py/config.py's dataclasses here, once; an absent flag (None)
leaves the environment's or the default value.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_engine_arguments(p: argparse.ArgumentParser, *, serving: bool = False) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="Hugging Face checkpoint directory or repacked .q27 file (default: the bundled q36-tiny-agent, or $Q27_MODEL)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="cpu = numpy; cuda = CuPy kernels")
    p.add_argument("--backend", choices=["auto", "fast", "reference"], default=None,
                   help="fast path or the numpy reference (the specification); auto = fast (cpu: when --dtype is float32)")
    p.add_argument("--dtype", choices=["float32", "float64", "bfloat16"], default=None, help="reference-path compute dtype")
    p.add_argument("--tier", choices=["bf16", "q8", "q5f", "q4s"], default=None,
                   help="cuda: quantize a bf16 checkpoint on load to this tier (docs/QUANT.md)")
    p.add_argument("--max-context", type=_max_context, metavar="N|auto", default=None,
                   help="tokens per sequence (prompt + output); auto (default): on cuda the window free memory "
                        "holds, reported at start; on cpu 32768")
    p.add_argument("--kv", type=_kv, metavar="FORMAT", default=None,
                   help="KV cache format: auto | bf16 | fp8 | k5v3 | k3v3 (docs/KV.md); auto picks per GPU arch")
    spec = p.add_argument_group("speculative decoding (output is identical either way; only speed changes)")
    spec.add_argument("--spec", action=argparse.BooleanOptionalAction, default=None,
                      help="speculate (default: on when the checkpoint has an MTP head)")
    spec.add_argument("--max-depth", type=int, default=None, help="MTP draft ladder depth ceiling, 1..7")
    spec.add_argument("--suffix", action=argparse.BooleanOptionalAction, default=None,
                      help="suffix drafter (copies earlier continuations of the context tail)")
    if serving:
        pre = p.add_argument_group("prefix reuse")
        pre.add_argument("--prefix-cache", type=Path, metavar="DIR", default=None,
                         help="persistent prefix cache directory (opt-in; token-verified, survives restarts)")
        pre.add_argument("--prefix-cache-gb", type=float, default=None, help="size cap of --prefix-cache (LRU)")
        pre.add_argument("--checkpoint-every", type=int, metavar="N", default=None,
                         help="save GDN state every N prefill tokens so edited history rewinds there (0 = off)")
        pre.add_argument("--checkpoint-min-piece", type=int, metavar="N", default=None,
                         help="a checkpoint that would cut a prefill piece under N tokens is taken at the "
                              "nearest boundary instead (resume point, prompt end, system / stable mark; "
                              "default 128, 0 = off)")
        pre.add_argument("--max-sequences", type=int, metavar="N", default=None,
                         help="live sequences kept for reuse (at least --max-slots)")
        p.add_argument("--max-slots", type=_max_slots, metavar="N|auto", default=None,
                       help="requests generating at once, interleaved round by round; the rest queue "
                            "(auto: 4 on cpu; on cuda sized from free memory, 2..8; 1 = one at a time, FIFO)")


def _max_context(value: str):
    from q27py.config import parse_max_context

    try:
        return parse_max_context(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _max_slots(value: str):
    from q27py.config import parse_max_slots

    try:
        return parse_max_slots(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv(value: str) -> str:
    from q27py.config import parse_kv

    try:
        return parse_kv(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def apply_engine_arguments(cfg, args) -> None:
    from q27py.config import apply_overrides

    get = lambda name: getattr(args, name, None)  # noqa: E731 - flags a command did not add stay None
    apply_overrides(cfg.engine, {
        "model_dir": get("model"), "device": get("device"), "backend": get("backend"), "dtype": get("dtype"), "tier": get("tier"),
        "max_context": get("max_context"), "kv": get("kv"), "prefix_cache_dir": get("prefix_cache"),
        "prefix_cache_max_bytes": int(get("prefix_cache_gb") * (1 << 30)) if get("prefix_cache_gb") else None,
        "checkpoint_every": get("checkpoint_every"), "checkpoint_min_piece": get("checkpoint_min_piece"),
        "max_sequences": get("max_sequences"),
        "max_slots": get("max_slots"),
    })
    apply_overrides(cfg.spec, {"enabled": get("spec"), "max_depth": get("max_depth"), "suffix": get("suffix")})
