"""Quasar (q27py): a single-GPU inference engine and server for Qwen3.6/3.8-27B-MTP."""

from pathlib import Path

__version__ = "0.1.0"

PACKAGE_DIR = Path(__file__).resolve().parent
DEFAULT_MODEL_DIR = PACKAGE_DIR / "data" / "models" / "q36-tiny-agent"
