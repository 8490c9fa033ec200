"""Time the tokenizer: load, encode a ~100 KB code prompt (cold and warm cache), decode.

    python3 tools/tokenizer_speed.py [--tokenizer PATH_OR_MODEL_DIR] [--text FILE] [--kb 100]

Defaults to the real 248K vocabulary bundled in q27py/data/tokenizers and a
prompt cut from this Python's standard-library sources (real code, deterministic).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from q27py.tokenizer import Tokenizer  # noqa: E402

DEFAULT_TOKENIZER = REPO / "q27py" / "data" / "tokenizers" / "qwen36-full.tokenizer.json.gz"  # bundled real vocabulary


def code_prompt(n_bytes: int) -> str:
    """Real Python code of about n_bytes, taken from standard-library modules in a fixed order."""
    import argparse as m1, dataclasses as m2, inspect as m3, json.decoder as m4, typing as m5  # noqa: E401

    text = ""
    for module in (m1, m2, m3, m4, m5):
        text += inspect.getsource(module)
        if len(text.encode()) >= n_bytes:
            break
    return text.encode()[:n_bytes].decode("utf-8", errors="ignore")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER, help="tokenizer.json(.gz) or model dir")
    parser.add_argument("--text", type=Path, help="encode this file instead of the standard-library prompt")
    parser.add_argument("--kb", type=int, default=100, help="prompt size in KB (default 100)")
    args = parser.parse_args()

    t0 = time.perf_counter()
    if args.tokenizer.is_dir():
        tok = Tokenizer.from_model_dir(args.tokenizer)
    else:
        tok = Tokenizer.from_file(args.tokenizer)
    t_load = time.perf_counter() - t0

    text = args.text.read_text(encoding="utf-8") if args.text else code_prompt(args.kb * 1000)
    t0 = time.perf_counter()
    ids = tok.encode(text)
    t_cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok.encode(text)
    t_warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    decoded = tok.decode(ids)
    t_decode = time.perf_counter() - t0

    n_bytes = len(text.encode())
    print(f"tokenizer      {args.tokenizer} (vocab_size {tok.vocab_size})")
    print(f"load           {t_load:.3f} s")
    print(f"prompt         {n_bytes} bytes -> {len(ids)} tokens ({n_bytes / len(ids):.2f} bytes/token)")
    print(f"encode (cold)  {t_cold:.3f} s  ({n_bytes / t_cold / 1e6:.2f} MB/s)")
    print(f"encode (warm)  {t_warm:.3f} s  ({n_bytes / t_warm / 1e6:.2f} MB/s)")
    print(f"decode         {t_decode:.3f} s  round trip {'ok' if decoded == text else 'DIFFERS (NFC?)'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
