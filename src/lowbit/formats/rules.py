"""Block-scale rules for FP block formats: abs-max, 4-over-6, span, brute force, search.

Every rule is "try some candidate block scales, keep the one with the lowest error in
the dequantized domain", differing only in the candidate set, so one loop serves all:

- ``absmax``: the block max maps to the element maximum (6 for E2M1). One candidate.
- ``4over6``: the block max maps to 6 or to 4 (scale x 1.5); the E2M1 grid has nothing
  between 4 and 6, so near-max values round badly under 6 and well under 4.
- ``span`` (lowbit's improved rule): every scale code from one below the "6" scale to one
  above the "4" scale, about 7 E4M3 codes: it finds the in-between scales that 4-over-6
  cannot express, at a few times its cost and close to the brute-force optimum.
- ``brute``: every positive code of the scale format, or a window of codes around the
  abs-max scale (the reference lower bound).
- ``search``: importance-weighted MSE over the grid of formats.md (NVFP4: block-max
  multipliers 0.50..1.51; MX: {0.5, 1, 2} x the abs-max power of two). Because a 0.01
  multiplier step is finer than the E4M3/UE5M3 grid spacing (>= 6.25 %), the multipliers
  hit every code between the two ends, so the search runs over that code range: the
  same candidates, evaluated once each.

Candidates are tried abs-max first and a later one must be strictly better, so every
rule is at least as good as abs-max on every block and ties keep the plain scale.
Rules work on magnitudes ``a = |x| * enc`` (the sign never changes an error), shaped
``[rows, blocks, block]``; scales come back on the scale format's grid, ``[rows, blocks]``.

Underflow guard: a block scale of a non-zero block that rounds to 0 is clamped *after*
rounding to the format's smallest positive value (``guard_scale``; ``when="before"``
clamps the unrounded scale instead and gives the same scales). If even that scale maps
the whole block below the smallest element value, the block's largest element keeps the
smallest non-zero code, so with the guard no non-zero block ever dequantizes to zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lowbit.errors import SchemeError
from lowbit.formats import minifloat

if TYPE_CHECKING:
    from lowbit.formats.scheme import Scheme

BRUTE_WINDOW = 8  # codes each side of the abs-max scale (one octave of E4M3 normals)
SEARCH_RANGE = (0.50, 1.51)  # NVFP4 block-max multipliers of the importance search


@dataclass(frozen=True)
class ElemGrid:
    """What a rule needs to know about an element grid (E2M1, E4M3)."""

    name: str
    max: float  # largest magnitude (6 for E2M1)
    tiny: float  # smallest non-zero magnitude (0.5 for E2M1)
    round_mag: Callable[[torch.Tensor], torch.Tensor]  # magnitudes -> grid magnitudes

    @property
    def emax(self) -> int:
        """Exponent of the largest binade (2 for E2M1, 8 for E4M3), as the MX spec uses."""
        return int(torch.tensor(self.max).log2().floor())


# --------------------------------------------------------------- scale helpers
def guard_scale(s: torch.Tensor, amax: torch.Tensor, fmt: str, when: str = "after",
                hp: torch.Tensor | None = None, e8m0_round: str = "floor") -> torch.Tensor:
    """Keep non-zero blocks' scales positive: clamp to the smallest scale of ``fmt``.

    ``when="after"`` fixes the rounded scale ``s``; ``when="before"`` re-rounds the
    unrounded scale ``hp`` clamped from below (same result, both are tested).
    """
    tiny = minifloat.smallest_scale(fmt)
    if when == "before":
        if hp is None:
            raise ValueError("guard before rounding needs the unrounded scale hp")
        return minifloat.cast_scale(torch.where(amax > 0, hp.clamp_min(tiny), hp), fmt, e8m0_round)
    return torch.where((s <= 0) & (amax > 0), torch.full_like(s, tiny), s)


def tensor_encode(amax_t: torch.Tensor, s: Scheme, elem: ElemGrid) -> torch.Tensor | None:
    """NVFP4 tensor scale ``enc = elem_max * S_max / amax`` (1 for an all-zero tensor, at most 2^100)."""
    if not s.tensor_scale:
        return None
    amax_t = amax_t.float()
    # tensor / tensor: ``float / tensor`` is computed as a reciprocal times the float in
    # torch, one ulp off the quotient, which flips E4M3 ties of the block scales
    num = torch.tensor(elem.max * s.tensor_max, dtype=torch.float32, device=amax_t.device)
    # a tensor whose max is below ~1e-35 would overflow enc to inf (NaN codes); capping enc
    # only shrinks the block scales of such tensors, which the guard then keeps non-zero
    enc = torch.where(amax_t > 0, num / amax_t, torch.ones_like(amax_t))
    return enc.clamp(max=2.0**100)


def absmax_hp(amax: torch.Tensor, s: Scheme, elem: ElemGrid) -> torch.Tensor:
    """Unrounded abs-max scale. E8M0 ``floor`` follows OCP MX: 2^(floor(log2 amax) - emax)."""
    if s.scale == "e8m0" and s.e8m0_round == "floor":
        return amax / 2.0**elem.emax
    return amax / elem.max


def cast(x: torch.Tensor, s: Scheme) -> torch.Tensor:
    return minifloat.cast_scale(x, s.scale, s.e8m0_round)


def absmax_scale(amax: torch.Tensor, s: Scheme, elem: ElemGrid, hp: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """The plain block scale (block max to the element maximum), guard applied if on."""
    sc = cast(absmax_hp(amax, s, elem) if hp is None else hp, s)
    return guard_scale(sc, amax, s.scale) if s.guard else sc


# ------------------------------------------------------------- quantize blocks
def qdq_mag(a: torch.Tensor, sc: torch.Tensor, elem: ElemGrid, guard: bool,
            amax: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantized magnitudes of ``a [..., g]`` under block scales ``sc [...]``."""
    r = elem_mags(a, sc, elem, guard, amax)
    return r * sc.unsqueeze(-1)


