"""API keys: loading (flag, file, env) and constant-time checking of a request's key.

Clients present the key as `Authorization: Bearer K` (OpenAI SDKs, Codex with
env_key, Claude Code with ANTHROPIC_AUTH_TOKEN) or `x-api-key: K` (Anthropic
SDK, Claude Code with ANTHROPIC_API_KEY); both are accepted everywhere.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from q27py.errors import ConfigError


def load_key_file(path: Path | str) -> list[str]:
    """One key per line; blank lines and `#` comments are skipped. An empty file is an error:
    a server the operator meant to protect must not silently start open."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read API key file {path}: {exc.strerror or exc}") from exc
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ConfigError(f"API key file {path} holds no keys")
    return keys


def validate_keys(keys: list[str]) -> list[str]:
    for key in keys:
        if not key or key != key.strip() or any(c.isspace() for c in key):
            raise ConfigError("an API key must be non-empty and contain no whitespace")
    return keys


def _digest(value: str) -> bytes:
    # Comparing fixed-length digests keeps the comparison time independent of key length.
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


class KeyRing:
    def __init__(self, keys: list[str] | None = None):
        self._digests = [_digest(k) for k in validate_keys(list(keys or []))]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def presented_key(self, headers: dict[str, str]) -> str | None:
        auth = headers.get("authorization", "")
        scheme, _, token = auth.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        key = headers.get("x-api-key", "").strip()
        return key or None

    def allows(self, headers: dict[str, str]) -> bool:
        if not self._digests:
            return True
        key = self.presented_key(headers)
        if key is None:
            return False
        candidate = _digest(key)
        ok = False
        for digest in self._digests:  # no early exit: every key is compared
            ok |= hmac.compare_digest(candidate, digest)
        return ok
