"""FP block quantizers: NVFP4, MXFP4, NVFP4 with UE5M3 scales (E2M1) and MXFP8 / FP8 (E4M3).

One path serves every FP block format: split ``w [out, in]`` into blocks along the input
axis (ragged last block zero-padded), multiply by the per-tensor scale ``enc`` if the
scheme has one (NVFP4: ``enc = 6 * S_max / amax``), let the scheme's rule pick a block
scale on the scale format's grid (rules.py), then round ``x * enc / s_b`` to the element
grid. The QTensor holds E2M1 codes ``sign<<3 | magnitude index`` or raw E4M3 bytes,
the block scales as float32 grid values, and ``enc`` as ``tensor_scale``:
``dequant = q * s_b / enc`` (QTensor.dequantize).
"""

from __future__ import annotations

import torch

from lowbit.errors import SchemeError
from lowbit.formats import minifloat, rules
from lowbit.formats.groups import to_groups
from lowbit.formats.qtensor import QTensor
from lowbit.formats.scheme import Scheme

E2M1_FMT = minifloat.Minifloat(ebits=2, mbits=1, bias=1, max=6.0, signed=True)


def round_e2m1_mag(a: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 magnitude of non-negative ``a``, ties to even code, clamped at 6.

    Steps are 0.5 below 2, 1 in [2, 4) and 2 from 4. Adding then subtracting
    ``M = step * 2^23`` makes float32 round ``a`` to a multiple of ``step``, half to even
    (an even multiple of the step is an even code): exact, and ~3x faster on CPU than
    ``round(a / step) * step`` with a nested ``where`` for the step.
    """
    a = a.clamp_max(6.0)
    m = (a >= 2.0).float().add_(1.0).mul_((a >= 4.0).float().add_(1.0)).mul_(2.0**22)
    return (a + m).sub_(m)


def e2m1_index(r: torch.Tensor) -> torch.Tensor:
    """Magnitude index 0..7 of E2M1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}."""
    # the index is piecewise linear and concave in r: 2r below 2, r + 2 up to 4, r/2 + 4 above
    idx = torch.minimum(torch.minimum(2.0 * r, r + 2.0), 0.5 * r + 4.0)
    return idx.to(torch.uint8)


def round_e4m3_mag(a: torch.Tensor) -> torch.Tensor:
    return minifloat.round_minifloat(a, minifloat.E4M3)


E2M1 = rules.ElemGrid("e2m1", 6.0, 0.5, round_e2m1_mag)
E4M3_ELEM = rules.ElemGrid("e4m3", 448.0, 2.0**-9, round_e4m3_mag)
ELEM_GRIDS = {"e2m1": E2M1, "e4m3": E4M3_ELEM}


def encode_codes(x: torch.Tensor, r: torch.Tensor, elem: str) -> torch.Tensor:
    """Codes of chosen magnitudes ``r`` with the signs of ``x`` (zero is code 0)."""
    neg = (x < 0) & (r > 0)
    if elem == "e2m1":
        return e2m1_index(r) | (neg.to(torch.uint8) << 3)
    return minifloat.minifloat_to_code(torch.where(neg, -r, r), minifloat.E4M3)


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
    """
    out, cols = w.shape
    g = s.group_for(cols)
    elem = ELEM_GRIDS[s.elem]
    x = to_groups(w.detach().float(), g)
    a = x.abs()
    amax = a.amax(-1)
    enc = rules.tensor_encode(amax.amax(), s, elem) if tensor_scale is None else given_encode(tensor_scale, s, w)
    hp = rules.absmax_hp(amax, s, elem)
    if enc is not None:
        a, hp = a * enc, hp * enc  # amax / 6 * enc: the NVFP4 recipe's order of operations
    weight = _block_weight(None if imp is None else imp.to(w.device), cols, g, s)
    n = _rows_per_chunk(a)
    sc = torch.cat([rules.choose_scales(c, s, elem, weight, window, h) for c, h in zip(a.split(n), hp.split(n),
                                                                                      strict=True)])
    if s.guard:  # judged on the unscaled weights: x * enc can flush float32 subnormals to 0
        sc = torch.where((amax > 0) & (sc == 0), torch.full_like(sc, minifloat.smallest_scale(s.scale)), sc)
    r = rules.elem_mags(a, sc, elem, s.guard)
    if s.guard:
        r = _revive_underflowed(x.abs(), amax, r, elem)
    return QTensor(encode_codes(x, r, s.elem), sc, None, enc, (out, cols), s)


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
