"""Repack a Hugging Face checkpoint into one .q27 file (docs/FORMAT.md), on the CPU.

    python3 tools/repack.py SRC_DIR OUT_FILE --tier q4s

Reads the checkpoint tensor by tensor (memory-mapped), quantizes and packs each fused matrix
with q27py.gpu.layout (the same bytes the GPU packer makes), and writes it at its planned
offset; peak memory is about one fused matrix in fp32.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def repack(src: Path, out: Path, tier: str, progress: bool = True) -> dict:
    from q27py.io.checkpoint import Checkpoint
    from q27py.io.q27file import write

    ckpt = Checkpoint.open(src)
    t0 = time.perf_counter()
    header = write(out, ckpt, tier, progress=progress)
    return {"out": str(out), "tier": tier, "tensors": len(header["tensors"]), "bytes": out.stat().st_size,
            "seconds": time.perf_counter() - t0}


def main(argv=None) -> int:
    from q27py.io.q27file import TIERS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tier", choices=sorted(TIERS), default="q4s")
    args = ap.parse_args(argv)
    r = repack(args.src, args.out, args.tier)
    print(f"wrote {r['out']}: {r['tensors']} tensors, {r['bytes'] / 1e6:.1f} MB, tier {r['tier']}, {r['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
