"""Parsing a request body and its scalar fields, with 400s that name the offending field."""

from __future__ import annotations

import json
import math
from typing import Any

from q27py.server.errors import ApiError, bad_request

_MISSING = object()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes, content_encoding: str | None = None) -> dict:
    """The body as a JSON object, or a 400 saying exactly what is wrong with it."""
    if content_encoding and content_encoding.strip().lower() not in ("identity", ""):
        raise ApiError(415, f"Content-Encoding {content_encoding!r} is not supported; send the body uncompressed")
    if not raw.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (byte {exc.start})") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, not {json_type(body)}")
    if "\\ud" in text or "\\uD" in text:  # lone surrogates parse but cannot be encoded or tokenized
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request("request body contains an unpaired UTF-16 surrogate escape") from None
    return body


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


class Fields:
    """Typed access to a request body's fields; `None` counts as absent. `prefix` names a
    nested object in messages ("reasoning." -> "reasoning.effort: ...")."""

    def __init__(self, body: dict, prefix: str = ""):
        self.body = body
        self.prefix = prefix

    def present(self, key: str) -> bool:
        return self.body.get(key) is not None

    def string(self, key: str, *, required: bool = False, default: str | None = None,
               choices: tuple[str, ...] | None = None) -> str | None:
        value = self.body.get(key)
        if value is None:
            if required:
                raise bad_request(f"{self.prefix}{key}: field required", self.prefix + key)
            return default
        if not isinstance(value, str):
            raise bad_request(f"{self.prefix}{key}: expected a string, got {json_type(value)}", self.prefix + key)
        if choices is not None and value not in choices:
            raise bad_request(f"{self.prefix}{key}: must be one of {', '.join(choices)} (got {value!r})", self.prefix + key)
        return value

    def boolean(self, key: str, default: bool | None = None) -> bool | None:
        value = self.body.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad_request(f"{self.prefix}{key}: expected a boolean, got {json_type(value)}", self.prefix + key)
        return value

    def integer(self, key: str, *, required: bool = False, minimum: int | None = None,
                maximum: int | None = None, default: int | None = None) -> int | None:
        value = self.body.get(key)
        if value is None:
            if required:
                raise bad_request(f"{self.prefix}{key}: field required", self.prefix + key)
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad_request(f"{self.prefix}{key}: expected an integer, got {json_type(value)}", self.prefix + key)
        _check_range(self.prefix + key, value, minimum, maximum)
        return value

    def number(self, key: str, *, minimum: float | None = None, maximum: float | None = None,
               default: float | None = None) -> float | None:
        value = self.body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad_request(f"{self.prefix}{key}: expected a number, got {json_type(value)}", self.prefix + key)
        _check_range(self.prefix + key, value, minimum, maximum)
        return float(value)

    def obj(self, key: str) -> dict | None:
        value = self.body.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise bad_request(f"{self.prefix}{key}: expected an object, got {json_type(value)}", self.prefix + key)
        return value

    def stop_list(self, key: str, *, max_items: int = 16, strict: bool = True) -> tuple[str, ...]:
        """A stop field: a string or a list of strings. `strict`: at most max_items, none empty
        (the chat APIs have always taken any list; empty stops are ignored there)."""
        value = self.body.get(key)
        if value is None:
            return ()
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list):
            raise bad_request(f"{self.prefix}{key}: expected a string or a list of strings", self.prefix + key)
        for i, item in enumerate(items):
            if not isinstance(item, str):
                where = f"{self.prefix}{key}[{i}]"
                raise bad_request(f"{where}: expected a string, got {json_type(item)}", where)
        if not strict:
            return tuple(items)
        if len(items) > max_items:
            raise bad_request(f"{self.prefix}{key}: at most {max_items} stop sequences are supported", self.prefix + key)
        if any(s == "" for s in items):
            raise bad_request(f"{self.prefix}{key}: stop sequences must not be empty", self.prefix + key)
        return tuple(items)


def _check_range(key: str, value, minimum, maximum) -> None:
    if minimum is not None and value < minimum:
        raise bad_request(f"{key}: must be >= {minimum} (got {value})", key)
    if maximum is not None and value > maximum:
        raise bad_request(f"{key}: must be <= {maximum} (got {value})", key)
