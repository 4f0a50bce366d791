"""Whether a scheme's scales can hold a layer's weights, and what to use when they cannot.

Every stored scale has a finite range, and a finite model can exceed it:

* **Overflow.** An fp16 group scale holds at most 65504, so an INT group whose weights
  reach ``65504 * 2^(b-1)`` (about 5.2e5 at 4 bits) needs a larger scale; cast to fp16 it
  became inf, and an inf scale dequantizes its zero codes to NaN. Scale casts now
  saturate (the largest weights clip instead), and such a layer gets **fp32 scales**
  (``w4g32:scale=fp32``): 16 more bits per group for that layer only, still quantized.
  Native checkpoints and compressed-tensors (which stores INT scales in float32 anyway)
  hold fp32 scales; GGUF's block types store fp16 scales, so a GGUF export refuses such a
  layer (it names it) rather than writing inf. Formats whose scale format is part of
  the format (the K-quants' fp16 super-block scales, UE5M3 without a tensor scale) have
  no wider variant: a layer beyond them stays in 16 bits.
* **Range.** NVFP4's tensor scale maps the tensor's largest block to the block scale
  S_max and every other block below it; E4M3 reaches down to 2^-9 only, so a layer whose
  largest weight is ~10^7 times its typical row (one outlier row of 5e5 beside rows of
  0.02) gives every block of those rows a zero scale: the rows dequantize to zeros (or,
  with the underflow guard, to values several times too large). The format cannot hold
  the layer, so it **stays in 16 bits**.

`fit` decides per layer, from the float weight alone, before any method runs; the run
reports every layer it changed (``range_fallbacks``) and warns with the reason. Rows
that die because they are themselves tiny (below 1/8 of the layer's median row maximum)
do not count: losing them costs nothing that matters, and keeping a whole layer in 16
bits for them would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.formats import minifloat, rules
from lowbit.formats.float_blocks import ELEM_GRIDS
from lowbit.formats.groups import to_groups
from lowbit.formats.integer import group_range
from lowbit.formats.scheme import Scheme

NEGLIGIBLE_ROW = 1 / 8  # a dead row below this fraction of the median row maximum is not a loss
WIDER = {"fp16": "fp32", "bf16": "fp32"}  # INT group scales with a wider storage dtype


@dataclass(frozen=True)
class Fit:
    """scheme: what to quantize the layer with (None = keep it in 16 bits); reason: why it is not the planned one."""

    scheme: Scheme | None
    reason: str | None = None


def fit(w: torch.Tensor, s: Scheme) -> Fit:
    """The scheme that holds ``w [out, in]``: ``s`` itself, ``s`` with fp32 scales, or None (16 bits)."""
    w = w.detach().float()
    if w.numel() == 0:
        return Fit(s)
    need, cap = needed_scale(w, s), capacity(s)
    if need > cap:
        wider = WIDER.get(s.scale) if s.elem == "int" and not s.super_block else None
        why = (f"its weights reach {w.abs().max().item():.3g} and need {_what_scale(s)} up to {need:.3g}, "
               f"beyond the {cap:.6g} that {s.scale} holds")
        if wider is not None:
            return Fit(s.replace(scale=wider), f"{why}: it keeps {wider} scales ({s.replace(scale=wider).name})")
        return Fit(None, f"{why}, and {s.name} has no wider scales: it stays in 16 bits")
    lost = lost_rows(w, s)
    if lost:
        return Fit(None, f"{lost} of its {w.shape[0]} rows would get only zero {s.scale} block scales (the tensor "
                         f"scale follows its largest weight, {w.abs().max().item():.3g}, and {s.scale} spans "
                         f"{_span(s.scale)}): {s.name} cannot hold this layer, so it stays in 16 bits")
    return Fit(s)


def capacity(s: Scheme) -> float:
    """The largest scale value the scheme stores (K-quants: the largest fp16 super-block scale times codes)."""
    if s.super_block:
        from lowbit.formats.kquants import ktype

        kt = ktype(s.bits)
        return 65504.0 * max(abs(kt.sc_lo), kt.sc_hi)
    return minifloat.max_scale(s.scale)


def needed_scale(w: torch.Tensor, s: Scheme) -> float:
    """The largest abs-max scale (before rounding) any group of ``w`` needs under ``s``.

    With a tensor scale the block scales are at most S_max by construction (0 here); the
    K-quants count their sub-block scales, whose fp16 super-block scale must hold them.
    """
    if s.tensor_scale:
        return 0.0
    if s.super_block:
        from lowbit.formats.kquants import ktype

        kt = ktype(s.bits)
        levels = max(abs(kt.qmin), kt.qmax) if kt.sym else 1  # asymmetric: the min code under dmin
        return float(w.abs().max()) / levels
    if s.elem == "int":
        best = 0.0
        for part in w.split(max(1, (1 << 22) // max(1, w.shape[1]))):
            lo_hi = group_range(to_groups(part, s.group_for(w.shape[1])), s)
            scale = lo_hi[0].abs() if lo_hi[1] is None else (lo_hi[1] - lo_hi[0]) / s.qmax
            best = max(best, float(scale.max()))
        return best
    return float(rules.absmax_hp(w.abs().max().reshape(1), s, ELEM_GRIDS[s.elem]).max())


def lost_rows(w: torch.Tensor, s: Scheme) -> int:
    """Rows of ``w`` whose every block would get a zero E4M3 / UE5M3 scale, not counting negligible rows.

    A row's largest block has its largest scale, so the row is lost exactly when that
    scale rounds to zero; that needs the row maxima only, not a quantization.
    """
    if s.elem == "int" or s.scale not in ("e4m3", "ue5m3"):
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


def _what_scale(s: Scheme) -> str:
    return "super-block scales" if s.super_block else "group scales" if s.elem == "int" else "block scales"


def _span(fmt: str) -> str:
    lo, hi = minifloat.smallest_scale(fmt), minifloat.max_scale(fmt)
    return f"{lo:.3g}..{hi:.6g}"
