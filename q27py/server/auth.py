"""API keys: loading (flag, file, env) and constant-time checking of a request's key.

Clients present the key as `Authorization: Bearer K` (OpenAI SDKs, Codex with
env_key, Claude Code with ANTHROPIC_AUTH_TOKEN) or `x-api-key: K` (Anthropic
SDK, Claude Code with ANTHROPIC_API_KEY); both are accepted everywhere.

The rule when a request carries both (docs/SERVER.md): it is allowed when either
presented key is valid. A wrong Bearer token beside a right x-api-key passes, and
so does the reverse: the client holds a valid key either way, and SDKs or proxies
that add an Authorization header of their own must not lock out the x-api-key
the user configured. Every presented key is compared with every configured key,
with no early exit.
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

    def presented_keys(self, headers: dict[str, str]) -> list[str]:
        """The keys a request presents: the Bearer token and/or x-api-key (in that order)."""
        keys = []
        scheme, _, token = headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            keys.append(token.strip())
        key = headers.get("x-api-key", "").strip()
        if key:
            keys.append(key)
        return keys

    def presented_key(self, headers: dict[str, str]) -> str | None:
        keys = self.presented_keys(headers)
        return keys[0] if keys else None

    def allows(self, headers: dict[str, str]) -> bool:
        """True when any presented key is a configured key (the module docstring's rule)."""
        if not self._digests:
            return True
        ok = False
        for key in self.presented_keys(headers):
            candidate = _digest(key)
            for digest in self._digests:  # no early exit: every key is compared
                ok |= hmac.compare_digest(candidate, digest)
        return ok
