"""The integer family: group-wise integer quantization, symmetric (full range or classic) and asymmetric.

Full range maps the largest-magnitude value of a group to the most negative code
``-2^(b-1)`` (its sign decides the scale's sign), which gains one level over the classic
``max -> 2^(b-1)-1`` rule and is what the strongest 2-4 bit PTQ tools use. Scales are
rounded to their storage dtype *before* codes are computed, so the stored scale is the
one the codes were chosen for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from lowbit.formats import blocks
from lowbit.formats.args import check
from lowbit.formats.groups import to_groups
from lowbit.formats.qtensor import QTensor

if TYPE_CHECKING:
    from lowbit.formats.inputs import InputScheme
    from lowbit.formats.scheme import Scheme

_SCALE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
WIDER = {"fp16": "fp32", "bf16": "fp32"}  # group scales with a wider storage dtype (`lowbit.formats.ranges`)


def cast_scale(scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Round scales to their storage dtype, keeping them non-zero and finite (sign preserved).

    A zero scale would turn a whole group into NaNs; the smallest positive value of the
    dtype keeps tiny groups representable and all-zero groups at code zero. A scale
    beyond the dtype's largest value saturates there instead of becoming inf (an inf
    scale dequantizes its zero codes to NaN): the group's largest weights clip, and
    `lowbit.formats.ranges` gives such layers fp32 scales before any method runs.
    """
    dt = _SCALE_DTYPES[fmt]
    tiny = torch.finfo(dt).smallest_normal if dt == torch.bfloat16 else 2.0**-24 if dt == torch.float16 else 1e-38
    big = torch.finfo(dt).max
    s = scale.clamp(-big, big).to(dt).float()
    sign = torch.where(scale < 0, -1.0, 1.0)
    return torch.where(s.abs() < tiny, sign * tiny, s)


def int_params(wg: torch.Tensor, s: Scheme, shrink: torch.Tensor | float = 1.0
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) per group for ``wg [..., g]``; ``shrink`` scales the range."""
    return params_from_range(group_range(wg, s), s, shrink)


def group_range(wg: torch.Tensor, s: Scheme) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The range each group's scale is cut from: (unrounded scale, None) for symmetric schemes, (lo, hi) else.

    Split from `params_from_range` so a scale search reduces each group once, not once per candidate.
    """
    if s.sym:
        lo, hi = wg.amin(-1), wg.amax(-1)
        if s.full_range:
            return extreme(wg, lo, hi) / s.qmin, None
        return torch.maximum(hi, -lo) / s.qmax, None
    return wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)


def largest_magnitude(wg: torch.Tensor) -> torch.Tensor:
    """Per group of ``wg [..., g]`` its value of largest magnitude, sign kept (the first of ``+m`` / ``-m``): `extreme`
    from one min / max pass, for callers that have no range at hand (K-quant scales, SignRound's init)."""
    lo, hi = torch.aminmax(wg, dim=-1)
    return extreme(wg, lo, hi)


