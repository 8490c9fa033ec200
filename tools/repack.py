"""Repack a Hugging Face checkpoint into one .q27 file (docs/FORMAT.md), on the CPU.

    python3 tools/repack.py SRC_DIR OUT_FILE --tier q4s

Reads the checkpoint tensor by tensor (memory-mapped), quantizes and packs each fused matrix
with q27py.gpu.layout (the same bytes the GPU packer makes; q27py/gpu/q27pack.py), and writes it
blob by blob; peak memory is about one fused matrix in fp32.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def repack(src: Path, out: Path, tier: str, progress: bool = True) -> dict:
    from q27py.io.checkpoint import Checkpoint
    from q27py.gpu.q27pack import write

    ckpt = Checkpoint.open(src)
    t0 = time.perf_counter()
    copied = copy_tokenizer_files(src, out.parent)  # first: a conflict should cost no repack time
    header = write(out, ckpt, tier, progress=progress)
    return {"out": str(out), "tier": tier, "tensors": len(header["tensors"]), "bytes": out.stat().st_size,
            "seconds": time.perf_counter() - t0, "tokenizer_files": copied}


# The .q27 container holds weights only; the engine reads these from the file's folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def copy_tokenizer_files(src: Path, dest: Path) -> list[str]:
    """Copy the tokenizer / generation / template files beside the .q27 file (never overwrite a different one)."""
    import shutil

    from q27py.errors import CheckpointError

    copied = []
    for name in TOKENIZER_FILES:
        a, b = Path(src) / name, Path(dest) / name
        if not a.exists() or a.resolve() == b.resolve():
            continue
        if b.exists():
            if a.read_bytes() != b.read_bytes():
                raise CheckpointError(f"{b} exists and differs from {a}: put the .q27 file in its own folder")
            continue
        shutil.copyfile(a, b)
        copied.append(name)
    return copied


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
