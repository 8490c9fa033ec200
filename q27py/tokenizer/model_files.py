"""Reading the tokenizer-related files of a model directory.

tokenizer.json (or tokenizer.json.gz), tokenizer_config.json (its eos_token) and
generation_config.json (eos_token_id: the ids that stop generation).
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
import zlib
from pathlib import Path

from q27py.errors import ConfigError, TokenizerError

TOKENIZER_FILENAMES = ("tokenizer.json", "tokenizer.json.gz")


@contextlib.contextmanager
def gc_paused():
    # Parsing a 248K-entry vocabulary creates ~2M objects; the cyclic collector would
    # rescan them over and over (it triples load time) although none can form a cycle.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def read_json(path: Path) -> dict:
    """A JSON object from a .json or .json.gz file; errors name the file."""
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz":
            raw = gzip.decompress(raw)
        with gc_paused():
            data = json.loads(raw)
    except FileNotFoundError:
        raise TokenizerError(f"{path}: file not found") from None
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
        raise TokenizerError(f"{path}: cannot read: {exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object at the top level")
    return data


def find_tokenizer_file(model_dir: str | Path) -> Path:
    model_dir = Path(model_dir)
    for name in TOKENIZER_FILENAMES:
        if (model_dir / name).is_file():
            return model_dir / name
    raise TokenizerError(f"{model_dir}: no {' or '.join(TOKENIZER_FILENAMES)} found")


def load_stop_ids(model_dir: str | Path) -> list[int]:
    """generation_config.json's eos_token_id (an int or a list) as a list; [] when absent."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    value = config.get("eos_token_id") if isinstance(config, dict) else None
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ConfigError(f"{path}: eos_token_id must be a token id or a list of ids, got {value!r}")
    return list(dict.fromkeys(values))


def config_eos_token(tokenizer_path: Path) -> str | None:
    """The eos_token string of the tokenizer_config.json beside a tokenizer file, if any."""
    path = tokenizer_path.parent / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path}: cannot read: {exc}") from None
    token = config.get("eos_token") if isinstance(config, dict) else None
    if isinstance(token, dict):  # older files store {"content": "...", ...}
        token = token.get("content")
    return token if isinstance(token, str) else None
