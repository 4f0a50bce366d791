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
bits for them would (``NEGLIGIBLE_ROW`` in `lowbit.formats.float_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.formats import minifloat
from lowbit.formats.scheme import Scheme


@dataclass(frozen=True)
class Fit:
    """scheme: what to quantize the layer with (None = keep it in 16 bits); reason: why it is not the planned one."""

    scheme: Scheme | None
    reason: str | None = None


def fit(w: torch.Tensor, s: Scheme) -> Fit:
    """The scheme that holds ``w [out, in]``: ``s`` itself, ``s`` with fp32 scales, or None (16 bits).

    What the scales need and hold, and whether a wider scale exists, is the scheme's family's.
    """
    w = w.detach().float()
    if w.numel() == 0:
        return Fit(s)
    fam = s.family
    need, cap = fam.needed_scale(w, s), fam.scale_capacity(s)
    if need > cap:
        wider = fam.wider_scale(s)
        why = (f"its weights reach {w.abs().max().item():.3g} and need {fam.scale_noun} up to {need:.3g}, "
               f"beyond the {cap:.6g} that {s.scale} holds")
        if wider is not None:
            return Fit(s.replace(scale=wider), f"{why}: it keeps {wider} scales ({s.replace(scale=wider).name})")
        return Fit(None, f"{why}, and {s.name} has no wider scales: it stays in 16 bits")
    lost = fam.lost_rows(w, s)
    if lost:
        return Fit(None, f"{lost} of its {w.shape[0]} rows would get only zero {s.scale} block scales (the tensor "
                         f"scale follows its largest weight, {w.abs().max().item():.3g}, and {s.scale} spans "
                         f"{_span(s.scale)}): {s.name} cannot hold this layer, so it stays in 16 bits")
    return Fit(s)


def _span(fmt: str) -> str:
    lo, hi = minifloat.smallest_scale(fmt), minifloat.max_scale(fmt)
    return f"{lo:.3g}..{hi:.6g}"