def elem_mags(a: torch.Tensor, sc: torch.Tensor, elem: ElemGrid, guard: bool,
              amax: torch.Tensor | None = None) -> torch.Tensor:
    """Element grid magnitudes chosen for ``a`` under ``sc`` (a zero scale gives zeros).

    amax: the blocks' maxima if known (saves a reduction per candidate under the guard).
    """
    inv = torch.where(sc > 0, sc.reciprocal(), torch.zeros_like(sc))
    r = elem.round_mag(a * inv.unsqueeze(-1))
    if guard:
        r = _keep_block_alive(a, r, elem, a.amax(-1) if amax is None else amax, inv)
    return r


def _keep_block_alive(a: torch.Tensor, r: torch.Tensor, elem: ElemGrid, amax: torch.Tensor,
                      inv: torch.Tensor) -> torch.Tensor:
    """Give the largest element of a non-zero block rounded to all zeros the smallest code.

    A block is all zeros exactly when its largest element rounds to 0, which the block
    maxima tell without looking at the elements; only then is the block touched.
    """
    dead = (amax > 0) & (elem.round_mag(amax * inv) == 0)
    if not bool(dead.any()):
        return r
    top = dead.unsqueeze(-1) & (a == amax.unsqueeze(-1))
    return torch.where(top, torch.full_like(r, elem.tiny), r)


