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

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from lowbit.configs import check_fields, from_dict_strict
from lowbit.errors import ConfigError, SchemeError, did_you_mean
from lowbit.formats import minifloat, rules
from lowbit.formats.float_blocks import ELEM_GRIDS, round_e2m1_mag
from lowbit.formats.scheme import Scheme, check_tensor_max

ELEMS = ("int", "e2m1", "e4m3")
SCALES = ("fp32", "e8m0", "e4m3", "ue5m3")
RULES = ("absmax", "4over6", "span", "brute")
E8M0_ROUNDING = ("floor", "ceil", "nearest", "even")
CRITERIA = ("mse", "mae", "max")
_FIELD_NAMES = {"group_size": "group_size (block)", "tensor_max": "tensor_max (smax)", "tensor_scale":
                "tensor_scale (tensor)", "e8m0_round": "e8m0_round (round)"}


@dataclass(frozen=True)
class InputScheme:
    """An activation format.

    elem / bits: ``int`` (2..8 bits), ``e4m3`` (8) or ``e2m1`` (4).
    group_size: input columns per scale of one token; -1 = one scale per token.
    scale: format of the run-time scales (fp32 per token, e8m0 for MX, e4m3 / ue5m3 for NV).
    static: one calibrated per-tensor fp32 scale instead of run-time scales (FP8 / INT8).
    tensor_scale: NVFP4's static FP32 tensor scale over E4M3 block scales (calibrated).
    rule / criterion / guard / tensor_max: the block-scale rule, as for weights.
    e8m0_round: log2 rounding of E8M0 scales (floor, ceil = RCEIL, nearest, even).
    """

    elem: str = "int"
    bits: int = 8
    group_size: int = -1
    scale: str = "fp32"
    static: bool = False
    tensor_scale: bool = False
    rule: str = "absmax"
    criterion: str = "mse"
    guard: bool = False
    tensor_max: float = 448.0
    e8m0_round: str = "floor"

    def __post_init__(self) -> None:
        check_fields(self, SchemeError, "input scheme field", _FIELD_NAMES, ranged=("tensor_max",))
        _check(self.elem in ELEMS, f"input elem must be one of {ELEMS}, got {self.elem!r}")
        _check(self.scale in SCALES, f"input scale must be one of {SCALES}, got {self.scale!r}")
        _check(self.rule in RULES, f"input scale rule must be one of {RULES} (no importance search at run "
                                   f"time), got {self.rule!r}")
        _check(self.criterion in CRITERIA, f"criterion must be one of {CRITERIA}, got {self.criterion!r}")
        _check(self.e8m0_round in E8M0_ROUNDING, f"round must be one of {E8M0_ROUNDING}, got {self.e8m0_round!r}")
        _check(self.group_size == -1 or 4 <= self.group_size <= 256,
               f"input block size must be -1 (per token) or 4..256, got {self.group_size}")
        check_tensor_max(self.tensor_max, self.scale, self.tensor_scale)
        if self.elem == "int":
            _check(2 <= self.bits <= 8, f"integer inputs have 2..8 bits, got {self.bits}")
            _check(self.scale == "fp32", f"integer inputs use fp32 scales, not {self.scale}")
        else:
            want = 4 if self.elem == "e2m1" else 8
            _check(self.bits == want, f"{self.elem} elements have {want} bits, got {self.bits}")
        if self.elem == "e2m1":
            _check(self.scale != "fp32", "FP4 inputs need block scales (e8m0 for MXFP4, e4m3 / ue5m3 for NVFP4)")
            _check(self.group_size != -1, "FP4 inputs need a block size (32 for MXFP4, 16 for NVFP4)")
        _check(self.rule == "absmax" or (self.elem == "e2m1" and self.scale in ("e4m3", "ue5m3")),
               f"rule {self.rule} needs E2M1 elements with e4m3 / ue5m3 block scales (NVFP4)")
        _check(not self.tensor_scale or self.scale in ("e4m3", "ue5m3"),
               "a tensor scale goes over e4m3 / ue5m3 block scales (NVFP4)")
        _check(self.e8m0_round == "floor" or self.scale == "e8m0", "round applies to e8m0 scales only")
        if self.static:
            _check(self.group_size == -1 and self.scale == "fp32" and self.elem != "e2m1",
                   "static inputs take one per-tensor fp32 scale (FP8 / INT8); drop block / scale")

    # ------------------------------------------------------------------ queries
    @property
    def needs_calibration(self) -> bool:
        """Whether a calibrated abs-max of the input is part of the format (static scales)."""
        return self.static or self.tensor_scale

    @property
    def qmax(self) -> float:
        """Largest element magnitude: 2^(b-1) - 1 for INT, 448 for E4M3, 6 for E2M1."""
        return float(2 ** (self.bits - 1) - 1) if self.elem == "int" else ELEM_GRIDS[self.elem].max

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

    # ------------------------------------------------------------ naming, JSON
    @property
    def name(self) -> str:
        for key, preset in PRESETS.items():
            if preset == self:
                return key
        return _explicit_name(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InputScheme:
        return from_dict_strict(cls, d, SchemeError, "input scheme fields")

    @classmethod
    def parse(cls, text: str | InputScheme) -> InputScheme:
        """A preset (``int8``, ``fp8``, ``mxfp4``, ``nvfp4-46``...) or ``base:key=value,...``."""
        if isinstance(text, InputScheme):
            return text
        base, _, opts = text.strip().lower().partition(":")
        base = ALIASES.get(base, base)
        if base not in PRESETS:
            raise SchemeError(f"unknown input scheme {base!r}{did_you_mean(base, [*PRESETS, *ALIASES])}; "
                              f"valid names: {valid_names()}")
        return _apply_options(PRESETS[base], opts) if opts else PRESETS[base]

    def replace(self, **changes: Any) -> InputScheme:
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        return self.name


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise SchemeError(msg)


def _divisor_hint(n: int) -> str:
    return ", ".join(str(b) for b in (16, 32, 64, 128) if n % b == 0) or "a divisor"


PRESETS: dict[str, InputScheme] = {
    "int8": InputScheme(),
    "int8-static": InputScheme(static=True),
    "fp8": InputScheme(elem="e4m3"),
    "fp8-static": InputScheme(elem="e4m3", static=True),
    "mxfp8": InputScheme(elem="e4m3", group_size=32, scale="e8m0"),
    "mxfp4": InputScheme(elem="e2m1", bits=4, group_size=32, scale="e8m0"),
    "nvfp4": InputScheme(elem="e2m1", bits=4, group_size=16, scale="e4m3", tensor_scale=True),
    "nvfp4-46": InputScheme(elem="e2m1", bits=4, group_size=16, scale="e4m3", tensor_scale=True, rule="4over6",
                            guard=True, tensor_max=256.0),
    "nvfp4-ue5m3": InputScheme(elem="e2m1", bits=4, group_size=16, scale="ue5m3", guard=True),
}
ALIASES = {"a8": "int8", "a8-static": "int8-static"}

_BOOL = {"1": True, "0": False, "true": True, "false": False, "yes": True, "no": False}


def _bool(v: str) -> bool:
    if v.lower() not in _BOOL:
        raise ValueError(f"expected 0/1 for a switch, got {v!r}")
    return _BOOL[v.lower()]


def _round(v: str) -> str:
    return "ceil" if v == "rceil" else v


_OPTIONS = {"block": ("group_size", int), "group": ("group_size", int), "g": ("group_size", int),
            "bits": ("bits", int), "rule": ("rule", str), "criterion": ("criterion", str),
            "guard": ("guard", _bool), "scale": ("scale", str), "tensor": ("tensor_scale", _bool),
            "smax": ("tensor_max", float), "round": ("e8m0_round", _round), "static": ("static", _bool),
            "elem": ("elem", str)}
_FIELD_TO_KEY = {"elem": "elem", "bits": "bits", "group_size": "block", "scale": "scale", "static": "static",
                 "tensor_scale": "tensor", "rule": "rule", "criterion": "criterion", "guard": "guard",
                 "tensor_max": "smax", "e8m0_round": "round"}


def valid_names() -> str:
    return (", ".join(PRESETS) + " (a8 = int8); explicit forms like nvfp4:rule=span or mxfp4:round=even "
            "(keys: " + ", ".join(sorted(_OPTIONS)) + ")")


def _apply_options(s: InputScheme, opts: str) -> InputScheme:
    changes: dict[str, Any] = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in _OPTIONS:
            raise SchemeError(f"bad input scheme option {item!r}; use key=value with keys {sorted(_OPTIONS)}")
        field, conv = _OPTIONS[key.strip()]
        try:
            changes[field] = conv(value.strip())
        except ValueError as e:
            raise SchemeError(f"bad value in input scheme option {item!r}: {e}") from None
    out = dataclasses.replace(s, **changes)
    _check("tensor_max" not in changes or out.tensor_scale,
           f"smax sets the S_max of a tensor scale, and input scheme {out.name} has none; drop smax")
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)


