"""Exceptions that carry a message meant for the user (CLI prints them without a traceback)."""


class Q27Error(Exception):
    """Base class for errors with a user-facing message."""


class ConfigError(Q27Error):
    """An unsupported or inconsistent model config; the message names the field."""


class CheckpointError(Q27Error):
    """A missing, unexpected, misshaped or unreadable tensor; the message names it."""


class TokenizerError(Q27Error):
    """An unreadable or unsupported tokenizer.json."""
