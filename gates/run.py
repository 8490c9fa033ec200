"""Bitwise canonical gates: fixed prompt, 128 greedy tokens on the CUDA fast path, md5 of the ids.

    python3 gates/run.py              # PASS / FAIL / NEW per gate for this GPU's arch
    python3 gates/run.py --update     # record NEW (missing) canonicals in gates/canonical.json
    python3 gates/run.py --only tiny  # gates whose name contains "tiny"

A canonical is keyed by (gate name = model + tier, GPU arch): it gates change, not identity
across arches. Any kernel change that moves a bit (summation order, split counts, flags)
flips these; if the change is intended, re-record with --update after deleting the entry,
and say so in docs/PERF.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from q27py import DEFAULT_MODEL_DIR  # noqa: E402 - after the path insert; a plain constant, no heavy import

BUNDLED = DEFAULT_MODEL_DIR.name  # tiny gates run the bundled default model and are named after it

CANONICAL = Path(__file__).resolve().parent / "canonical.json"
TOKENS = 128
TINY_PROMPT = "Write a Python function `flatten(items)`: Flatten a nested list into a flat list."
RANDOM_PROMPT = [9707, 11, 1879, 0, 248045, 872, 198, 1024, 4096, 77]

GATES = [
    {"name": f"{BUNDLED}/bf16", "model": "tiny", "tier": "bf16"},
    {"name": f"{BUNDLED}/q8", "model": "tiny", "tier": "q8"},
    {"name": f"{BUNDLED}/q4s", "model": "tiny", "tier": "q4s"},
    {"name": "random-27b-seed0/q4s", "model": "random-27b", "tier": "q4s"},
]


def greedy_ids(gate: dict) -> list[int]:
    from q27py.gpu.forward import FastModel
    from q27py.gpu.weights import from_checkpoint, random_weights

    if gate["model"] == "tiny":
        from q27py.bench.shortbench import chat_prompt
        from q27py.io.checkpoint import Checkpoint
        from q27py.tokenizer import Tokenizer

        weights = from_checkpoint(Checkpoint.open(DEFAULT_MODEL_DIR), gate["tier"], progress=False)
        prompt = Tokenizer.from_model_dir(DEFAULT_MODEL_DIR).encode(chat_prompt(TINY_PROMPT))
        kv = "f32" if gate["tier"] == "bf16" else "bf16"
    else:
        from q27py.model.config import qwen36_27b_config

        weights = random_weights(qwen36_27b_config(), gate["tier"], seed=0)
        prompt = list(RANDOM_PROMPT)
        kv = "bf16"
    model = FastModel(weights, max_context=len(prompt) + TOKENS + 16, kv_dtype=kv)
    model.enable_graphs()
    state = model.new_state()
    out = model.forward(state, prompt, logits_rows="last")
    tok = int(out.logits[-1].argmax())
    ids = [tok]
    while len(ids) < TOKENS:
        tok = int(model.forward(state, [tok]).logits[0].argmax())
        ids.append(tok)
    return ids


def md5_of(ids: list[int]) -> str:
    return hashlib.md5(",".join(str(i) for i in ids).encode()).hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--update", action="store_true", help="record missing canonicals")
    ap.add_argument("--only", default="", help="run gates whose name contains this")
    args = ap.parse_args(argv)
    from q27py.gpu.runtime import Runtime

    arch = Runtime.get().arch
    canon = json.loads(CANONICAL.read_text()) if CANONICAL.exists() else {}
    failed = 0
    for gate in GATES:
        if args.only not in gate["name"]:
            continue
        key = f"{gate['name']}@{arch}"
        digest = md5_of(greedy_ids(gate))
        want = canon.get(key, {}).get("md5")
        if want is None:
            verdict = "NEW"
            if args.update:
                canon[key] = {"md5": digest, "tokens": TOKENS}
        else:
            verdict = "PASS" if want == digest else "FAIL"
            failed += verdict == "FAIL"
        print(f"{verdict:4s} {key:40s} {digest}" + (f" (want {want})" if verdict == "FAIL" else ""), flush=True)
    if args.update:
        CANONICAL.write_text(json.dumps(canon, indent=1, sort_keys=True) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