def _explicit_name(s: InputScheme) -> str:
    """The preset differing in the fewest fields, plus those fields: ``Parse(name) == s``."""
    best_key, best_diff = "int8", None
    for key, preset in PRESETS.items():
        diff = {f: getattr(s, f) for f in _FIELD_TO_KEY if getattr(s, f) != getattr(preset, f)}
        if best_diff is None or len(diff) < len(best_diff):
            best_key, best_diff = key, diff
    assert best_diff is not None
    return best_key + (":" + ",".join(f"{_FIELD_TO_KEY[f]}={_fmt(v)}" for f, v in best_diff.items())
                       if best_diff else "")


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
    t = x / safe
    if s.elem == "int":
        lim = 2 ** (s.bits - 1)
        q = t.round().clamp(-lim, lim - 1)
    elif s.elem == "e4m3":
        q = t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    else:
        q = torch.copysign(round_e2m1_mag(t.abs()), t)
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
    if s.guard and s.elem == "e2m1":
        out = _keep_alive(xb, out, amax, scale)
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


def _keep_alive(xb: torch.Tensor, out: torch.Tensor, amax: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Guard: a non-zero block that dequantized to all zeros keeps its largest element at the
    smallest code (0.5 x its scale), as the weight guard does."""
    dead = (amax > 0) & (out.abs().amax(-1) == 0)
    if not bool(dead.any()):
        return out
    top = dead.unsqueeze(-1) & (xb.abs() == amax.unsqueeze(-1))
    return torch.where(top, torch.copysign(0.5 * scale.unsqueeze(-1).expand_as(out), xb), out)


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
