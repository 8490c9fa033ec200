"""Where a warm agent turn's time goes (device call): replay a session on the 27B random-weight
fast path and cProfile the warm turns. Host functions that wait on the GPU (cupy .get, synchronize)
absorb the device time; everything else is host work.

    PYTHONPATH=. python3 tools/profile_warm_turn.py [--turns 8] [--system-tokens 20000]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    from q27py.bench.replay import encode_turn, first_token, session
    from q27py.config import Q27Config, apply_overrides
    from q27py.engine.engine import LocalEngine
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import random_weights
    from q27py.model.config import qwen36_27b_config
    from q27py.model.tiny import FULL_TOKENIZER
    from q27py.tokenizer import Tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=20000)
    args = ap.parse_args()
    cfg = Q27Config()
    apply_overrides(cfg.engine, {"device": "cuda", "tier": "q4s", "max_context": args.system_tokens + 2048 * args.turns + 4096})
    model = FastModel(random_weights(qwen36_27b_config(), "q4s", 0), max_context=cfg.engine.max_context, kv_dtype="bf16",
                      chunk=cfg.engine.gpu_prefill_chunk)
    model.enable_graphs()
    tok = Tokenizer.from_file(FULL_TOKENIZER)
    engine = LocalEngine(cfg, model, tok)
    turns = [encode_turn(tok, m, t) for m, t in session(args.system_tokens, args.turns, tok, 0)]
    print("turn 1", first_token(engine, *turns[0]), flush=True)
    print("turn 2", first_token(engine, *turns[1]), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for i, (ids, stable) in enumerate(turns[2:], start=3):
        print(f"turn {i}", first_token(engine, ids, stable), flush=True)
    prof.disable()
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(28)
        print(s.getvalue()[-6000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
