"""`FormatArgs`: the fields a weight `Scheme` and an activation `InputScheme` share, and their one grammar.

Both describe a block format the same way: an element grid (``elem``, ``bits``), a block
of ``group_size`` columns sharing a scale stored as ``scale``, an optional tensor scale
with its S_max, the rule (and criterion, guard, E8M0 rounding) that picks block scales.
They differ in a few fields of their own (a weight's symmetry, range and K-quant
super-block; an input's static calibration), in their presets and in how a base name is
found (``w3g32a`` for weights, the ``a8`` alias for inputs). This module holds what is
common, so the text users type is parsed by one function and a name is printed by one:
``base[:key=value,...]``, the base a preset (or a subclass's own base forms), the keys
the class's option table. ``parse(x.name) == x`` holds for every value of either class.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from lowbit.configs import check_fields, from_dict_strict
from lowbit.errors import SchemeError, did_you_mean
from lowbit.formats import minifloat

T = TypeVar("T", bound="FormatArgs")

_BOOL = {"1": True, "0": False, "true": True, "false": False, "yes": True, "no": False}


def parse_bool(v: str) -> bool:
    if v.lower() not in _BOOL:
        raise SchemeError(f"expected 0/1 for a switch, got {v!r}")
    return _BOOL[v.lower()]


# the keys of the explicit form both kinds take: key -> (field, converter)
OPTIONS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "block": ("group_size", int), "group": ("group_size", int), "g": ("group_size", int),
    "bits": ("bits", int), "rule": ("rule", str), "criterion": ("criterion", str),
    "guard": ("guard", parse_bool), "scale": ("scale", str), "tensor": ("tensor_scale", parse_bool),
    "smax": ("tensor_max", float), "round": ("e8m0_round", str), "elem": ("elem", str),
}
# how errors name a field: with the key of the explicit form users write (``nvfp4:smax=...``)
FIELD_NAMES = {"group_size": "group_size (block)", "tensor_max": "tensor_max (smax)", "tensor_scale":
               "tensor_scale (tensor)", "e8m0_round": "e8m0_round (round)"}


@dataclass(frozen=True)
class FormatArgs:
    """The shared fields; subclasses set their own defaults, add fields and fill the class tables below.

    elem / bits: the element grid (``int`` of ``bits`` bits, or an FP element such as ``e2m1``).
    group_size: columns sharing one scale along the input axis; -1 = one per row (token).
    scale: storage format of the block scale; tensor_scale / tensor_max: NVFP4's per-tensor
        scale and the S_max it maps the largest block to.
    rule / criterion / guard / e8m0_round: how block scales are picked (see `lowbit.formats.rules`).
    """

    elem: str = "int"
    bits: int = 4
    group_size: int = 128
    scale: str = "fp16"
    tensor_scale: bool = False
    rule: str = "absmax"
    criterion: str = "mse"
    guard: bool = False
    tensor_max: float = 448.0
    e8m0_round: str = "floor"

    KIND: ClassVar[str] = "format"  # how messages name the class ("scheme", "input scheme")
    OPTIONS: ClassVar[Mapping[str, tuple[str, Callable[[str], Any]]]] = OPTIONS
    FIELD_NAMES: ClassVar[Mapping[str, str]] = FIELD_NAMES
    FIELD_TO_KEY: ClassVar[Mapping[str, str]] = {}  # fields an explicit name may show, in the order it shows them
    FIELD_ORDER: ClassVar[tuple[str, ...]] = ()  # key order of `to_dict` (the order files have always held)

    def _check_fields(self) -> None:
        check_fields(self, SchemeError, f"{self.KIND} field", self.FIELD_NAMES, ranged=("tensor_max",))

    # --------------------------------------------------------------- grammar hooks
    @classmethod
    def presets(cls: type[T]) -> Mapping[str, T]:
        raise NotImplementedError

    @classmethod
    def base(cls: type[T], base: str) -> T:
        """The value a base name (before ``:``) stands for; unknown names raise naming the valid ones."""
        raise NotImplementedError

    def name_bases(self: T) -> Mapping[str, T]:
        """Base names an explicit name of ``self`` may start from (the one differing in fewest fields wins)."""
        return self.presets()

    # ----------------------------------------------------------------- the grammar
    @classmethod
    def parse(cls: type[T], text: str | T) -> T:
        """A preset or base form, optionally followed by ``:key=value,...`` (case-insensitive)."""
        if isinstance(text, cls):
            return text
        base, _, opts = text.strip().lower().partition(":")
        value = cls.base(base)
        return value.with_options(opts) if opts else value

    def with_options(self: T, opts: str) -> T:
        """``self`` with the ``key=value,...`` options of the explicit form applied."""
        changes: dict[str, Any] = {}
        for item in filter(None, opts.split(",")):
            key, eq, value = item.partition("=")
            if not eq or key.strip() not in self.OPTIONS:
                raise SchemeError(f"bad {self.KIND} option {item!r}{did_you_mean(key.strip(), self.OPTIONS)}; use "
                                  f"key=value with keys {sorted(self.OPTIONS)}")
            field, conv = self.OPTIONS[key.strip()]
            try:
                changes[field] = conv(value.strip())
            except ValueError as e:
                raise SchemeError(f"bad value in {self.KIND} option {item!r}: {e}") from None
        out = dataclasses.replace(self, **changes)
        if "tensor_max" in changes and not out.tensor_scale:
            raise SchemeError(f"smax sets the S_max of a tensor scale, and {self.KIND} {out.name} has none; drop "
                              "smax (or add tensor=1)")
        return out

    @property
    def name(self) -> str:
        """Canonical text form; ``parse(x.name) == x`` always holds."""
        for key, preset in self.presets().items():
            if preset == self:
                return key
        return self._explicit_name()

    def _explicit_name(self) -> str:
        """The base differing in the fewest fields, plus those fields (``w3g32a``, ``nvfp4:block=8,rule=4over6``)."""
        best_key, best_diff = None, None
        for key, preset in self.name_bases().items():
            diff = {f: getattr(self, f) for f in self.FIELD_TO_KEY if getattr(self, f) != getattr(preset, f)}
            if best_diff is None or len(diff) < len(best_diff):
                best_key, best_diff = key, diff
        assert best_key is not None and best_diff is not None
        if not best_diff:
            return best_key
        return best_key + ":" + ",".join(f"{self.FIELD_TO_KEY[f]}={_fmt(v)}" for f, v in best_diff.items())

    # ------------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.FIELD_ORDER}

    @classmethod
    def from_dict(cls: type[T], d: dict[str, Any]) -> T:
        return from_dict_strict(cls, d, SchemeError, f"{cls.KIND} fields")

    def replace(self: T, **changes: Any) -> T:
        return dataclasses.replace(self, **changes)

    def group_for(self, in_features: int) -> int:
        """Effective group size for a row; -1 resolves to the whole row."""
        return in_features if self.group_size == -1 else self.group_size

    def __str__(self) -> str:
        return self.name


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def check(ok: bool, msg: str) -> None:
    if not ok:
        raise SchemeError(msg)


def check_tensor_max(tensor_max: float, scale: str, tensor_scale: bool) -> None:
    """S_max of a tensor scale must be a block scale its format holds at full precision.

    The tensor scale maps the tensor's largest block to the block scale S_max, every
    other block below it. Above the format's maximum (448 for E4M3) the largest blocks'
    scales saturate and their weights clip; below its smallest normal value (2^-6) even
    the largest block's scale is subnormal and smaller blocks round to a zero scale: at
    ``smax=inf``, ``1e38`` or ``1e-42`` every weight dequantizes to about 0. Without a
    tensor scale the field is unused, but must still be a positive number.
    """
    check(isinstance(tensor_max, numbers.Real) and not isinstance(tensor_max, bool),
          f"tensor_max (smax) must be a number, got {tensor_max!r}")
    if not tensor_scale:
        check(math.isfinite(tensor_max) and tensor_max > 0, f"tensor_max (smax) must be a finite positive number, "
                                                             f"got {tensor_max}")
        return
    lo, hi = minifloat.smallest_normal(scale), minifloat.max_scale(scale)
    check(lo <= tensor_max <= hi,
          f"smax (the S_max of the tensor scale) must lie in [{lo:g}, {hi:g}] for {scale} block scales, got "
          f"{tensor_max:g}: above {hi:g} the largest blocks' scales saturate, below {lo:g} the block scales "
          f"lose their precision and round to zero (nvfp4 uses 448, nvfp4-46 256)")
