"""Benchmarks (random-weight 27B shapes, probes, load, replay) and what their tools share."""

from __future__ import annotations

import json
import os
from pathlib import Path


def save_json(obj, path: str | None, name: str) -> str | None:
    """Write a tool's results: to `path` (its --json), else to $OUT/name when a device call's $OUT is set (what
    comes back from the device), else nowhere. Returns the path written."""
    path = path or (os.path.join(os.environ["OUT"], name) if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(obj, indent=1))
    return path
