"""One error hierarchy for lowbit.

Every message says what was wrong and what to do about it. The CLI turns any
``LowbitError`` into one line on stderr and a non-zero exit, so a message must
stand on its own without a traceback.
"""

from __future__ import annotations


class LowbitError(Exception):
    """Base of every error lowbit raises on purpose (bad input, bad files)."""

    exit_code = 2


class SchemeError(LowbitError, ValueError):
    """A scheme name or parameter that lowbit cannot express."""


class ModelError(LowbitError):
    """A model source that cannot be loaded or has no decoder blocks."""


class DataError(LowbitError):
    """A text source that is missing, empty, or too short."""


class CheckpointError(LowbitError):
    """A checkpoint that is missing, truncated, corrupted, or mismatched."""


class ConfigError(LowbitError, ValueError):
    """A configuration value out of range, or a resume with different settings."""


class NonFiniteError(LowbitError):
    """A tensor lowbit was about to write (or a weight it was asked to quantize) holds NaN or inf."""


def did_you_mean(word: str, choices: object) -> str:
    """`` (did you mean X?)`` for the closest of ``choices`` to a mistyped ``word``, else ``""``.

    Messages name the fix; for a typo the fix is usually one of a few names away.
    """
    import difflib

    close = difflib.get_close_matches(word.lower(), [str(c) for c in choices], n=1, cutoff=0.6)  # type: ignore[attr-defined]
    return f" (did you mean {close[0]}?)" if close else ""
