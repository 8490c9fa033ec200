"""Measure self-speculative decoding on the bundled model: tokens per round, acceptance by depth.

Runs held-out code prompts (the bundled model was trained on Python package
sources excluding sklearn and scipy; these prompts are written for this tool)
through the plain decoder and through SpecDecoder under several SpecConfigs,
checks every speculative output equals plain decoding's, and prints one
markdown table row per configuration (the source of docs/PERF.md's numbers).

    OMP_NUM_THREADS=1 python3 tools/spec_measure.py [--max-tokens 96] [--sweep default|full|grid] [--json out.json]

Columns: tokens/round = generated / rounds as `stats.tokens_per_round` counts
them (the prefill is round one); tok/verify = tokens per verify round (after the
prefill); lanes/tok = main-model token rows per generated token after the
prefill (the verify work; 1.00 for plain decoding); mtp/tok = MTP layer passes
per generated token; acc@k = share of drafts proposed at depth k that were
accepted; share = rounds by drafter (mtp / suffix / none); H200 ms/tok = the
decode time per token these rounds would take on the CUDA path, priced with that
path's measured costs (docs/PERF.md, "CUDA fast path", run 11, q4s, 2K context:
verify round time by width, MTP step time), a model, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from q27py import DEFAULT_MODEL_DIR  # noqa: E402
from q27py.config import SpecConfig  # noqa: E402
from q27py.engine.api import SamplingParams  # noqa: E402
from q27py.engine.decoder import DecodeStats, Decoder  # noqa: E402
from q27py.engine.spec import SpecDecoder  # noqa: E402
from q27py.model.reference import ReferenceModel  # noqa: E402
from q27py.tokenizer import Tokenizer  # noqa: E402

# docs/PERF.md "CUDA fast path" (run 11, tier q4s, context 2K, H200): one verify round of W
# lanes (W=1 is a plain decode step) and one MTP draft step, in ms.
H200_VERIFY_MS = dict(enumerate([8.67, 9.07, 9.59, 10.06, 10.45, 10.89, 11.28, 11.66,
                                 16.65, 17.11, 17.47, 18.14, 18.69, 19.10, 19.57, 20.23], start=1))
H200_MTP_STEP_MS = 0.484

CHAT = "<|im_start|>user\nWrite a Python function `{}`: {}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"

CHAT_TASKS = [
    ("merge_intervals(intervals)", "Merge overlapping intervals and return them sorted by start."),
    ("word_frequencies(text)", "Count how often each word occurs in a text, ignoring case and punctuation."),
    ("rotate_matrix(matrix)", "Rotate a square matrix by 90 degrees clockwise and return the new matrix."),
    ("parse_duration(spec)", "Parse a duration like '1h30m' or '45s' into a number of seconds."),
    ("binary_search(items, target)", "Return the index of target in the sorted list items, or -1."),
    ("chunked(iterable, size)", "Yield successive lists of at most size items from an iterable."),
]

CODE_PREFIXES = [
    "class LRUCache:\n    \"\"\"A fixed-size cache that evicts the least recently used entry.\"\"\"\n\n"
    "    def __init__(self, capacity):\n        self.capacity = capacity\n        self._data = {}\n\n"
    "    def get(self, key, default=None):\n",
    "import json\nfrom pathlib import Path\n\n\ndef load_settings(path):\n    \"\"\"Read a JSON settings file, "
    "filling in defaults for missing keys.\"\"\"\n    defaults = {\"verbose\": False, \"retries\": 3, \"timeout\": 10.0}\n",
    "def tokenize(source):\n    \"\"\"Split an arithmetic expression into numbers, operators and parentheses.\"\"\"\n"
    "    tokens = []\n    i = 0\n    while i < len(source):\n        ch = source[i]\n",
    "from dataclasses import dataclass, field\n\n\n@dataclass\nclass Order:\n    order_id: int\n    customer: str\n"
    "    items: list = field(default_factory=list)\n    paid: bool = False\n\n    def total(self):\n",
    "import argparse\n\n\ndef build_parser():\n    parser = argparse.ArgumentParser(description=\"Resize images in a folder.\")\n"
    "    parser.add_argument(\"folder\", help=\"input folder\")\n    parser.add_argument(\"--width\", type=int, default=800, help=\"target width\")\n",
    "class Vector:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "    def __add__(self, other):\n        return Vector(self.x + other.x, self.y + other.y)\n\n    def __sub__(self, other):\n",
]


def prompts(tok) -> list[tuple[str, list[int]]]:
    out = [(f"chat:{name.split('(')[0]}", tok.encode(CHAT.format(name, desc))) for name, desc in CHAT_TASKS]
    out += [(f"code:{i}", tok.encode(p)) for i, p in enumerate(CODE_PREFIXES)]
    return out


def sweep(kind: str) -> dict[str, SpecConfig]:
    base = SpecConfig()
    mtp = replace(base, suffix=False)
    configs = {
        "default (mtp + suffix, agree)": base,
        "mtp only": mtp,
        "mtp + suffix, suffix_first": replace(base, arbitration="suffix_first"),
        "mtp only, fixed depth 7": replace(mtp, max_depth=7, adaptive_depth=False),
        "mtp + suffix, fixed depth 7": replace(base, max_depth=7, adaptive_depth=False),
    }
    if kind == "grid":
        return {f"depth {d}, width {w}, {arb}": replace(base, max_depth=d, max_verify_width=w, arbitration=arb)
                for d in (2, 3, 5, 7) for w in (8, 12, 16) for arb in ("agree", "suffix_first")}
    if kind == "full":
        for d in (1, 2, 3, 4, 5):
            configs[f"mtp only, fixed depth {d}"] = replace(mtp, max_depth=d, adaptive_depth=False)
        for d in (3, 5, 7):
            configs[f"mtp only, adaptive max {d}"] = replace(mtp, max_depth=d)
        for m in (0.5, 1.0, 2.0):
            configs[f"mtp only, adaptive 7, gate {m}"] = replace(mtp, max_depth=7, confidence_margin=m)
            configs[f"mtp + suffix, gate {m}"] = replace(base, confidence_margin=m)
        for n in (2, 8, 12):
            configs[f"mtp + suffix, min match {n}"] = replace(base, suffix_min_match=n)
        for w in (4, 12, 16):
            configs[f"mtp + suffix, width {w}"] = replace(base, max_verify_width=w)
    return configs


def measure(model, decoder, cases, max_tokens, sampling, plain_outputs=None) -> dict:
    total = DecodeStats()
    per_case, t0, modeled_ms = [], time.perf_counter(), 0.0
    for i, (name, ids) in enumerate(cases):
        stats = DecodeStats(record_trace=True)
        out = [t for chunk in decoder.run(model.new_state(), ids, max_tokens, sampling, frozenset(), None, stats) for t in chunk]
        if plain_outputs is not None and out != plain_outputs[i]:
            raise SystemExit(f"speculative output differs from plain decoding on {name}")
        per_case.append(out)
        _accumulate(total, stats)
        modeled_ms += sum(H200_VERIFY_MS[1 + len(r["drafts"])] for r in stats.trace[1:]) + stats.mtp_steps * H200_MTP_STEP_MS
    seconds = time.perf_counter() - t0
    d = total.as_dict()
    verify_rounds = total.rounds - len(cases)
    decode_tokens = total.generated - len(cases)
    return {
        "outputs": per_case,
        "generated": total.generated,
        "rounds": total.rounds,
        "tokens_per_round": d["tokens_per_round"],
        "tokens_per_verify_round": decode_tokens / verify_rounds if verify_rounds else 0.0,
        "lanes_per_token": total.lanes / decode_tokens if decode_tokens else 0.0,
        "mtp_steps_per_token": total.mtp_steps / decode_tokens if decode_tokens else 0.0,
        "acceptance_by_depth": d["acceptance_by_depth"],
        "acceptance_by_depth_by_source": d["acceptance_by_depth_by_source"],
        "share_by_source": d["share_by_source"],
        "tokens_per_s_cpu": total.generated / seconds,
        "h200_model_ms_per_token": modeled_ms / decode_tokens if decode_tokens else 0.0,
    }


def _accumulate(total: DecodeStats, s: DecodeStats) -> None:
    total.rounds += s.rounds
    total.generated += s.generated
    total.lanes += s.lanes
    total.mtp_steps += s.mtp_steps
    for src, n in s.rounds_by_source.items():
        total.rounds_by_source[src] += n
    for src in ("mtp", "suffix"):
        for table, add in ((total.drafted_by_depth[src], s.drafted_by_depth[src]), (total.accepted_by_depth[src], s.accepted_by_depth[src])):
            while len(table) < len(add):
                table.append(0)
            for k, v in enumerate(add):
                table[k] += v


def row(name: str, r: dict) -> str:
    acc = " ".join(f"{a:.2f}" for a in r["acceptance_by_depth_by_source"]["mtp"]) or "-"
    sacc = " ".join(f"{a:.2f}" for a in r["acceptance_by_depth_by_source"]["suffix"][:4]) or "-"
    share = r["share_by_source"]
    return (f"| {name} | {r['tokens_per_round']:.2f} | {r['tokens_per_verify_round']:.2f} | {r['lanes_per_token']:.2f} | "
            f"{r['mtp_steps_per_token']:.2f} | {acc} | {sacc} | {share['mtp']:.2f} / {share['suffix']:.2f} / {share['none']:.2f} | "
            f"{r['tokens_per_s_cpu']:.0f} | {r['h200_model_ms_per_token']:.2f} |")


HEADER = ("| config | tokens/round | tok/verify | lanes/tok | mtp/tok | MTP acc@1..k | suffix acc@1..4 "
          "| share mtp/suffix/none | CPU tok/s | H200 ms/tok (model) |\n"
          "|---|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--sweep", choices=["default", "full", "grid"], default="default",
                   help="default: the PERF.md tables; full: depth, gate, min match, width; grid: depth x width x arbitration")
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled (seeded), checked against plain sampling too")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write every number here")
    args = p.parse_args(argv)
    if os.environ.get("OMP_NUM_THREADS") is None:
        print("note: OMP_NUM_THREADS is unset; the CPU tok/s column depends on it", file=sys.stderr)
    model = ReferenceModel.load(DEFAULT_MODEL_DIR)
    tok = Tokenizer.from_model_dir(DEFAULT_MODEL_DIR)
    cases = prompts(tok)
    sampling = SamplingParams(temperature=args.temperature, seed=args.seed)
    plain = measure(model, Decoder(model), cases, args.max_tokens, sampling)
    results = {"plain": plain}
    print(f"{len(cases)} prompts x {args.max_tokens} tokens, temperature {args.temperature}\n")
    print(HEADER)
    print(row("plain decoding", plain))
    for name, cfg in sweep(args.sweep).items():
        r = measure(model, SpecDecoder(model, cfg), cases, args.max_tokens, sampling, plain["outputs"])
        results[name] = dict(r, config=asdict(cfg))
        print(row(name, r), flush=True)
    if args.json is not None:
        for r in results.values():
            r.pop("outputs", None)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
