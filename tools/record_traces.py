"""Record real speculative round traces from a trained model (CPU), for `q27py bench spec-replay`.

Runs the held-out prompts of tools/spec_measure.py (6 chat tasks + 6 code prefixes, written for
that tool, not in the training data) through SpecDecoder with the default SpecConfig, greedy,
and writes per prompt the rounds as DecodeStats records them: drafter, drafts, accepted count,
verify lanes and MTP steps. The replay then runs exactly those round shapes on the 27B shapes.

    OMP_NUM_THREADS=1 python3 tools/record_traces.py [--model DIR] [--max-tokens 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    from spec_measure import prompts

    from q27py import DEFAULT_MODEL_DIR
    from q27py.config import Q27Config, apply_overrides
    from q27py.engine.api import SamplingParams
    from q27py.engine.decoder import DecodeStats
    from q27py.engine.engine import load_model
    from q27py.engine.spec import SpecDecoder
    from q27py.tokenizer import Tokenizer

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "q27py/bench/data/spec_traces.json")
    args = ap.parse_args(argv)
    cfg = Q27Config()
    apply_overrides(cfg.engine, {"model_dir": args.model, "device": "cpu"})
    model = load_model(cfg)
    tok = Tokenizer.from_model_dir(args.model)
    spec = cfg.spec
    spec.trace = True
    dec = SpecDecoder(model, spec, prefill_chunk=cfg.engine.prefill_chunk)
    out = {"model": args.model.name, "max_tokens": args.max_tokens, "spec": {k: getattr(spec, k) for k in
           ("max_verify_width", "max_depth", "suffix", "arbitration", "pause_after", "pause_probe_every")}, "prompts": []}
    for name, ids in prompts(tok):
        st = model.new_state()
        stats = DecodeStats(record_trace=True)
        t0 = time.perf_counter()
        gen = [t for chunk in dec.run(st, ids, args.max_tokens, SamplingParams(), frozenset(), stats=stats) for t in chunk]
        d = stats.as_dict()
        out["prompts"].append({"name": name, "prompt_tokens": len(ids), "generated": len(gen),
                               "tokens_per_round": d["tokens_per_round"], "rounds": stats.trace})
        print(f"{name:28s} {len(gen):4d} tokens  {d['tokens_per_round']:.2f}/round  {time.perf_counter() - t0:.1f} s",
              flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=0))
    total = sum(p["generated"] for p in out["prompts"])
    rounds = sum(len(p["rounds"]) for p in out["prompts"])
    print(f"{total} tokens in {rounds} rounds = {total / rounds:.2f} tokens/round -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
