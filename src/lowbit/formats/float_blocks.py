"""The float-block family: NVFP4, MXFP4, NVFP4 with UE5M3 scales (E2M1), MXFP8 / FP8 (E4M3), MXFP6 (E2M3, E3M2).

One path serves every FP block format: split ``w [out, in]`` into blocks along the input
axis (ragged last block zero-padded), multiply by the per-tensor scale ``enc`` if the
scheme has one (NVFP4: ``enc = 6 * S_max / amax``), let the scheme's rule pick a block
scale on the scale format's grid (rules.py), then round ``x * enc / s_b`` to the element
grid. The QTensor holds E2M1 codes ``sign<<3 | magnitude index``, raw E4M3 bytes or FP6
codes ``sign<<5 | exponent<<mbits | mantissa`` (the OCP MX bit layout), the block scales as float32 grid values, and ``enc`` as ``tensor_scale``:
``dequant = q * s_b / enc`` (QTensor.dequantize).

Each element grid is one `Element`: its rounding (what the scale rules need), its width,
and its codes both ways. A new element (an OCP MX type, say) is one `Element` in
``ELEMENTS`` and, if users should name it, a preset: every rule, rounder, GPTQ grid and
activation path of the family works from the `Element` alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lowbit.errors import SchemeError
from lowbit.formats import blocks, minifloat, rules
from lowbit.formats.args import check
from lowbit.formats.grids import decode_e2m1, decode_e4m3, e2m1_table
from lowbit.formats.groups import to_groups
from lowbit.formats.qtensor import QTensor

if TYPE_CHECKING:
    from lowbit.formats.inputs import InputScheme
    from lowbit.formats.scheme import Scheme

E2M1_FMT = minifloat.Minifloat(ebits=2, mbits=1, bias=1, max=6.0, signed=True)


def round_e2m1_mag(a: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 magnitude of non-negative ``a``, ties to even code, clamped at 6.

    Steps are 0.5 below 2, 1 in [2, 4) and 2 from 4: half the binade ``2^e`` of ``a``
    (e = floor(log2 a)), never below 0.5. Adding then subtracting ``M = step * 2^23``
    makes float32 round ``a`` to a multiple of ``step``, half to even (an even multiple
    of the step is an even code). ``M`` is built from ``a``'s exponent bits (float32
    exponent ``e + 127``; M's is ``max(e, 0) + 126 + 23``): three integer passes where
    comparing ``a`` with 2 and 4 took seven float ones (the same M, so the same values).
    """
    a = a.float().clamp_max(6.0)
    e = (a.view(torch.int32) >> 23).clamp_min_(127)  # a >= 0: the sign bit is clear (NaN: see the test)
    m = e.add_(22).bitwise_left_shift_(23).view(torch.float32)
    return (a + m).sub_(m)


def e2m1_index(r: torch.Tensor) -> torch.Tensor:
    """Magnitude index 0..7 of E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}."""
    # the index is piecewise linear and concave in v = 2r (0..12, an integer): v below 4, v/2 + 2 up to 8,
    # v/4 + 4 above; computed on bytes (a quarter of the memory traffic of float32)
    v = (r * 2.0).to(torch.uint8)
    return torch.minimum(torch.minimum(v, (v >> 1).add_(2)), (v >> 2).add_(4))


