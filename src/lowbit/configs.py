"""One JSON -> frozen-dataclass rule for every config, and one check of its numbers.

Unknown keys are an error, not ignored (`from_dict_strict`). Every config and job
dataclass also calls `check_fields` first thing in ``__post_init__``: a value of the
wrong kind (a ``group_size`` of 32.5 from a plan file, a string where a switch belongs)
or a float that is not finite (``--lr inf``, ``--scale nan``) is refused there, in one
line naming the field, before any range check of the class itself runs. NaN slips
through most range checks (``nan > 0`` and ``nan <= 0`` are both false), which is why
finiteness is checked once, here, for every float field of every config.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")

_SIMPLE = ("int", "float", "bool", "str", "None")


def from_dict_strict(cls: type[T], d: dict[str, Any], error: type[Exception], what: str) -> T:
    """``cls(**d)``, refusing keys ``cls`` lacks (a typo or a newer file must not load silently)."""
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(d) - known
    if unknown:
        raise error(f"unknown {what} {sorted(unknown)}; known: {sorted(known)}")
    return cls(**d)


def check_fields(obj: Any, error: type[Exception], what: str = "setting",
                 names: Mapping[str, str] | None = None, ranged: tuple[str, ...] = ()) -> None:
    """Refuse a field of the dataclass ``obj`` whose value is not of its annotated simple type.

    Fields annotated with ``int``, ``float``, ``bool``, ``str`` (optionally ``| None``) or
    ``tuple[float, ...]`` are checked; others (paths, nested configs, ``Any``) are left to
    their class. ints must be integers (a whole-number float such as 32.0 from JSON
    becomes the int 32), floats finite real numbers, bools True / False (not 0 / 1 /
    "no"). ``names`` maps a field to the spelling users write (a flag, a scheme key);
    ``ranged``: float fields whose range the class checks itself, with a message naming
    that range (NaN and inf included): only their kind is checked here.
    """
    for name, kinds in _checked_fields(type(obj)):
        value = getattr(obj, name)
        label = f"{what} {(names or {}).get(name, name)}"
        fixed = _checked(value, kinds, label, error, finite=name not in ranged)
        if fixed is not value:
            object.__setattr__(obj, name, fixed)


@functools.cache
def _checked_fields(cls: type) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(field, simple kinds) of every field of ``cls`` this module checks (worked out once per class)."""
    out = []
    for f in dataclasses.fields(cls):
        kinds = _kinds(f.type if isinstance(f.type, str) else getattr(f.type, "__name__", ""))
        if kinds:
            out.append((f.name, kinds))
    return tuple(out)


def _kinds(annotation: str) -> tuple[str, ...]:
    """The simple kinds a type annotation allows (empty = not a simple annotation, not checked)."""
    text = annotation.replace(" ", "")
    if text.startswith("tuple[float"):
        return ("tuple_float",)
    parts = tuple(text.split("|"))
    return parts if parts and all(p in _SIMPLE for p in parts) else ()


def _checked(value: Any, kinds: tuple[str, ...], label: str, error: type[Exception], finite: bool = True) -> Any:
    """``value`` (an int for a whole-number float in an int field) or ``error`` naming the field."""
    if value is None:
        if "None" in kinds:
            return value
        raise error(f"{label} is required, got None")
    if "bool" in kinds and isinstance(value, bool):
        return value
    if "str" in kinds and isinstance(value, (str, os.PathLike)):  # file names: a Path is as good as text
        return value
    if "tuple_float" in kinds:
        if not isinstance(value, (tuple, list)) or not all(_finite_real(v) for v in value):
            raise error(f"{label} must be finite numbers, got {value!r}")
        return value
    if "int" in kinds and not isinstance(value, bool):
        if isinstance(value, numbers.Integral):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if "float" not in kinds:
            raise error(f"{label} must be a whole number, got {value!r}")
    if "float" in kinds and not isinstance(value, bool) and isinstance(value, numbers.Real):
        if finite and not math.isfinite(float(value)):
            raise error(f"{label} must be a finite number, got {value!r}")
        return value
    raise error(f"{label} must be {_describe(kinds)}, got {value!r} ({type(value).__name__})")


def _finite_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))


def _describe(kinds: tuple[str, ...]) -> str:
    words = {"int": "a whole number", "float": "a finite number", "bool": "true or false", "str": "text",
             "None": "null"}
    return " or ".join(words[k] for k in kinds if k in words)
