"""`Scheme`: the one description of a number format that every layer of lowbit shares.

A scheme says how a Linear weight ``W[out, in]`` becomes codes: the element grid
(integers of ``bits`` bits, E2M1 for FP4, E4M3 for FP8), the group (block) of
consecutive input columns that share one scale, how that scale is stored, and which
rule picks it. Schemes are frozen and JSON-round-trippable so a checkpoint can state
exactly what it holds, and ``Scheme.parse`` is the only way user text becomes one.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any

from lowbit.configs import check_fields, from_dict_strict
from lowbit.errors import SchemeError, did_you_mean

ELEMS = ("int", "e2m1", "e4m3")
SCALE_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "e4m3": 8, "ue5m3": 8, "e8m0": 8}
RULES = ("absmax", "4over6", "span", "brute", "search")
CRITERIA = ("mse", "mae", "max")
E8M0_ROUNDING = ("floor", "ceil", "nearest")
# how errors name a field: with the key of the explicit form users write (``nvfp4:smax=...``)
FIELD_NAMES = {"group_size": "group_size (block)", "tensor_max": "tensor_max (smax)", "tensor_scale":
               "tensor_scale (tensor)", "e8m0_round": "e8m0_round (round)", "full_range": "full_range (full)"}


@dataclass(frozen=True)
class Scheme:
    """A weight quantization format.

    elem: element grid: ``int`` (``bits`` wide), ``e2m1`` (FP4) or ``e4m3`` (FP8).
    group_size: columns sharing one scale along the input axis; -1 = one per row.
    sym / full_range: INT only. Full range maps the largest-magnitude value of a group
        to -2^(b-1) (one more level than the classic max -> 2^(b-1)-1).
    scale: storage format of the group scale.
    tensor_scale: an extra fp32 scale per tensor (NVFP4) so E4M3 block scales use
        their full range.
    rule: how block scales are chosen (abs-max, 4-over-6, brute force, or a search).
    criterion: error used by 4-over-6 / brute force / search to compare candidates.
    guard: never let a non-zero block get a zero scale (scale underflow guard).
    tensor_max: S_max in the tensor-scale formula; 448 plain, 256 leaves room for
        the x1.5 of 4-over-6 without overflowing E4M3.
    e8m0_round: how log2 of the block scale is rounded for power-of-two scales.
    super_block: 256 for llama.cpp's K-quants (``q2_k`` ... ``q6_k``): ``group_size`` is then
        the sub-block, whose scale (and min) are integer codes under fp16 super-block scales
        (see `lowbit.formats.kquants`); 0 = one level of scales.
    """

    elem: str = "int"
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    full_range: bool = True
    scale: str = "fp16"
    tensor_scale: bool = False
    rule: str = "absmax"
    criterion: str = "mse"
    guard: bool = False
    tensor_max: float = 448.0
    e8m0_round: str = "floor"
    super_block: int = 0

    def __post_init__(self) -> None:
        check_fields(self, SchemeError, "scheme field", FIELD_NAMES, ranged=("tensor_max",))
        _check(self.elem in ELEMS, f"elem must be one of {ELEMS}, got {self.elem!r}")
        _check(self.scale in SCALE_BITS, f"scale must be one of {tuple(SCALE_BITS)}, got {self.scale!r}")
        _check(self.rule in RULES, f"rule must be one of {RULES}, got {self.rule!r}")
        _check(self.criterion in CRITERIA, f"criterion must be one of {CRITERIA}, got {self.criterion!r}")
        _check(self.e8m0_round in E8M0_ROUNDING, f"round must be one of {E8M0_ROUNDING}")
        _check(self.group_size == -1 or self.group_size >= 2,
               f"group size must be -1 (per row) or >= 2, got {self.group_size}")
        if self.elem == "int":
            _check(2 <= self.bits <= 8, f"integer bits must be 2..8, got {self.bits}")
            _check(self.scale in ("fp32", "fp16", "bf16"),
                   f"integer groups store fp32/fp16/bf16 scales, not {self.scale}")
            _check(self.rule in ("absmax", "search"), f"rule {self.rule} applies to FP4 blocks only")
            _check(not self.tensor_scale, "integer schemes have no tensor scale")
        else:
            want = 4 if self.elem == "e2m1" else 8
            _check(self.bits == want, f"{self.elem} elements have {want} bits, got {self.bits}")
            _check(self.sym, "floating-point elements are symmetric; drop sym=0")
            _check(self.group_size == -1 or 4 <= self.group_size <= 256,
                   f"FP block size must be 4..256, got {self.group_size}")
            if self.rule == "4over6":
                _check(self.elem == "e2m1", "4-over-6 needs E2M1 (FP4) elements")
        _check(not self.tensor_scale or self.scale not in ("e8m0",),
               "a tensor scale needs a block-scale format with a mantissa (e4m3, ue5m3)")
        check_tensor_max(self.tensor_max, self.scale, self.tensor_scale)
        if self.super_block:
            _check_kquant(self)

    # ----------------------------------------------------------------- queries
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

    def group_for(self, in_features: int) -> int:
        """Effective group size for a row; -1 resolves to the whole row."""
        return in_features if self.group_size == -1 else self.group_size

    def check_width(self, in_features: int, where: str = "layer") -> None:
        """Refuse a group larger than the row: it would silently become per-row."""
        if self.super_block and in_features % self.super_block:
            from lowbit.formats.kquants import FALLBACK, FALLBACK_GGUF

            raise SchemeError(
                f"{self.name} needs rows that are a multiple of {self.super_block} weights; {where} has "
                f"{in_features} input columns. llama.cpp falls back to {FALLBACK_GGUF[self.bits]} for such "
                f"tensors: use {FALLBACK[self.bits]} for this layer (the K-quant mixes such as "
                f"{self.name}_m do so by themselves)"
            )
        if self.group_size > in_features:
            raise SchemeError(
                f"group size {self.group_size} is larger than the {in_features} input columns of "
                f"{where}; choose a group size <= {in_features} or -1 (per row)"
            )

    def bits_per_weight(self, in_features: int | None = None, count_scales: bool = True) -> float:
        """Storage bits per weight element, scale (and zero) overhead included.

        The per-tensor fp32 scale of NVFP4 is ignored (32 bits over a whole tensor).
        """
        if not count_scales:
            return float(self.bits)
        if self.super_block:
            from lowbit.formats.kquants import ktype

            return ktype(self.bits).bits_per_weight
        g = self.group_size if self.group_size != -1 else (in_features or 4096)
        overhead = SCALE_BITS[self.scale] + (0 if self.sym else self.bits)
        return self.bits + overhead / g

    # ------------------------------------------------------------- naming, JSON
    @property
    def name(self) -> str:
        """Canonical text form; ``Scheme.parse(s.name) == s`` always holds."""
        for key, preset in PRESETS.items():
            if preset == self:
                return key
        return _explicit_name(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Scheme:
        return from_dict_strict(cls, d, SchemeError, "scheme fields")

    @classmethod
    def parse(cls, text: str | Scheme) -> Scheme:
        """Parse a preset (``w4g128``, ``nvfp4-46``...) or an explicit ``base:key=value,...``."""
        if isinstance(text, Scheme):
            return text
        text = text.strip().lower()  # W4G128 and w4g128 are one scheme
        base, _, opts = text.partition(":")
        scheme = _base_scheme(base)
        return _apply_options(scheme, opts) if opts else scheme

    def replace(self, **changes: Any) -> Scheme:
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        return self.name


def _check(ok: bool, msg: str) -> None:
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
    from lowbit.formats import minifloat

    _check(isinstance(tensor_max, numbers.Real) and not isinstance(tensor_max, bool),
           f"tensor_max (smax) must be a number, got {tensor_max!r}")
    if not tensor_scale:
        _check(math.isfinite(tensor_max) and tensor_max > 0, f"tensor_max (smax) must be a finite positive number, "
                                                               f"got {tensor_max}")
        return
    lo, hi = minifloat.smallest_normal(scale), minifloat.max_scale(scale)
    _check(lo <= tensor_max <= hi,
           f"smax (the S_max of the tensor scale) must lie in [{lo:g}, {hi:g}] for {scale} block scales, got "
           f"{tensor_max:g}: above {hi:g} the largest blocks' scales saturate, below {lo:g} the block scales "
           f"lose their precision and round to zero (nvfp4 uses 448, nvfp4-46 256)")


_INT_RE = re.compile(r"^w([2-8])(?:g(\d+))?(a)?$")


def int_scheme(bits: int, group: int = -1, asym: bool = False) -> Scheme:
    return Scheme(elem="int", bits=bits, group_size=group, sym=not asym)


PRESETS: dict[str, Scheme] = {
    "w4g128": int_scheme(4, 128),
    "w4g128a": int_scheme(4, 128, asym=True),
    "w4g32": int_scheme(4, 32),
    "w4g32a": int_scheme(4, 32, asym=True),
    "w3g128": int_scheme(3, 128),
    "w2g64": int_scheme(2, 64),
    "w2g128": int_scheme(2, 128),
    "w8": int_scheme(8, -1),
    "w8g32": int_scheme(8, 32),
    "w4": int_scheme(4, -1),
    "nvfp4": Scheme(elem="e2m1", bits=4, group_size=16, scale="e4m3", tensor_scale=True),
    "nvfp4-46": Scheme(elem="e2m1", bits=4, group_size=16, scale="e4m3", tensor_scale=True,
                       rule="4over6", guard=True, tensor_max=256.0),
    "nvfp4-ue5m3": Scheme(elem="e2m1", bits=4, group_size=16, scale="ue5m3", tensor_scale=False,
                          guard=True),
    "mxfp4": Scheme(elem="e2m1", bits=4, group_size=32, scale="e8m0"),
    "mxfp8": Scheme(elem="e4m3", bits=8, group_size=32, scale="e8m0"),
    "fp8": Scheme(elem="e4m3", bits=8, group_size=-1, scale="fp32"),  # per output channel (W8A8 FP8)
}

# explicit-form keys -> (field, parser)
_BOOL = {"1": True, "0": False, "true": True, "false": False, "yes": True, "no": False}


def _parse_bool(v: str) -> bool:
    if v.lower() not in _BOOL:
        raise SchemeError(f"expected 0/1 for a switch, got {v!r}")
    return _BOOL[v.lower()]


_OPTIONS = {
    "block": ("group_size", int), "group": ("group_size", int), "g": ("group_size", int),
    "bits": ("bits", int), "rule": ("rule", str), "criterion": ("criterion", str),
    "guard": ("guard", _parse_bool), "scale": ("scale", str), "tensor": ("tensor_scale", _parse_bool),
    "smax": ("tensor_max", float), "round": ("e8m0_round", str), "sym": ("sym", _parse_bool),
    "full": ("full_range", _parse_bool), "elem": ("elem", str),
}
_FIELD_TO_KEY = {"group_size": "block", "bits": "bits", "rule": "rule", "criterion": "criterion",
                 "guard": "guard", "scale": "scale", "tensor_scale": "tensor", "tensor_max": "smax",
                 "e8m0_round": "round", "sym": "sym", "full_range": "full", "elem": "elem"}


def kquant_scheme(bits: int) -> Scheme:
    """llama.cpp's Q{bits}_K layout (sub-block, symmetry from `lowbit.formats.kquants.KTYPES`)."""
    from lowbit.formats.kquants import ktype

    kt = ktype(bits)
    return Scheme(elem="int", bits=bits, group_size=kt.sub, sym=kt.sym, scale="fp16", super_block=256)