def extreme(wg: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Per group of ``wg [..., g]`` the value of largest magnitude, the first one where ``+m`` and ``-m`` both occur.

    That is ``wg.gather(-1, wg.abs().argmax(-1))`` (the full-range rule's choice, whose sign is the
    scale's), from the groups' min and max (two read-only reductions, 6x cheaper than ``abs`` +
    ``argmax`` + ``gather``); only the groups where ``max == -min`` (a tie, or all zeros) are resolved
    by ``argmax`` on those groups alone, so the first occurrence wins as before.
    """
    ext = torch.where(hi > -lo, hi, lo)
    tie = hi == -lo
    if bool(tie.any()):
        sub = wg[tie]
        ext[tie] = sub.gather(-1, sub.abs().argmax(-1, keepdim=True)).squeeze(-1)
    return ext


def params_from_range(rng: tuple[torch.Tensor, torch.Tensor | None], s: Scheme, shrink: torch.Tensor | float = 1.0
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) of a `group_range` shrunk by ``shrink``."""
    a, b = rng
    if b is None:
        return cast_scale(a * shrink, s.scale), None
    lo, hi = a * shrink, b * shrink
    scale = cast_scale((hi - lo) / s.qmax, s.scale)
    zero = torch.round(-lo / scale).clamp(0, s.qmax)
    return scale, zero


def int_codes(wg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, s: Scheme) -> torch.Tensor:
    """Round to nearest and clamp; returns *signed* integer levels as float."""
    q = (wg / scale.unsqueeze(-1)).round_()
    if zero is not None:
        q += zero.unsqueeze(-1)
    return q.clamp_(s.qmin, s.qmax)


def int_dequant(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    if zero is not None:
        q = q - zero.unsqueeze(-1)
    return q * scale.unsqueeze(-1)


def search_shrinks(s: Scheme) -> torch.Tensor:
    """Candidate range multipliers for the importance-weighted scale search (formats.md)."""
    if not s.sym:
        return torch.linspace(0.5, 1.0, 51)
    nmax = -s.qmin if s.full_range else s.qmax
    if s.bits == 2:
        divisors = torch.arange(1.10, 2.9001, 0.01)
    else:
        divisors = torch.linspace(0.25 * nmax, 1.75 * nmax, 200)
    return nmax / divisors


def _group_importance(imp: torch.Tensor | None, cols: int, g: int, like: torch.Tensor) -> torch.Tensor:
    if imp is None:
        imp = torch.ones(cols, device=like.device)
    # the importance comes from a calibration pass that may have run elsewhere (CPU sums)
    return to_groups(imp.to(like.device, torch.float32).reshape(1, cols), g)[0]  # [ng, g], zero on padding


def _weighted_err(wg, scale, zero, s: Scheme, imp_g) -> torch.Tensor:
    q = int_codes(wg, scale, zero, s)
    if zero is not None:
        q -= zero.unsqueeze(-1)
    d = q.mul_(scale.unsqueeze(-1)).sub_(wg)
    return d.mul_(d).mul_(imp_g).sum(-1)


def search_int_params(wg: torch.Tensor, s: Scheme, imp_g: torch.Tensor, coarse: int = 24, fine: int = 12,
                      refit: bool = True, clip: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per group, the candidate scale minimising ``sum_j imp_j (qdq(w_j) - w_j)^2``.

    The spec's candidate grid (up to 200 range multipliers) is searched coarse-to-fine:
    every ``len/coarse``-th candidate first, then the ``fine`` candidates on each side of
    each group's coarse winner. The error curve over the multiplier is smooth at this
    resolution, so this finds the grid optimum in ~1/4 of the evaluations; the
    unshrunk abs-max scale is always a candidate, so the result is never worse than it.
    ``refit``: finish with `refit_scale` (the least-squares scale of the winner's codes).
    ``clip=False``: only multipliers >= 1 (scales that cut no more of the range than abs-max
    does) and no refit (the least-squares scale of a group's codes may shrink it).
    """
    grid = search_shrinks(s).to(wg.device)
    if not clip:
        grid, refit = grid[grid >= 1], False
    rng = group_range(wg, s)
    stride = max(1, len(grid) // coarse)
    best_err = _weighted_err(wg, *params_from_range(rng, s), s, imp_g)
    best_f = torch.ones_like(best_err)
    best_i = torch.full_like(best_err, -1, dtype=torch.long)
    for i in range(0, len(grid), stride):
        err = _weighted_err(wg, *params_from_range(rng, s, grid[i]), s, imp_g)
        better = err < best_err
        best_err, best_f = torch.where(better, err, best_err), torch.where(better, grid[i], best_f)
        best_i = torch.where(better, i, best_i)
    for off in range(-min(fine, stride - 1), min(fine, stride - 1) + 1):
        if off == 0:
            continue
        idx = (best_i + off).clamp(0, len(grid) - 1)
        f = torch.where(best_i >= 0, grid[idx], 1.0)
        err = _weighted_err(wg, *params_from_range(rng, s, f), s, imp_g)
        better = err < best_err
        best_err, best_f = torch.where(better, err, best_err), torch.where(better, f, best_f)
    scale, zero = params_from_range(rng, s, best_f)
    return refit_scale(wg, s, imp_g, scale, zero, best_err) if refit else (scale, zero)


def refit_scale(wg: torch.Tensor, s: Scheme, imp_g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                err: torch.Tensor, rounds: int = 2) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per group, the weighted least-squares scale for the codes the current scale rounds to, kept where better.

    A candidate scale from the range grid is rarely the best scale for the codes it
    produces: given codes ``L``, ``sum imp * w * L / sum imp * L^2`` minimises the weighted
    error, and re-rounding at that scale can only move codes to nearer levels. Each round
    takes the refit (cast to the scale format) where it lowers the error; the zero point
    stays. llama.cpp's legacy quantizers with an importance matrix end the same way.
    """
    for _ in range(rounds):
        lv = int_codes(wg, scale, zero, s)
        if zero is not None:
            lv -= zero.unsqueeze(-1)
        # float64 sums: the fit is cast to the scale format next, and float32 sums in another
        # summation order (a tensor at another address) could round it to the neighbouring value
        lv64, imp64 = lv.double(), imp_g.double()
        den = (imp64 * lv64 * lv64).sum(-1)
        fit = ((imp64 * wg.double() * lv64).sum(-1) / den.where(den > 0, torch.ones_like(den))).float()
        fit = cast_scale(torch.where((den > 0) & (fit != 0), fit, scale), s.scale)
        e = _weighted_err(wg, fit, zero, s, imp_g)
        better = e < err
        if not bool(better.any()):
            break
        scale, err = torch.where(better, fit, scale), torch.where(better, e, err)
    return scale, zero


def quantize_int(w: torch.Tensor, s: Scheme, imp: torch.Tensor | None = None) -> QTensor:
    """Quantize ``w [out, in]``; ``rule='search'`` picks scales by importance-weighted MSE."""
    out, cols = w.shape
    g = s.group_for(cols)
    if s.rule != "search":
        return _quantize_plain(w, s, g)
    wg = to_groups(w.detach().float(), g)
    imp_g = _group_importance(imp, cols, g, wg)
    chunks = [search_int_params(c, s, imp_g) for c in wg.split(1024)]
    scale = torch.cat([c[0] for c in chunks])
    zero = None if s.sym else torch.cat([c[1] for c in chunks])  # type: ignore[misc]
    q = int_codes(wg, scale, zero, s)
    codes = (q - s.qmin).to(torch.uint8)
    return QTensor(codes, scale, zero, None, (out, cols), s)


PLAIN_CHUNK = 1 << 20  # weights per step of plain rounding: float32 temporaries of 4 MiB stay in cache


def _quantize_plain(w: torch.Tensor, s: Scheme, g: int) -> QTensor:
    """Round-to-nearest under range scales, a slice of rows at a time (rows are independent).

    Every step is elementwise or a reduction along one group, so slicing changes no value;
    what it saves is memory traffic: a whole 8B matrix in float32 temporaries (five of them,
    each 235 MB) became as many page-faulted buffers per matrix, most of the CPU time of a
    streamed model. ``w`` may be bf16 / fp16: each slice is widened on its own.
    """
    out, cols = w.shape
    ng = -(-cols // g)
    codes = torch.empty(out, ng, g, dtype=torch.uint8, device=w.device)
    scale = torch.empty(out, ng, device=w.device)
    zero = None if s.sym else torch.empty(out, ng, device=w.device)
    step = max(1, PLAIN_CHUNK // max(1, ng * g))
    for a in range(0, out, step):
        wg = to_groups(w[a:a + step].detach().float(), g)
        sc, z = int_params(wg, s)
        scale[a:a + step] = sc
        if zero is not None:
            zero[a:a + step] = z
        codes[a:a + step] = int_codes(wg, sc, z, s).sub_(s.qmin)  # exact small integers: the cast truncates nothing
    return QTensor(codes, scale, zero, None, (out, cols), s)


class IntegerFamily(blocks.OneLevelBlocks):
    """Integers of 2..8 bits in groups with an fp16 / bf16 / fp32 scale, and a zero point when asymmetric.

    Codes are stored unsigned (``u = q - qmin``) so every family packs the same way.
    """

    name = "int"
    elements = ("int",)

    def claims(self, elem: str, super_block: int) -> bool:
        return elem == "int" and not super_block

    def weight_presets(self) -> dict[str, dict[str, Any]]:
        def w(bits: int, group: int = -1, asym: bool = False) -> dict[str, Any]:
            return {"elem": "int", "bits": bits, "group_size": group, "sym": not asym}

        return {"w4g128": w(4, 128), "w4g128a": w(4, 128, asym=True), "w4g32": w(4, 32),
                "w4g32a": w(4, 32, asym=True), "w3g128": w(3, 128), "w2g64": w(2, 64), "w2g128": w(2, 128),
                "w8": w(8, -1), "w8g32": w(8, 32), "w4": w(4, -1)}

    def input_presets(self) -> dict[str, dict[str, Any]]:
        return {"int8": {"elem": "int", "bits": 8}, "int8-static": {"elem": "int", "bits": 8, "static": True}}

    def check(self, s: Scheme) -> None:
        check(2 <= s.bits <= 8, f"integer bits must be 2..8, got {s.bits}")
        check(s.scale in ("fp32", "fp16", "bf16"), f"integer groups store fp32/fp16/bf16 scales, not {s.scale}")
        check(s.rule in ("absmax", "search"), f"rule {s.rule} applies to " +
              ("llama.cpp's K-quants (q2_k ... q6_k) only" if s.rule == "fit" else "FP4 blocks only"))
        check(not s.tensor_scale, "integer schemes have no tensor scale")

    def check_input(self, s: InputScheme) -> None:
        check(2 <= s.bits <= 8, f"integer inputs have 2..8 bits, got {s.bits}")
        check(s.scale == "fp32", f"integer inputs use fp32 scales, not {s.scale}")

    scale_noun = "group scales"

    def needed_scale(self, w: torch.Tensor, s: Scheme) -> float:
        return needed_scale(w, s)

    def wider_scale(self, s: Scheme) -> str | None:
        """fp32 for fp16 / bf16 group scales: 16 more bits per group for a layer beyond them."""
        return WIDER.get(s.scale)

    def lost_rows(self, w: torch.Tensor, s: Scheme) -> int:
        return 0

    def grid(self, s: Scheme | InputScheme) -> torch.Tensor:
        """The signed level of each unsigned code ``u``: ``u + qmin``."""
        lo = -(2 ** (s.bits - 1)) if getattr(s, "sym", True) else 0
        return torch.arange(2**s.bits, dtype=torch.float32) + lo

    def elem_max(self, s: Scheme | InputScheme) -> float:
        return float(2 ** (s.bits - 1) - 1)

    def round_input(self, t: torch.Tensor, s: InputScheme) -> torch.Tensor:
        """Activations (already divided by their scale) to the nearest symmetric level, clamped."""
        lim = 2 ** (s.bits - 1)
        return t.round().clamp(-lim, lim - 1)

    def quantize(self, w: torch.Tensor, s: Scheme, imp: torch.Tensor | None = None,
                 tensor_scale: torch.Tensor | None = None) -> QTensor:
        return quantize_int(w, s, imp)

    def dequantize(self, q: QTensor, dtype: torch.dtype) -> torch.Tensor:
        return blocks.dequantize(q, q.codes.float() + q.scheme.qmin, dtype)


FAMILY = IntegerFamily()


def needed_scale(w: torch.Tensor, s: Scheme) -> float:
    """The largest unrounded group scale any group of ``w`` needs under ``s`` (rows in slices).

    Symmetric: the largest magnitude over the level it maps to, ``max|w| / (-qmin or qmax)``, from
    one pass over ``w``; it equals the largest group's scale exactly (a correctly rounded division by
    one constant is monotonic, and ``|x / qmin| = |x| / -qmin``).
    """
    if s.sym:
        if w.numel() == 0:
            return 0.0
        lo, hi = torch.aminmax(w.detach())
        return float(torch.maximum(hi, -lo).float() / (-s.qmin if s.full_range else s.qmax))
    best = 0.0
    for part in w.split(max(1, (1 << 22) // max(1, w.shape[1]))):
        lo_hi = group_range(to_groups(part, s.group_for(w.shape[1])), s)
        scale = lo_hi[0].abs() if lo_hi[1] is None else (lo_hi[1] - lo_hi[0]) / s.qmax
        best = max(best, float(scale.max()))
    return best
