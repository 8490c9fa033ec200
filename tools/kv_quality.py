"""KV format quality harness (numpy reference on the CPU): per-position loss and KL against the
bf16-KV run, catastrophic positions, needle retrieval, and 27B capacity per format.

    PYTHONPATH=. python3 tools/kv_quality.py [--tokens 2048] [--needle-tokens 4096] [--json] [--markdown]

See q27py/bench/kv_quality.py for what is measured and on which text; docs/KV.md has the results.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from q27py.bench import kv_quality  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, action="append", help="model directory (repeatable; default both tiny models)")
    p.add_argument("--tokens", type=int, default=2048, help="scored positions per corpus")
    p.add_argument("--needle-tokens", type=int, default=4096, help="needle haystack length (0 = skip)")
    p.add_argument("--formats", default=",".join(kv_quality.LOSSY), help="lossy formats to compare with bf16")
    p.add_argument("--needle-only", action="store_true", help="skip the per-position corpora")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--markdown", action="store_true", help="print the docs/KV.md tables")
    args = p.parse_args(argv)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731
    result = kv_quality.run(models=args.model or kv_quality.MODELS, tokens=args.tokens,
                            needle_tokens=args.needle_tokens, formats=tuple(args.formats.split(",")), log=log,
                            corpora=not args.needle_only)
    if args.json:
        print(json.dumps(result, indent=1))
    if args.markdown or not args.json:
        print(kv_quality.markdown(result))
    log(f"total {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
