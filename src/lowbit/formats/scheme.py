"""`Scheme`: the one description of a number format that every layer of lowbit shares.

A scheme says how a Linear weight ``W[out, in]`` becomes codes: the element grid
(integers of ``bits`` bits, E2M1 for FP4, E4M3 for FP8), the group (block) of
consecutive input columns that share one scale, how that scale is stored, and which
rule picks it. Schemes are frozen and JSON-round-trippable so a checkpoint can state
exactly what it holds, and ``Scheme.parse`` is the only way user text becomes one.

The fields and the grammar are shared with `InputScheme` (`lowbit.formats.args`); what a
field value means is the scheme's family's (``scheme.family``, `lowbit.formats.families`),
which also supplies the presets.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from lowbit.errors import SchemeError, did_you_mean
from lowbit.formats.args import FIELD_NAMES as _SHARED_FIELD_NAMES
from lowbit.formats.args import OPTIONS as _SHARED_OPTIONS
from lowbit.formats.args import FormatArgs, check_tensor_max, parse_bool
from lowbit.formats.args import check as _check
from lowbit.formats.families import ELEMS, FAMILIES, family_of
from lowbit.formats.minifloat import SCALE_BITS

if TYPE_CHECKING:
    from lowbit.formats.families import Family

__all__ = ["ELEMS", "PRESETS", "SCALE_BITS", "Scheme", "check_tensor_max", "int_scheme"]

RULES = ("absmax", "4over6", "span", "brute", "search", "fit")  # fit: K-quants only (`lowbit.formats.kquant_fit`)
CRITERIA = ("mse", "mae", "max")
E8M0_ROUNDING = ("floor", "ceil", "nearest")
FIELD_NAMES = _SHARED_FIELD_NAMES | {"full_range": "full_range (full)"}
_OPTIONS = {**_SHARED_OPTIONS, "sym": ("sym", parse_bool), "full": ("full_range", parse_bool)}
_FIELD_TO_KEY = {"group_size": "block", "bits": "bits", "rule": "rule", "criterion": "criterion",
                 "guard": "guard", "scale": "scale", "tensor_scale": "tensor", "tensor_max": "smax",
                 "e8m0_round": "round", "sym": "sym", "full_range": "full", "elem": "elem"}


@dataclass(frozen=True)
class Scheme(FormatArgs):
    """A weight quantization format.

    elem: element grid: ``int`` (``bits`` wide), ``e2m1`` (FP4), ``e4m3`` (FP8), ``e2m3`` / ``e3m2``
        (MXFP6); the elements each family takes are its own (`lowbit.formats.families`).
    group_size: columns sharing one scale along the input axis; -1 = one per row.
    sym / full_range: INT only. Full range maps the largest-magnitude value of a group
        to -2^(b-1) (one more level than the classic max -> 2^(b-1)-1).
    scale: storage format of the group scale.
    tensor_scale: an extra fp32 scale per tensor (NVFP4) so E4M3 block scales use
        their full range.
    rule: how block scales are chosen (abs-max, 4-over-6, brute force, or a search; K-quants also ``fit``,
        a few least-squares-refitted range candidates, `lowbit.formats.kquant_fit`).
    criterion: error used by 4-over-6 / brute force / search to compare candidates.
    guard: never let a non-zero block get a zero scale (scale underflow guard).
    tensor_max: S_max in the tensor-scale formula; 448 plain, 256 leaves room for
        the x1.5 of 4-over-6 without overflowing E4M3.
    e8m0_round: how log2 of the block scale is rounded for power-of-two scales.
    super_block: 256 for llama.cpp's K-quants (``q2_k`` ... ``q6_k``): ``group_size`` is then
        the sub-block, whose scale (and min) are integer codes under fp16 super-block scales
        (see `lowbit.formats.kquants`); 0 = one level of scales.
    """

    sym: bool = True
    full_range: bool = True
    super_block: int = 0

    KIND: ClassVar[str] = "scheme"
    OPTIONS: ClassVar[Mapping[str, Any]] = _OPTIONS
    FIELD_NAMES: ClassVar[Mapping[str, str]] = FIELD_NAMES
    FIELD_TO_KEY: ClassVar[Mapping[str, str]] = _FIELD_TO_KEY
    FIELD_ORDER: ClassVar[tuple[str, ...]] = ("elem", "bits", "group_size", "sym", "full_range", "scale",
                                              "tensor_scale", "rule", "criterion", "guard", "tensor_max",
                                              "e8m0_round", "super_block")

    def __post_init__(self) -> None:
        self._check_fields()
        _check(self.elem in ELEMS, f"elem must be one of {ELEMS}, got {self.elem!r}")
        _check(self.scale in SCALE_BITS, f"scale must be one of {tuple(SCALE_BITS)}, got {self.scale!r}")
        _check(self.rule in RULES, f"rule must be one of {RULES}, got {self.rule!r}")
        _check(self.criterion in CRITERIA, f"criterion must be one of {CRITERIA}, got {self.criterion!r}")
        _check(self.e8m0_round in E8M0_ROUNDING, f"round must be one of {E8M0_ROUNDING}")
        _check(self.group_size == -1 or self.group_size >= 2,
               f"group size must be -1 (per row) or >= 2, got {self.group_size}")
        self.family.check(self)
        _check(not self.tensor_scale or self.scale not in ("e8m0",),
               "a tensor scale needs a block-scale format with a mantissa (e4m3, ue5m3)")
        check_tensor_max(self.tensor_max, self.scale, self.tensor_scale)

    # ----------------------------------------------------------------- queries
    @property
    def family(self) -> Family:
        """The family that owns this format's behaviour (`lowbit.formats.families`)."""
        return family_of(self.elem, self.super_block)

    @property
    def is_fp(self) -> bool:
        return self.elem != "int"

    @property
    def qmin(self) -> int:
        """Smallest integer code (INT only)."""
        return -(2 ** (self.bits - 1)) if self.sym else 0

    @property
    def qmax(self) -> int:
        """Largest integer code (INT only)."""
        return 2 ** (self.bits - 1) - 1 if self.sym else 2**self.bits - 1

    def groups_for(self, in_features: int) -> int:
        """Number of groups along a row of ``in_features`` columns (last one may be ragged)."""
        g = self.group_for(in_features)
        return -(-in_features // g)

    def check_width(self, in_features: int, where: str = "layer") -> None:
        """Refuse a row the format cannot cut (a group larger than the row would silently become per-row)."""
        self.family.check_width(self, in_features, where)

    def bits_per_weight(self, in_features: int | None = None, count_scales: bool = True) -> float:
        """Storage bits per weight element, scale (and zero) overhead included.

        The per-tensor fp32 scale of NVFP4 is ignored (32 bits over a whole tensor).
        """
        return self.family.bits_per_weight(self, in_features, count_scales)

    def storage_bits(self, shape: tuple[int, int], count_scales: bool = True) -> int:
        """Exact storage bits of one ``[out, in]`` weight (scale and zero bits per group if counted)."""
        return self.family.storage_bits(self, shape, count_scales)

    # ---------------------------------------------------------------- grammar
    @classmethod
    def presets(cls) -> Mapping[str, Scheme]:
        return PRESETS

    @classmethod
    def base(cls, base: str) -> Scheme:
        return _base_scheme(base)

    def name_bases(self) -> Mapping[str, Scheme]:
        """K-quants start from their preset, INT schemes from their own ``wBgG[a]`` form, FP from same-element presets."""
        if self.super_block:
            return {k: p for k, p in PRESETS.items() if p.super_block and p.bits == self.bits}
        if self.elem == "int":
            base = f"w{self.bits}" + (f"g{self.group_size}" if self.group_size != -1 else "") + \
                ("" if self.sym else "a")
            return {base: _base_scheme(base)}
        return {k: p for k, p in PRESETS.items() if p.elem == self.elem}


_INT_RE = re.compile(r"^w([2-8])(?:g(\d+))?(a)?$")


def int_scheme(bits: int, group: int = -1, asym: bool = False) -> Scheme:
    return Scheme(elem="int", bits=bits, group_size=group, sym=not asym)


PRESETS: dict[str, Scheme] = {name: Scheme(**fields) for f in FAMILIES.values()
                              for name, fields in f.weight_presets().items()}


def _valid_names() -> str:
    return (", ".join(PRESETS) + "; also wB[gG][a] for B in 2..8 (e.g. w3g32a) and explicit "
            "forms like nvfp4:block=8,rule=4over6,guard=1 (keys: " + ", ".join(sorted(_OPTIONS)) + ")")


def _base_scheme(base: str) -> Scheme:
    if base in PRESETS:
        return PRESETS[base]
    m = _INT_RE.match(base)
    if m:
        return int_scheme(int(m.group(1)), int(m.group(2)) if m.group(2) else -1, bool(m.group(3)))
    raise SchemeError(f"unknown scheme {base!r}{did_you_mean(base, _all_names())}; valid names: {_valid_names()}")


def _all_names() -> list[str]:
    """Every scheme and recipe name (``--scheme`` also takes llama.cpp's mixes: `lowbit.plans` suggests those)."""
    from lowbit.formats import recipe  # builds on this module

    return [*PRESETS, *recipe.PRESETS]