def block_error(d: torch.Tensor, criterion: str, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Error per block of differences ``d [..., g]``: sum of squares, sum of abs, or max abs."""
    if criterion == "mse":
        e = d * d
    elif criterion in ("mae", "max"):
        e = d.abs()
    else:
        raise SchemeError(f"criterion must be mse, mae or max, got {criterion!r}")
    if weight is not None:
        e = e * weight
    if criterion == "max":
        return e.amax(-1)
    # a matrix-vector product sums short blocks much faster than sum(-1) on CPU
    return e @ torch.ones(e.shape[-1], dtype=e.dtype, device=e.device)


# ------------------------------------------------------------------ candidates
def _grid_index(grid: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.searchsorted(grid, v.contiguous()).clamp(max=grid.numel() - 1)


def _range(grid: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> Iterator[torch.Tensor]:
    """Scales ``grid[lo..hi]`` per block; blocks whose range ended repeat their top code."""
    n = int((hi - lo).max()) + 1 if lo.numel() else 0
    for k in range(n):
        yield grid[torch.minimum(lo + k, hi)]


def candidates(amax: torch.Tensor, s: Scheme, elem: ElemGrid, window: int | None = BRUTE_WINDOW,
               hp: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
    """Candidate block scales for ``s.rule``, abs-max first (all on the scale grid).

    window: brute force only; codes each side of the abs-max scale, None = every code.
    hp: the unrounded abs-max scale if the caller computed it (see ``choose_scales``).
    """
    hp = absmax_hp(amax, s, elem) if hp is None else hp
    s6 = absmax_scale(amax, s, elem, hp)
    yield s6
    if s.rule == "absmax":
        return
    s4 = cast(hp * 1.5, s)
    s4 = guard_scale(s4, amax, s.scale) if s.guard else s4
    if s.rule == "4over6":
        yield s4
        return
    if s.scale not in ("e4m3", "ue5m3", "e8m0"):
        if s.rule == "search":
            yield from (cast(hp * m, s) for m in torch.arange(SEARCH_RANGE[0], SEARCH_RANGE[1] + 1e-9, 0.01))
            return
        raise SchemeError(f"rule {s.rule} needs a scale format with a code grid (e4m3, ue5m3, e8m0), "
                          f"not {s.scale}")
    grid = minifloat.scale_grid(s.scale).to(amax.device)
    i6, i4 = _grid_index(grid, s6), _grid_index(grid, s4)
    last = torch.full_like(i6, grid.numel() - 1)
    if s.rule == "span":
        lo, hi = (i6 - 1).clamp_min(0), torch.minimum(i4 + 1, last)
    elif s.rule == "search":
        if s.scale == "e8m0":
            lo, hi = (i6 - 1).clamp_min(0), torch.minimum(i6 + 1, last)
        else:
            lo = _grid_index(grid, cast(hp * SEARCH_RANGE[0], s).clamp_min(grid[0]))
            hi = _grid_index(grid, cast(hp * SEARCH_RANGE[1], s))
    elif s.rule == "brute":
        yield s4  # the 4-over-6 candidate is always in, so brute <= 4-over-6 by construction
        if window is None:
            lo, hi = torch.zeros_like(i6), last
        else:
            lo, hi = (i6 - window).clamp_min(0), torch.minimum(i6 + window, last)
    else:
        raise SchemeError(f"unknown scale rule {s.rule!r}")
    yield from _range(grid, lo, hi)


def choose_scales(a: torch.Tensor, s: Scheme, elem: ElemGrid, weight: torch.Tensor | None = None,
                  window: int | None = BRUTE_WINDOW, hp: torch.Tensor | None = None) -> torch.Tensor:
    """Per block, the candidate scale of ``s.rule`` with the lowest ``s.criterion`` error.

    a: magnitudes ``[..., g]`` (already times the tensor scale); weight: optional
    per-element error weights broadcastable to ``a`` (the importance of the search rule).
    hp: unrounded abs-max scales ``[...]``; NVFP4 computes them as ``amax / 6 * enc``
    from the unscaled block max, the order of operations of the NVFP4 recipe, so that
    scales agree bit for bit with other implementations of it.
    """
    amax = a.amax(-1)
    it = candidates(amax, s, elem, window, hp)
    best = next(it)
    if s.rule == "absmax":
        return best
    best_err = block_error(qdq_mag(a, best, elem, s.guard, amax) - a, s.criterion, weight)
    for sc in it:
        err = block_error(qdq_mag(a, sc, elem, s.guard, amax) - a, s.criterion, weight)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, sc, best)
    return best
