"""`q27py repack SRC_DIR OUT_FILE --tier NAME`: quantize a Hugging Face checkpoint into one .q27 file.

The tool code is tools/repack.py; this module is its CLI entry (no GPU needed).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from q27py.errors import Q27Error

TOOL = Path(__file__).resolve().parents[2] / "tools" / "repack.py"


def add_arguments(p) -> None:
    from q27py.io.q27file import TIERS

    p.add_argument("src", type=Path, help="Hugging Face checkpoint directory")
    p.add_argument("out", type=Path, help="output .q27 file")
    p.add_argument("--tier", choices=sorted(TIERS), default="q4s", help="weight tier (docs/QUANT.md; default q4s)")


def run(args) -> int:
    if not TOOL.exists():
        raise Q27Error(f"{TOOL} is missing (repack runs from a source checkout)")
    spec = importlib.util.spec_from_file_location("q27_repack_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.repack(args.src, args.out, args.tier)
    print(f"wrote {r['out']}: {r['tensors']} tensors, {r['bytes'] / 1e6:.1f} MB, tier {r['tier']}, {r['seconds']:.1f} s")
    return 0
