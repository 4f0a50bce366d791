"""One JSON -> frozen-dataclass rule for every config: unknown keys are an error, not ignored."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def from_dict_strict(cls: type[T], d: dict[str, Any], error: type[Exception], what: str) -> T:
    """``cls(**d)``, refusing keys ``cls`` lacks (a typo or a newer file must not load silently)."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(d) - known
    if unknown:
        raise error(f"unknown {what} {sorted(unknown)}; known: {sorted(known)}")
    return cls(**d)