def round_e4m3_mag(a: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 magnitude of non-negative ``a``, saturating at 448: torch's float8 cast (`minifloat.round_minifloat`)."""
    return a.float().clamp_max(448.0).to(torch.float8_e4m3fn).float()


E2M1 = rules.ElemGrid("e2m1", 6.0, 0.5, round_e2m1_mag)
E4M3_ELEM = rules.ElemGrid("e4m3", 448.0, 2.0**-9, round_e4m3_mag)


@dataclass(frozen=True)
class Element:
    """One FP element grid of the family.

    grid: what the scale rules need (largest and smallest magnitude, rounding of magnitudes).
    bits: code width. encode: ``(x, r) -> uint8 codes`` of grid magnitudes ``r`` with the signs
    of ``x`` (zero is code 0). decode: codes -> float32 values. cast: signed values (already
    divided by their scale) -> the nearest grid values, saturating (the activation path).
    table: the value of every code, indexed by code (NaN for a code that is no number).
    """

    grid: rules.ElemGrid
    bits: int
    encode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    decode: Callable[[torch.Tensor], torch.Tensor]
    cast: Callable[[torch.Tensor], torch.Tensor]
    table: Callable[[], torch.Tensor]


def _neg(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return (x < 0) & (r > 0)


E2M1_ELEMENT = Element(
    E2M1, 4, lambda x, r: e2m1_index(r) | (_neg(x, r).to(torch.uint8) << 3), decode_e2m1,
    lambda t: torch.copysign(round_e2m1_mag(t.abs()), t), e2m1_table)
E4M3_ELEMENT = Element(
    E4M3_ELEM, 8, lambda x, r: torch.where(_neg(x, r), -r, r).to(torch.float8_e4m3fn).view(torch.uint8),
    decode_e4m3, lambda t: t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float(),
    lambda: decode_e4m3(torch.arange(256, dtype=torch.int32).to(torch.uint8)))


def mx_fp6(name: str, ebits: int, mbits: int, bias: int, max_: float) -> Element:
    """An OCP MX FP6 element (v1.0: E2M3 bias 1, max 7.5; E3M2 bias 3, max 28): no inf or NaN,
    subnormals, the sign in bit 5 above the 5-bit magnitude code, round to nearest even, saturating."""
    fmt = minifloat.Minifloat(ebits=ebits, mbits=mbits, bias=bias, max=max_, signed=False)
    mag_bits = ebits + mbits

    def round_mag(a: torch.Tensor) -> torch.Tensor:
        return minifloat.round_minifloat(a, fmt)

    def table() -> torch.Tensor:
        mags = minifloat.minifloat_from_code(torch.arange(1 << mag_bits, dtype=torch.int32), fmt)
        return torch.cat([mags, -mags])

    def encode(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return minifloat.minifloat_to_code(r, fmt) | (_neg(x, r).to(torch.uint8) << mag_bits)

    def decode(codes: torch.Tensor) -> torch.Tensor:
        return table().to(codes.device)[codes.long()]

    def cast(t: torch.Tensor) -> torch.Tensor:
        return torch.copysign(round_mag(t.abs()), t)

    return Element(rules.ElemGrid(name, max_, fmt.smallest, round_mag), 1 + mag_bits, encode, decode, cast, table)


ELEMENTS: dict[str, Element] = {"e2m1": E2M1_ELEMENT, "e4m3": E4M3_ELEMENT,
                                "e2m3": mx_fp6("e2m3", 2, 3, 1, 7.5), "e3m2": mx_fp6("e3m2", 3, 2, 3, 28.0)}
ELEM_GRIDS = {k: e.grid for k, e in ELEMENTS.items()}


def encode_codes(x: torch.Tensor, r: torch.Tensor, elem: str) -> torch.Tensor:
    """Codes of chosen magnitudes ``r`` with the signs of ``x`` (zero is code 0)."""
    return ELEMENTS[elem].encode(x, r)


def _block_weight(imp: torch.Tensor | None, cols: int, g: int, s: Scheme) -> torch.Tensor | None:
    """Importance per element of a block row, ``[ngroups, g]``; only the search rule uses it."""
    if imp is None or s.rule != "search":
        return None
    if imp.numel() != cols:
        raise ValueError(f"importance has {imp.numel()} entries, the weight has {cols} input columns")
    return to_groups(imp.detach().float().reshape(1, cols), g)[0]


def quantize_fp(w: torch.Tensor, s: Scheme, imp: torch.Tensor | None = None,
                window: int | None = rules.BRUTE_WINDOW, tensor_scale: torch.Tensor | None = None) -> QTensor:
    """Quantize ``w [out, in]`` to an FP block format (E2M1 or E4M3 elements).

    imp: importance per input column for ``rule='search'`` (None = plain MSE).
    window: brute force only: codes each side of the abs-max scale (None = all codes).
    tensor_scale: ``enc`` given (a fused group's shared one) instead of computed from ``w``.

    Rows go through in slices (`_rows_per_chunk`): every step is per block, and the slices are the
    ones the rules always worked in, so slicing the whole pipeline changes no value; what it saves
    is the full-size float32 temporaries (a 235 MB buffer each at the 8B shape, page-faulted anew
    for every matrix). Only the tensor scale needs the whole tensor: its largest magnitude, from
    one min/max pass.
    """
    out, cols = w.shape
    g = s.group_for(cols)
    elem = ELEM_GRIDS[s.elem]
    x = to_groups(w.detach(), g)
    if tensor_scale is not None:
        enc = given_encode(tensor_scale, s, w)
    elif s.tensor_scale:
        enc = rules.tensor_encode(_largest_magnitude(x), s, elem)
    else:
        enc = None
    weight = _block_weight(None if imp is None else imp.to(w.device), cols, g, s)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=w.device)
    sc = torch.empty(x.shape[:2], device=w.device)
    n = _rows_per_chunk(x)
    for a in range(0, out, n):
        sc[a:a + n], codes[a:a + n] = _quantize_rows(x[a:a + n].float(), s, elem, enc, weight, window)
    return QTensor(codes, sc, None, enc, (out, cols), s)


def _largest_magnitude(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` (float32, 0-d) from one read-only min/max pass (the tensor scale needs only this value)."""
    if x.numel() == 0:
        return torch.zeros((), device=x.device)
    lo, hi = torch.aminmax(x)
    return torch.maximum(hi, -lo).float()


def _quantize_rows(x: torch.Tensor, s: Scheme, elem: rules.ElemGrid, enc: torch.Tensor | None,
                   weight: torch.Tensor | None, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(block scales, codes) of the float32 blocks ``x [rows, blocks, g]``."""
    if s.elem == "e4m3" and s.rule == "absmax" and not s.guard and enc is None:  # FP8 / MXFP8 RTN
        # block maxima from min / max (read-only), +0.0 so an all-zero block's is +0 as abs().amax() gives
        amax = torch.maximum(x.amax(-1), x.amin(-1).neg_()).add_(0.0)
        sc = rules.absmax_scale(amax, s, elem, rules.absmax_hp(amax, s, elem))
        return sc, _e4m3_codes(x, sc)
    ax = x.abs()
    amax = ax.amax(-1)
    hp = rules.absmax_hp(amax, s, elem)
    a = ax
    if enc is not None:
        a, hp = ax * enc, hp * enc  # amax / 6 * enc: the NVFP4 recipe's order of operations
    sc = rules.choose_scales(a, s, elem, weight, window, hp)
    if s.guard:  # judged on the unscaled weights: x * enc can flush float32 subnormals to 0
        sc = torch.where((amax > 0) & (sc == 0), torch.full_like(sc, minifloat.smallest_scale(s.scale)), sc)
    if s.elem == "e4m3" and not s.guard and enc is None:  # searched FP8 scales
        return sc, _e4m3_codes(x, sc)
    r = rules.elem_mags(a, sc, elem, s.guard)
    if s.guard:
        r = _revive_underflowed(ax, amax, r, elem)
    return sc, encode_codes(x, r, s.elem)


def _e4m3_codes(x: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of ``x / sc`` in one cast of the signed values: the codes of the magnitude path
    (``|x| * inv`` rounded, the sign put back), since rounding and scaling are symmetric in the sign;
    a value that rounds to zero keeps code 0, not the cast's -0 (0x80)."""
    inv = torch.where(sc > 0, sc.reciprocal(), torch.zeros_like(sc))
    q = (x * inv.unsqueeze(-1)).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return q.masked_fill_(q == 0x80, 0)


def given_encode(tensor_scale: torch.Tensor, s: Scheme, w: torch.Tensor) -> torch.Tensor:
    """A tensor scale handed in, checked: only schemes with one take it, and it must be positive and finite."""
    if not s.tensor_scale:
        raise SchemeError(f"scheme {s.name} has no tensor scale; quantize it without one")
    enc = tensor_scale.detach().float().reshape(()).to(w.device).clone()  # each layer owns its buffer
    if not bool(torch.isfinite(enc)) or float(enc) <= 0:
        raise SchemeError(f"a tensor scale must be positive and finite, got {float(enc)}")
    return enc


def _revive_underflowed(a: torch.Tensor, amax: torch.Tensor, r: torch.Tensor, elem) -> torch.Tensor:
    """Guard, judged on the unscaled weights: a block that is non-zero in ``w`` but whose
    values vanished when multiplied by the tensor scale (float32 subnormals) still gets
    the smallest code on its largest element."""
    dead = (amax > 0) & (r.amax(-1) == 0)
    if not bool(dead.any()):
        return r
    top = dead.unsqueeze(-1) & (a == amax.unsqueeze(-1))
    return torch.where(top, torch.full_like(r, elem.tiny), r)


def _rows_per_chunk(a: torch.Tensor, elems: int = 1 << 22) -> int:
    """Rows per chunk so rule temporaries stay near ``elems`` floats (cache and RAM friendly)."""
    per_row = max(1, a.shape[1] * a.shape[2])
    return max(1, elems // per_row)


# OCP MX FP6: blocks of 32 under one E8M0 scale 2^(floor(log2 amax) - emax), emax 2 (E2M3) or 4 (E3M2)
MXFP6 = {f"mxfp6-{e}": {"elem": e, "bits": 6, "group_size": 32, "scale": "e8m0"} for e in ("e2m3", "e3m2")}


class FloatBlockFamily(blocks.OneLevelBlocks):
    """FP elements (`ELEMENTS`) in blocks of 4..256 with an E4M3 / UE5M3 / E8M0 / float block scale."""

    name = "fp"

    @property
    def elements(self) -> tuple[str, ...]:
        return tuple(ELEMENTS)

    def claims(self, elem: str, super_block: int) -> bool:
        return elem in ELEMENTS and not super_block

    def weight_presets(self) -> dict[str, dict[str, Any]]:
        nv = {"elem": "e2m1", "bits": 4, "group_size": 16, "scale": "e4m3", "tensor_scale": True}
        return {
            "nvfp4": nv,
            "nvfp4-46": nv | {"rule": "4over6", "guard": True, "tensor_max": 256.0},
            "nvfp4-ue5m3": nv | {"scale": "ue5m3", "tensor_scale": False, "guard": True},
            "mxfp4": {"elem": "e2m1", "bits": 4, "group_size": 32, "scale": "e8m0"},
            "mxfp8": {"elem": "e4m3", "bits": 8, "group_size": 32, "scale": "e8m0"},
            "fp8": {"elem": "e4m3", "bits": 8, "group_size": -1, "scale": "fp32"},  # per output channel (W8A8 FP8)
            **MXFP6,
        }

    def input_presets(self) -> dict[str, dict[str, Any]]:
        nv = {"elem": "e2m1", "bits": 4, "group_size": 16, "scale": "e4m3", "tensor_scale": True}
        return {
            "fp8": {"elem": "e4m3", "bits": 8},
            "fp8-static": {"elem": "e4m3", "bits": 8, "static": True},
            "mxfp8": {"elem": "e4m3", "bits": 8, "group_size": 32, "scale": "e8m0"},
            "mxfp4": {"elem": "e2m1", "bits": 4, "group_size": 32, "scale": "e8m0"},
            "nvfp4": nv,
            "nvfp4-46": nv | {"rule": "4over6", "guard": True, "tensor_max": 256.0},
            "nvfp4-ue5m3": nv | {"scale": "ue5m3", "tensor_scale": False, "guard": True},
            **MXFP6,
        }

    def check(self, s: Scheme) -> None:
        want = ELEMENTS[s.elem].bits
        check(s.bits == want, f"{s.elem} elements have {want} bits, got {s.bits}")
        check(s.sym, "floating-point elements are symmetric; drop sym=0")
        check(s.group_size == -1 or 4 <= s.group_size <= 256, f"FP block size must be 4..256, got {s.group_size}")
        if s.rule == "4over6":
            check(s.elem == "e2m1", "4-over-6 needs E2M1 (FP4) elements")
        check(s.rule != "fit", "rule fit is the K-quants' (q2_k ... q6_k); FP blocks take absmax, 4over6, span, "
                               "brute or search")

    def check_input(self, s: InputScheme) -> None:
        want = ELEMENTS[s.elem].bits
        check(s.bits == want, f"{s.elem} elements have {want} bits, got {s.bits}")
        if want < 8:  # a few levels only: a per-token scale would flatten every token
            check(s.scale != "fp32", f"FP{want} inputs need block scales (e8m0 for MXFP{want}"
                                     + (", e4m3 / ue5m3 for NVFP4)" if s.elem == "e2m1" else ")"))
            check(s.group_size != -1, f"FP{want} inputs need a block size (32 for MXFP{want}"
                                      + (", 16 for NVFP4)" if s.elem == "e2m1" else ")"))

    scale_noun = "block scales"

    def needed_scale(self, w: torch.Tensor, s: Scheme) -> float:
        """The largest abs-max block scale (before rounding); with a tensor scale at most S_max by construction (0)."""
        if s.tensor_scale:
            return 0.0
        return float(rules.absmax_hp(w.abs().max().reshape(1), s, ELEM_GRIDS[s.elem]).max())

    def wider_scale(self, s: Scheme) -> str | None:
        return None  # the scale format is part of the format

    def lost_rows(self, w: torch.Tensor, s: Scheme) -> int:
        return lost_rows(w, s)

    def grid(self, s: Scheme | InputScheme) -> torch.Tensor:
        return ELEMENTS[s.elem].table()

    def elem_max(self, s: Scheme | InputScheme) -> float:
        return ELEMENTS[s.elem].grid.max

    def round_input(self, t: torch.Tensor, s: InputScheme) -> torch.Tensor:
        return ELEMENTS[s.elem].cast(t)

    def quantize(self, w: torch.Tensor, s: Scheme, imp: torch.Tensor | None = None,
                 tensor_scale: torch.Tensor | None = None) -> QTensor:
        return quantize_fp(w, s, imp, tensor_scale=tensor_scale)

    def dequantize(self, q: QTensor, dtype: torch.dtype) -> torch.Tensor:
        return blocks.dequantize(q, ELEMENTS[q.scheme.elem].decode(q.codes), dtype)


FAMILY = FloatBlockFamily()


NEGLIGIBLE_ROW = 1 / 8  # a dead row below this fraction of the median row maximum is not a loss


def lost_rows(w: torch.Tensor, s: Scheme) -> int:
    """Rows of ``w`` whose every block would get a zero E4M3 / UE5M3 scale, not counting negligible rows.

    A row's largest block has its largest scale, so the row is lost exactly when that
    scale rounds to zero; that needs the row maxima only, not a quantization.
    """
    if s.scale not in ("e4m3", "ue5m3"):
        return 0
    elem = ELEM_GRIDS[s.elem]
    rowmax = w.abs().amax(1)
    enc = rules.tensor_encode(rowmax.max(), s, elem)
    hp = rules.absmax_hp(rowmax, s, elem) * (1.0 if enc is None else enc)
    dead = (rowmax > 0) & (rules.cast(hp, s) == 0)
    if not bool(dead.any()):
        return 0
    live = rowmax[rowmax > 0]
    typical = live.median() * NEGLIGIBLE_ROW
    return int((dead & (rowmax >= typical)).sum())
