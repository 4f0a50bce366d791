"""`InputScheme`: how a Linear's input (its activations) is quantized at run time.

A sibling of `Scheme` rather than more fields on it, because activations differ in kind
from weights: their scales are computed per token while the model runs (dynamic), or
calibrated once per tensor beforehand (static), never stored per group; they have no
zero points, no importance search and no storage cost in the bit budget. Keeping the
two apart leaves every weight field meaningful and lets the weight side grow (K-quants)
without touching this one. The block-scale arithmetic is shared: `block_scheme` maps an
input scheme onto the weight `Scheme` whose rules (abs-max, 4-over-6, span, brute
force, the underflow guard) pick the scales.

Formats (the rows of an input ``x [..., in]`` are tokens; blocks run along ``in``):

* INT8 symmetric per token: ``s = amax_token / 127``; codes ``round(x / s)`` in
  [-128, 127] (the 127 of the integer kernels, e.g. vLLM's dynamic int8 quant).
* FP8 E4M3 per token: ``s = amax_token / 448``, elements ``E4M3(x / s)`` (torch's
  saturating float8 cast); or per tensor, static: ``s = amax_calibration / 448``.
* MXFP8 / MXFP4: blocks of 32, one E8M0 scale per token and block. log2 rounding:
  ``floor`` (OCP MX v1.0: ``2^(floor(log2 amax) - emax)``, emax 2 for E2M1, 8 for
  E4M3), ``ceil`` (RCEIL: ``2^ceil(log2(amax / max))``, never clips), ``nearest``, and
  ``even`` (round the block max to the element's mantissa width, half up, then floor:
  ``2^floor(log2(amax / 3.5))`` for E2M1, the rule compressed-tensors computes).
* NVFP4: blocks of 16, E4M3 block scales computed per token and block by the scheme's
  rule, over a static FP32 tensor scale ``enc = 6 * S_max / amax_calibration``;
  ``x_hat = E2M1(x / (s_b / enc)) * (s_b / enc)``. UE5M3 block scales need no tensor
  scale. The guard, 4-over-6, span and brute force work as for weights.

Static scales are kept as the calibrated abs-max of the tensor (``amax``); every scale
derives from it, so one float per layer is all a checkpoint stores.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from lowbit.errors import ConfigError, SchemeError, did_you_mean
from lowbit.formats import minifloat, rules
from lowbit.formats.args import FIELD_NAMES as _SHARED_FIELD_NAMES
from lowbit.formats.args import OPTIONS as _SHARED_OPTIONS
from lowbit.formats.args import FormatArgs, check_tensor_max, parse_bool
from lowbit.formats.args import check as _check
from lowbit.formats.families import FAMILIES, family_of
from lowbit.formats.float_blocks import ELEM_GRIDS, ELEMENTS
from lowbit.formats.scheme import Scheme

if TYPE_CHECKING:
    from lowbit.formats.families import Family

SCALES = ("fp32", "e8m0", "e4m3", "ue5m3")
RULES = ("absmax", "4over6", "span", "brute")
E8M0_ROUNDING = ("floor", "ceil", "nearest", "even")
CRITERIA = ("mse", "mae", "max")


def _round(v: str) -> str:
    return "ceil" if v == "rceil" else v


_OPTIONS = {**_SHARED_OPTIONS, "round": ("e8m0_round", _round), "static": ("static", parse_bool)}
_FIELD_TO_KEY = {"elem": "elem", "bits": "bits", "group_size": "block", "scale": "scale", "static": "static",
                 "tensor_scale": "tensor", "rule": "rule", "criterion": "criterion", "guard": "guard",
                 "tensor_max": "smax", "e8m0_round": "round"}


@dataclass(frozen=True)
class InputScheme(FormatArgs):
    """An activation format.

    elem / bits: ``int`` (2..8 bits), ``e4m3`` (8) or ``e2m1`` (4), or another element of the FP family.
    group_size: input columns per scale of one token; -1 = one scale per token.
    scale: format of the run-time scales (fp32 per token, e8m0 for MX, e4m3 / ue5m3 for NV).
    static: one calibrated per-tensor fp32 scale instead of run-time scales (FP8 / INT8).
    tensor_scale: NVFP4's static FP32 tensor scale over E4M3 block scales (calibrated).
    rule / criterion / guard / tensor_max: the block-scale rule, as for weights.
    e8m0_round: log2 rounding of E8M0 scales (floor, ceil = RCEIL, nearest, even).
    """

    bits: int = 8
    group_size: int = -1
    scale: str = "fp32"
    static: bool = False

    KIND: ClassVar[str] = "input scheme"
    OPTIONS: ClassVar[Mapping[str, Any]] = _OPTIONS
    FIELD_NAMES: ClassVar[Mapping[str, str]] = _SHARED_FIELD_NAMES
    FIELD_TO_KEY: ClassVar[Mapping[str, str]] = _FIELD_TO_KEY
    FIELD_ORDER: ClassVar[tuple[str, ...]] = ("elem", "bits", "group_size", "scale", "static", "tensor_scale", "rule",
                                              "criterion", "guard", "tensor_max", "e8m0_round")

    def __post_init__(self) -> None:
        self._check_fields()
        _check(self.elem in _input_elems(),
               f"input elem must be one of {_input_elems()}, got {self.elem!r}")
        _check(self.scale in SCALES, f"input scale must be one of {SCALES}, got {self.scale!r}")
        _check(self.rule in RULES, f"input scale rule must be one of {RULES} (no importance search at run "
                                   f"time), got {self.rule!r}")
        _check(self.criterion in CRITERIA, f"criterion must be one of {CRITERIA}, got {self.criterion!r}")
        _check(self.e8m0_round in E8M0_ROUNDING, f"round must be one of {E8M0_ROUNDING}, got {self.e8m0_round!r}")
        _check(self.group_size == -1 or 4 <= self.group_size <= 256,
               f"input block size must be -1 (per token) or 4..256, got {self.group_size}")
        check_tensor_max(self.tensor_max, self.scale, self.tensor_scale)
        self.family.check_input(self)
        _check(self.rule == "absmax" or (self.elem == "e2m1" and self.scale in ("e4m3", "ue5m3")),
               f"rule {self.rule} needs E2M1 elements with e4m3 / ue5m3 block scales (NVFP4)")
        _check(not self.tensor_scale or self.scale in ("e4m3", "ue5m3"),
               "a tensor scale goes over e4m3 / ue5m3 block scales (NVFP4)")
        _check(self.e8m0_round == "floor" or self.scale == "e8m0", "round applies to e8m0 scales only")
        if self.static:
            _check(self.group_size == -1 and self.scale == "fp32" and not self.narrow,
                   "static inputs take one per-tensor fp32 scale (FP8 / INT8); drop block / scale")

    # ------------------------------------------------------------------ queries
    @property
    def family(self) -> Family:
        return family_of(self.elem)

    @property
    def narrow(self) -> bool:
        """FP elements under 8 bits (FP4, FP6): a few levels only, so they need block scales."""
        return self.elem in ELEMENTS and ELEMENTS[self.elem].bits < 8

    @property
    def needs_calibration(self) -> bool:
        """Whether a calibrated abs-max of the input is part of the format (static scales)."""
        return self.static or self.tensor_scale

    @property
    def qmax(self) -> float:
        """Largest element magnitude: 2^(b-1) - 1 for INT, 448 for E4M3, 6 for E2M1."""
        return self.family.elem_max(self)

    def check_width(self, in_features: int, where: str = "layer") -> None:
        """An input block must divide the row: kernels quantize whole blocks of each token."""
        if self.group_size != -1 and in_features % self.group_size:
            raise SchemeError(f"input block {self.group_size} does not divide the {in_features} input columns "
                              f"of {where}; choose a block that divides {in_features} (e.g. "
                              f"{_divisor_hint(in_features)}) or a per-token scheme (int8, fp8)")

    def block_scheme(self) -> Scheme:
        """The weight `Scheme` whose block-scale rules this format shares (FP blocks only)."""
        rnd = "floor" if self.e8m0_round == "even" else self.e8m0_round
        return Scheme(elem=self.elem, bits=self.bits, group_size=self.group_size, scale=self.scale,
                      tensor_scale=self.tensor_scale, rule=self.rule, criterion=self.criterion, guard=self.guard,
                      tensor_max=self.tensor_max, e8m0_round=rnd)

    # ------------------------------------------------------------------ grammar
    @classmethod
    def presets(cls) -> Mapping[str, InputScheme]:
        return PRESETS

    @classmethod
    def base(cls, base: str) -> InputScheme:
        base = ALIASES.get(base, base)
        if base not in PRESETS:
            raise SchemeError(f"unknown input scheme {base!r}{did_you_mean(base, [*PRESETS, *ALIASES])}; "
                              f"valid names: {valid_names()}")
        return PRESETS[base]


def _input_elems() -> tuple[str, ...]:
    return tuple(e for f in FAMILIES.values() if f.input_presets() for e in f.elements)


def _divisor_hint(n: int) -> str:
    return ", ".join(str(b) for b in (16, 32, 64, 128) if n % b == 0) or "a divisor"


PRESETS: dict[str, InputScheme] = {name: InputScheme(**fields) for f in FAMILIES.values()
                                   for name, fields in f.input_presets().items()}
ALIASES = {"a8": "int8", "a8-static": "int8-static"}


def valid_names() -> str:
    return (", ".join(PRESETS) + " (a8 = int8); explicit forms like nvfp4:rule=span or mxfp4:round=even "
            "(keys: " + ", ".join(sorted(_OPTIONS)) + ")")


# --------------------------------------------------------------- quantization
def encode_scale(s: InputScheme, amax: torch.Tensor | float | None) -> torch.Tensor | None:
    """The static scale a calibrated abs-max stands for (None when the format has none).

    static: ``amax / qmax`` (the per-tensor scale, in the units of ``x``); tensor_scale:
    NVFP4's ``enc = 6 * S_max / amax`` (``x`` is multiplied by it).
    """
    if not s.needs_calibration:
        return None
    if amax is None:
        raise ConfigError(f"input scheme {s.name} has static scales: calibrate it on calibration data first "
                          "(lowbit quantize does so from the calibration split)")
    a = torch.as_tensor(amax, dtype=torch.float32)
    if s.static:
        return torch.where(a > 0, a / s.qmax, torch.ones_like(a))
    return rules.tensor_encode(a, s.block_scheme(), ELEM_GRIDS[s.elem])


def qdq_input(x: torch.Tensor, s: InputScheme, amax: torch.Tensor | float | None = None) -> torch.Tensor:
    """Quantize then dequantize an input ``x [..., in]`` as the format defines it (``x``'s dtype out).

    amax: the calibrated abs-max of this input (static formats only). Computed in float32.
    """
    shape, dtype = x.shape, x.dtype
    x2 = x.detach().reshape(-1, shape[-1]).float()
    static = encode_scale(s, amax)
    if s.static:
        out = _qdq_elems(x2, static.to(x2.device), s)
    else:
        out = _qdq_blocks(x2, s, None if static is None else static.to(x2.device))
    return out.reshape(shape).to(dtype)


def _qdq_elems(x: torch.Tensor, scale: torch.Tensor, s: InputScheme) -> torch.Tensor:
    """``round_to_grid(x / scale) * scale`` with ``scale`` broadcast over ``x``; a zero scale gives 0."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = s.family.round_input(x / safe, s)
    return torch.where(scale > 0, q * safe, torch.zeros_like(q))


def _blocks(x: torch.Tensor, g: int) -> torch.Tensor:
    return x.reshape(x.shape[0], -1, x.shape[1] if g == -1 else g)


def _qdq_blocks(x: torch.Tensor, s: InputScheme, enc: torch.Tensor | None) -> torch.Tensor:
    """Run-time scales per token (and block), then the elements."""
    cols = x.shape[1]
    s.check_width(cols, "this input")
    xb = _blocks(x, s.group_size)
    amax = xb.abs().amax(-1)
    if s.scale == "fp32":
        scale = amax / s.qmax
    elif s.scale == "e8m0":
        scale = mx_scale(amax, s)
    else:
        scale = _nv_scale(xb, amax, s, enc)
    out = _qdq_elems(xb, scale.unsqueeze(-1), s)
    if s.guard and s.narrow:
        out = _keep_alive(xb, out, amax, scale, ELEM_GRIDS[s.elem].tiny)
    return out.reshape(x.shape[0], cols)


def mx_scale(amax: torch.Tensor, s: InputScheme) -> torch.Tensor:
    """E8M0 block scales of ``amax`` by the scheme's log2 rounding (see the module docstring)."""
    elem = ELEM_GRIDS[s.elem]
    if s.e8m0_round == "floor":
        return minifloat.round_e8m0(amax / 2.0**elem.emax, "floor")
    if s.e8m0_round == "even":  # floor(log2 amax) after amax is rounded to 1 mantissa bit, half up
        return minifloat.round_e8m0(amax / (1.75 * 2.0 ** (elem.emax - 1)), "floor")
    return minifloat.round_e8m0(amax / elem.max, s.e8m0_round)


def _nv_scale(xb: torch.Tensor, amax: torch.Tensor, s: InputScheme, enc: torch.Tensor | None) -> torch.Tensor:
    """Block scales by the scheme's rule, returned in the units of ``x`` (``s_b / enc``)."""
    bs, elem = s.block_scheme(), ELEM_GRIDS[s.elem]
    hp = rules.absmax_hp(amax, bs, elem)
    a = xb.abs()
    if enc is not None:
        a, hp = a * enc, hp * enc  # (amax / 6) * enc: the order of the NVFP4 recipe (and compressed-tensors)
    sc = rules.choose_scales(a, bs, elem, None, rules.BRUTE_WINDOW, hp)
    if s.guard:
        sc = torch.where((amax > 0) & (sc == 0), torch.full_like(sc, minifloat.smallest_scale(s.scale)), sc)
    return sc if enc is None else sc / enc


def _keep_alive(xb: torch.Tensor, out: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor, tiny: float
                ) -> torch.Tensor:
    """Guard: a non-zero block that dequantized to all zeros keeps its largest element at the
    smallest code (``tiny`` x its scale: 0.5 for E2M1), as the weight guard does."""
    dead = (amax > 0) & (out.abs().amax(-1) == 0)
    if not bool(dead.any()):
        return out
    top = dead.unsqueeze(-1) & (xb.abs() == amax.unsqueeze(-1))
    return torch.where(top, torch.copysign(tiny * scale.unsqueeze(-1).expand_as(out), xb), out)


def underflow_fraction(x: torch.Tensor, s: InputScheme, amax: torch.Tensor | float | None = None) -> float:
    """Share of non-zero blocks of ``x`` whose block scale rounds to 0 (before any guard).

    The cause of "finer is worse" under abs-max with E4M3 scales: such blocks quantize
    to all zeros. Only block-scaled formats can underflow (0.0 for the others).
    """
    dead, live = underflow_counts(x, s, amax)
    return dead / max(live, 1)


def underflow_counts(x: torch.Tensor, s: InputScheme, amax: torch.Tensor | float | None = None) -> tuple[int, int]:
    """(non-zero blocks whose abs-max block scale rounds to 0, non-zero blocks) of ``x``."""
    if s.scale not in ("e4m3", "ue5m3"):
        return 0, 0
    x2 = x.detach().reshape(-1, x.shape[-1]).float()
    xb = _blocks(x2, s.group_size)
    amax_b = xb.abs().amax(-1)
    plain = s.replace(rule="absmax", guard=False)
    enc = encode_scale(plain, amax)
    sc = _nv_scale(xb, amax_b, plain, None if enc is None else enc.to(x2.device))
    live = amax_b > 0
    return int(((sc == 0) & live).sum()), int(live.sum())
