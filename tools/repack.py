"""Repack a Hugging Face checkpoint into one .q27 file (docs/FORMAT.md), on the CPU.

    python3 tools/repack.py SRC_DIR OUT_FILE --tier q4s

A thin wrapper: the logic is q27py/commands/repack.py (`q27py repack` runs the same code).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from q27py.commands.repack import add_arguments, copy_tokenizer_files, repack, run  # noqa: E402

__all__ = ["copy_tokenizer_files", "repack"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