def _check_kquant(s: Scheme) -> None:
    from lowbit.formats.kquants import KTYPES

    kt = KTYPES.get(s.bits) if s.elem == "int" else None
    _check(s.super_block == 256 and kt is not None and (s.group_size, s.sym, s.scale) == (kt.sub, kt.sym, "fp16")
           and s.full_range, f"super-block schemes are llama.cpp's K-quants only ({', '.join(KQUANT_NAMES)}); "
           "their sub-block, symmetry and scales are fixed")


KQUANT_NAMES = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k")
PRESETS.update({f"q{b}_k": kquant_scheme(b) for b in range(2, 7)})


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
    """Every name --scheme takes: weight schemes, recipes with quantized inputs, llama.cpp's K-quant mixes."""
    from lowbit.formats import kmix, recipe  # both build on this module

    return [*PRESETS, *recipe.PRESETS, *kmix.MIXES]


def _apply_options(scheme: Scheme, opts: str) -> Scheme:
    changes: dict[str, Any] = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in _OPTIONS:
            raise SchemeError(f"bad scheme option {item!r}{did_you_mean(key.strip(), _OPTIONS)}; use key=value "
                              f"with keys {sorted(_OPTIONS)}")
        field, conv = _OPTIONS[key.strip()]
        try:
            changes[field] = conv(value.strip())
        except ValueError as e:
            raise SchemeError(f"bad value in scheme option {item!r}: {e}") from None
    out = dataclasses.replace(scheme, **changes)
    _check("tensor_max" not in changes or out.tensor_scale,
           f"smax sets the S_max of a tensor scale, and {out.name} has none; drop smax (or add tensor=1)")
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _explicit_name(s: Scheme) -> str:
    """Nearest base name plus the fields that differ, e.g. ``w3g32a`` or ``nvfp4:block=8,rule=4over6``.

    INT schemes start from their own ``wBgG[a]`` form, so only non-default fields show.
    """
    if s.super_block:
        candidates = {k: p for k, p in PRESETS.items() if p.super_block and p.bits == s.bits}
    elif s.elem == "int":
        base = f"w{s.bits}" + (f"g{s.group_size}" if s.group_size != -1 else "") + ("" if s.sym else "a")
        candidates = {base: _base_scheme(base)}
    else:
        candidates = {k: p for k, p in PRESETS.items() if p.elem == s.elem}
    best_key, best_diff = None, None
    for key, preset in candidates.items():
        diff = {f: getattr(s, f) for f in _FIELD_TO_KEY if getattr(s, f) != getattr(preset, f)}
        if best_diff is None or len(diff) < len(best_diff):
            best_key, best_diff = key, diff
    assert best_key is not None and best_diff is not None
    if not best_diff:
        return best_key
    opts = ",".join(f"{_FIELD_TO_KEY[f]}={_fmt(v)}" for f, v in best_diff.items())
    return f"{best_key}:{opts}"
