"""llama.cpp's K-quants (Q2_K ... Q6_K) as lowbit formats: two-level scales on 256-weight super-blocks.

Each row is cut into super-blocks of 256 weights, each super-block into 16- or 32-weight
sub-blocks. A sub-block has an integer scale code ``sc`` (and, for the asymmetric types, an
integer min code ``m``) of 4, 6 or 8 bits; the super-block has fp16 ``d`` (and ``dmin``).
A weight is ``(d*sc)*q - (dmin*m)`` (asymmetric) or ``(d*sc)*q`` (symmetric), fp32
products in that order, exactly as gguf-py and ggml dequantize:

| type | sub-block | element codes q | sub-scale codes | mins | bits/weight |
|------|-----------|-----------------|-----------------|------|-------------|
| Q2_K | 16        | 0..3            | 0..15           | 0..15 | 2.625      |
| Q3_K | 16        | -4..3           | -32..31         | -     | 3.4375     |
| Q4_K | 32        | 0..15           | 0..63           | 0..63 | 4.5        |
| Q5_K | 32        | 0..31           | 0..63           | 0..63 | 5.5        |
| Q6_K | 16        | -32..31         | -128..127       | -     | 6.5625     |

A `QTensor` of a K-quant scheme holds: ``codes`` (unsigned element codes, ``q - qmin``,
``[out, nsub, sub]``), ``scales`` (the integer sub-scale codes as float32, ``[out, nsub]``),
``zeros`` (the integer min codes, or None) and ``tensor_scale`` (the fp16 super-block
scales ``[out, nsuper, 1 or 2]``: d, then dmin): the two-level structure itself, so the
dequantized weight and the GGUF bytes follow from it with no rounding left.

The RTN quantizer (``rule="search"``) picks, per sub-block, a scale and min by a weighted
least-squares search (the idea of llama.cpp's ``make_qkx2_quants``, each element weighted
by the importance of its input column), then quantizes the sub-scales under a searched
super-block scale and re-chooses every sub-block's codes against the *final* (double-
quantized) scales, so the error that is minimised is the one of the stored weight.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lowbit.errors import CheckpointError, SchemeError
from lowbit.formats import blocks, integer, packing
from lowbit.formats.args import check
from lowbit.formats.groups import from_groups
from lowbit.formats.qtensor import QTensor

if TYPE_CHECKING:
    from lowbit.formats.scheme import Scheme

QK_K = 256


@dataclass(frozen=True)
class KType:
    """One llama.cpp K-quant layout."""

    name: str
    bits: int
    sub: int  # weights per sub-block
    sym: bool
    qmin: int  # element codes
    qmax: int
    sc_lo: int  # sub-scale codes
    sc_hi: int
    m_hi: int  # min codes 0..m_hi (asymmetric types)
    block_bytes: int  # bytes per 256 weights

    @property
    def nsub(self) -> int:
        return QK_K // self.sub

    @property
    def bits_per_weight(self) -> float:
        return self.block_bytes * 8 / QK_K

    @property
    def nsuper_scales(self) -> int:
        return 1 if self.sym else 2


KTYPES: dict[int, KType] = {
    2: KType("Q2_K", 2, 16, False, 0, 3, 0, 15, 15, 84),
    3: KType("Q3_K", 3, 16, True, -4, 3, -32, 31, 0, 110),
    4: KType("Q4_K", 4, 32, False, 0, 15, 0, 63, 63, 144),
    5: KType("Q5_K", 5, 32, False, 0, 31, 0, 63, 63, 176),
    6: KType("Q6_K", 6, 16, True, -32, 31, -128, 127, 0, 210),
}
BY_NAME = {k.name: k for k in KTYPES.values()}

# llama.cpp's tensor_type_fallback for rows that are not a multiple of 256 (llama-quant.cpp):
# lowbit scheme names of the legacy 32-block types it falls back to
FALLBACK = {2: "w4g32", 3: "w4g32", 4: "w5g32", 5: "w5g32a", 6: "w8g32"}
FALLBACK_GGUF = {2: "Q4_0", 3: "Q4_0", 4: "Q5_0", 5: "Q5_1", 6: "Q8_0"}


def ktype(bits: int) -> KType:
    return KTYPES[bits]


# ------------------------------------------------------------------ dequantize
def expand_super(v: torch.Tensor, nsub: int) -> torch.Tensor:
    """``[out, nsuper] -> [out, nsuper * nsub]``: each super-block value for its sub-blocks."""
    return v.unsqueeze(-1).expand(*v.shape, nsub).reshape(v.shape[0], -1)


def effective_scales(sc: torch.Tensor, m: torch.Tensor | None, sup: torch.Tensor, kt: KType
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 ``d*sc`` and ``dmin*m`` per sub-block, the products ggml forms before the elements."""
    ds = expand_super(sup[..., 0], kt.nsub) * sc
    dm = None if m is None else expand_super(sup[..., 1], kt.nsub) * m
    return ds, dm


def dequantize(codes: torch.Tensor, sc: torch.Tensor, m: torch.Tensor | None, sup: torch.Tensor, kt: KType
               ) -> torch.Tensor:
    """``[out, nsub, sub]`` weights, bit for bit as gguf-py's ``quants.dequantize``."""
    ds, dm = effective_scales(sc, m, sup, kt)
    w = ds.unsqueeze(-1) * (codes.float() + kt.qmin)
    return w if dm is None else w - dm.unsqueeze(-1)


# ------------------------------------------------------------------ quantize
def _lsq(x: torch.Tensor, q: torch.Tensor, wt: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted least-squares ``(scale, min >= 0)`` with ``x ~ scale*q - min`` per sub-block."""
    sw, sq, sx = wt.sum(-1), (wt * q).sum(-1), (wt * x).sum(-1)
    sqq, sqx = (wt * q * q).sum(-1), (wt * q * x).sum(-1)
    return lsq_from_sums(sw, sq, sx, sqq, sqx, sym)


def lsq_from_sums(sw: torch.Tensor, sq: torch.Tensor, sx: torch.Tensor, sqq: torch.Tensor, sqx: torch.Tensor,
                  sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`_lsq` from its weighted sums (the fast path forms them with fewer passes, then shares this)."""
    only_scale = sqx / sqq.clamp_min(1e-30)
    if sym:
        return only_scale, torch.zeros_like(only_scale)
    det = sw * sqq - sq * sq
    ok = det > 1e-30 * sw * sqq
    s = torch.where(ok, (sw * sqx - sq * sx) / det.where(ok, torch.ones_like(det)), only_scale)
    b = torch.where(ok, (sqq * sx - sq * sqx) / det.where(ok, torch.ones_like(det)), torch.zeros_like(det))
    pos = b > 0  # the grid must reach zero from below: a positive offset is clamped to 0
    s = torch.where(pos, only_scale, s)
    return s, torch.where(pos, torch.zeros_like(b), -b)


def element_codes(x: torch.Tensor, s: torch.Tensor, mn: torch.Tensor, kt: KType) -> torch.Tensor:
    """Signed element codes of ``x [..., sub]`` under sub-block scale ``s`` and min ``mn`` ``[...]``.

    Rounds ``(x + mn) * (1 / s)`` as ggml's quantizers do (multiplying by the inverse), so
    a value already on the grid gets back its own code.
    """
    inv = torch.where(s != 0, 1.0 / s, torch.zeros_like(s))
    return ((x + mn.unsqueeze(-1)) * inv.unsqueeze(-1)).round_().clamp_(kt.qmin, kt.qmax)


def _err(x: torch.Tensor, s: torch.Tensor, mn: torch.Tensor, kt: KType, wt: torch.Tensor) -> torch.Tensor:
    q = element_codes(x, s, mn, kt)
    d = q.mul_(s.unsqueeze(-1)).sub_(mn.unsqueeze(-1)).sub_(x)
    return d.mul_(d).mul_(wt).sum(-1)


def range_params(x: torch.Tensor, kt: KType):
    """``(lo, hi, ext, scale, min)`` per sub-block of ``x [..., sub]``: its range (``lo`` clamped to <= 0),
    the value of largest magnitude (symmetric types; else None) and the plain range scale and min."""
    lo = x.amin(-1).clamp(max=0)
    hi = x.amax(-1)
    if kt.sym:
        ext = integer.largest_magnitude(x)
        return lo, hi, ext, ext / kt.qmin, torch.zeros_like(ext)
    return lo, hi, None, ((hi - lo) / kt.qmax).clamp_min(0), -lo


def sub_block_params(x: torch.Tensor, wt: torch.Tensor, kt: KType, steps: int = 20, search: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float ``(scale, min)`` per sub-block of ``x [..., sub]`` minimising the weighted error.

    Asymmetric: candidates spread the grid over ``[lo, hi]`` with the range stretched by
    -10 %..+30 %, each refitted by weighted least squares on its codes (min clamped so
    the grid reaches 0). Symmetric: the extreme value maps to ``qmin`` (full range) under
    multipliers 0.7..1.3, again refitted. ``search=False``: the plain range scale.
    """
    lo, hi, ext, best_s, best_m = range_params(x, kt)
    if not search:
        return best_s, best_m
    best_e = _err(x, best_s, best_m, kt, wt)
    for k in range(steps + 1):
        f = 0.9 + 0.4 * k / steps
        s0 = ext / kt.qmin / f if kt.sym else ((hi - lo) / kt.qmax / f).clamp_min(0)
        m0 = torch.zeros_like(s0) if kt.sym else -lo
        q = element_codes(x, s0, m0, kt)
        for s, mn in ((s0, m0), _lsq(x, q, wt, kt.sym)):
            e = _err(x, s, mn, kt, wt)
            better = e < best_e
            best_e = torch.where(better, e, best_e)
            best_s, best_m = torch.where(better, s, best_s), torch.where(better, mn, best_m)
    return best_s, best_m


def _f16(x: torch.Tensor) -> torch.Tensor:
    """fp16 value of super-block scales, saturating at 65504 (never inf, see `lowbit.formats.ranges`)."""
    return x.clamp(-65504.0, 65504.0).to(torch.float16).float()


def quantize_codes(v: torch.Tensor, lo: int, hi: int, signed_ext: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Super-block scale (fp16) and integer codes for the sub-block values ``v [..., nsub]``.

    Unsigned (scales and mins of the asymmetric types): ``d = max / hi``. Signed (Q3_K, Q6_K):
    the largest-magnitude value maps to ``lo`` (-32 / -128), as llama.cpp does, so ``d`` takes
    its sign.
    """
    if signed_ext:
        ext = integer.largest_magnitude(v)
        d = _f16(ext / lo)
    else:
        d = _f16(v.amax(-1).clamp_min(0) / hi)
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return d, (v * inv.unsqueeze(-1)).round().clamp(lo, hi)


@dataclass(frozen=True)
class KParts:
    """The stored two-level structure of a K-quant weight (all float32, integers where codes)."""

    codes: torch.Tensor  # [out, nsup, nsb, sub] unsigned element codes
    sc: torch.Tensor  # [out, nsup, nsb]
    m: torch.Tensor | None
    d: torch.Tensor  # [out, nsup]
    dmin: torch.Tensor | None


def final_codes(x: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, dmin: torch.Tensor | None,
                m: torch.Tensor | None, kt: KType) -> torch.Tensor:
    """Signed element codes of ``x [..., nsb, sub]`` under the stored scales: `final_error`'s codes."""
    ds = d.unsqueeze(-1) * sc
    dm = torch.zeros_like(ds) if m is None else dmin.unsqueeze(-1) * m
    return element_codes(x, ds, dm, kt)


def final_error(x: torch.Tensor, wt: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, dmin: torch.Tensor | None,
                m: torch.Tensor | None, kt: KType) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted error per sub-block, codes) of ``x [..., nsb, sub]`` under stored scales.

    The effective scales are the fp32 products ggml forms, so the error is the stored one.
    """
    ds = d.unsqueeze(-1) * sc
    dm = torch.zeros_like(ds) if m is None else dmin.unsqueeze(-1) * m
    q = element_codes(x, ds, dm, kt)
    diff = q * ds.unsqueeze(-1) - dm.unsqueeze(-1) - x
    return (diff * diff * wt).sum(-1), q


REFINE_FACTORS = (0.92, 0.94, 0.96, 0.98, 1.02, 1.04, 1.06)  # super-block scales tried around the plain one


def double_quantize(x: torch.Tensor, wt: torch.Tensor, s: torch.Tensor, mn: torch.Tensor, kt: KType,
                    refine: bool = True) -> KParts:
    """Quantize sub-block scales/mins ``[out, nsup, nsb]`` to codes under fp16 super-block scales.

    refine: try super-block scales 0.90..1.10 times the plain one and, per sub-block, the
    scale (and min) codes one step either side, keeping whatever lowers the weighted error
    of the final weights: the codes of the stored grid, not of the float scales.
    """
    d0, sc0 = quantize_codes(s, kt.sc_lo, kt.sc_hi, kt.sym)
    dmin0, m0 = (None, None) if kt.sym else quantize_codes(mn, 0, kt.m_hi, False)
    best = (d0, sc0, dmin0, m0)
    if not refine:  # plain rounding: the codes under the stored scales, no error to weigh
        return KParts(final_codes(x, d0, sc0, dmin0, m0, kt) - kt.qmin, sc0, m0, d0, dmin0)
    best_e, _ = final_error(x, wt, d0, sc0, dmin0, m0, kt)
    if refine:
        tot = best_e.sum(-1)
        for f in REFINE_FACTORS:
            d = _f16(d0 * f)
            inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
            sc = (s * inv.unsqueeze(-1)).round().clamp(kt.sc_lo, kt.sc_hi)
            sc, m, e = _refine_codes(x, wt, d, sc, best[2], best[3], kt)
            better = (e.sum(-1) < tot)
            tot = torch.where(better, e.sum(-1), tot)
            b = better.unsqueeze(-1)
            best = (torch.where(better, d, best[0]), torch.where(b, sc, best[1]), best[2],
                    None if m is None else torch.where(b, m, best[3]))
        sc, m, _ = _refine_codes(x, wt, best[0], best[1], best[2], best[3], kt)
        best = (best[0], sc, best[2], m)
    _, q = final_error(x, wt, best[0], best[1], best[2], best[3], kt)
    return KParts((q - kt.qmin), best[1], best[3], best[0], best[2])


def _refine_codes(x, wt, d, sc, dmin, m, kt: KType):
    """Per sub-block, scale codes (then min codes) moved by -1/0/+1 where that lowers the error."""
    best_e, _ = final_error(x, wt, d, sc, dmin, m, kt)
    for step in (-1, 1):
        cand = (sc + step).clamp(kt.sc_lo, kt.sc_hi)
        e, _ = final_error(x, wt, d, cand, dmin, m, kt)
        better = e < best_e
        best_e, sc = torch.where(better, e, best_e), torch.where(better, cand, sc)
    if m is not None:
        for step in (-1, 1):
            cand = (m + step).clamp(0, kt.m_hi)
            e, _ = final_error(x, wt, d, sc, dmin, cand, kt)
            better = e < best_e
            best_e, m = torch.where(better, e, best_e), torch.where(better, cand, m)
    return sc, m, best_e


# weight of each element's error relative to its column importance, by K type: imp * sqrt(c * mean(x^2) + x^2)
# over the super-block (c = 0: the column importance alone)
MAGNITUDE = {2: 1.0, 3: 2.0, 4: 2.0, 5: 2.0, 6: 0.0}


def element_weights(x: torch.Tensor, wt: torch.Tensor, kt: KType) -> torch.Tensor:
    """Per-element error weights ``[rows, nsup, nsb, sub]`` from column importances ``wt``.

    The column importance (mean squared input) treats a column's errors alike whatever
    the weight's size; scaled by ``sqrt(c * mean(x^2) + x^2)`` over each super-block, the
    large weights of a sub-block count more, which is what llama.cpp's imatrix quantizers
    do (the same constants per type; Q6_K keeps the plain importance, as llama.cpp does).
    On the bundled model's Q2_K mix it lowers lowbit's perplexity a little
    (benchmarks/results/search_ablation.json).
    """
    c = MAGNITUDE.get(kt.bits, 0.0)
    if c == 0:
        return wt.expand_as(x)
    sigma2 = x.pow(2).mean((-1, -2), keepdim=True) * c
    return wt * (sigma2 + x * x).sqrt()


SEARCH_CHUNK = 1 << 16  # weights per slice of the searched path: its ~700 passes stay in the CPU's cache


FIT_CHUNK = 1 << 18  # weights per slice of the ``fit`` rule (`lowbit.formats.kquant_fit`: below this, its per-slice
# operations on per-sub-block numbers cost more than its passes over the weights)


def quantize_parts(w: torch.Tensor, kt: KType, imp: torch.Tensor | None = None, search: bool = True,
                   chunk: int | None = None, codes_dtype: torch.dtype = torch.float32, fast: bool = True,
                   fit: bool = False) -> KParts:
    """The K-quant parts of ``w [out, cols]`` (cols a multiple of 256), rows in chunks.

    chunk: rows per slice; None = about `SEARCH_CHUNK` weights when searching (each row's result is its
    own: the sums run within a sub- or super-block), 512 rows for plain rounding. The search's
    candidates are a few hundred elementwise passes over the slice: a slice of 64K weights (256 KB in
    float32) stays in cache, where 512 rows of 4096 (8 MB) went to memory every pass, 3x slower.
    codes_dtype: the element codes' dtype (uint8 when they go straight to storage: each slice's codes
    narrowed before the next, never a float32 copy of the whole matrix's, 235 MB at the 8B shape's widest).
    fast: the search through `lowbit.formats.kquant_search` (the same parts in fewer passes); False: the
    reference functions of this module, kept as the definition that path is tested against.
    fit: the ``fit`` rule instead (`lowbit.formats.kquant_fit`: a few refitted range candidates; ``search``
    must then be False), slices of about `FIT_CHUNK` weights.
    """
    from lowbit.formats import kquant_fit, kquant_search  # they build on this module's reference functions

    out, cols = w.shape
    if fit and search:
        raise ValueError("fit and search are two rules: pick one")
    if chunk is None:
        chunk = max(1, (FIT_CHUNK if fit else SEARCH_CHUNK) // max(cols, 1)) if search or fit else 512
    x = w.detach().float().reshape(out, cols // QK_K, kt.nsub, kt.sub)
    wt = torch.ones(cols, device=w.device) if imp is None else imp.detach().float().to(w.device).clamp_min(0)
    wt = wt.reshape(1, cols // QK_K, kt.nsub, kt.sub)
    if imp is not None:  # a column no calibration token reached still counts a little
        wt = wt + 1e-6 * wt.mean().clamp_min(1e-30)
    parts = []
    for xc in x.split(chunk):
        wc = element_weights(xc, wt, kt) if imp is not None else wt
        if fit:
            part = kquant_fit.quantize_slice(xc, wc if imp is not None else None, kt)
        elif search and fast:
            xc = xc.contiguous()
            s, mn = kquant_search.sub_block_params(xc, wc, kt, unit=imp is None)
            part = kquant_search.double_quantize(xc, wc, s, mn, kt, unit=imp is None)
        else:
            s, mn = sub_block_params(xc, wc, kt, search=search)
            part = double_quantize(xc, wc, s, mn, kt, refine=search)
        narrow = codes_dtype != part.codes.dtype
        parts.append(dataclasses.replace(part, codes=part.codes.to(codes_dtype)) if narrow else part)
    cat = (lambda k: torch.cat([getattr(p, k) for p in parts]))  # noqa: E731
    return KParts(cat("codes"), cat("sc"), None if kt.sym else cat("m"), cat("d"), None if kt.sym else cat("dmin"))


def parts_to_tensors(p: KParts, kt: KType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(codes uint8 [out, nsub, sub], sc [out, nsub], m or None, super scales [out, nsup, 1|2])."""
    out = p.codes.shape[0]
    codes = p.codes.reshape(out, -1, kt.sub).to(torch.uint8)
    sc = p.sc.reshape(out, -1) + 0.0  # integer codes: never -0.0 (gguf-py's int -> float gives +0.0)
    m = None if p.m is None else p.m.reshape(out, -1) + 0.0
    sup = p.d.unsqueeze(-1) if p.dmin is None else torch.stack([p.d, p.dmin], -1)
    return codes, sc, m, sup


def fit_width(scheme, in_features: int):
    """``scheme``, or for a K-quant on rows that are not a multiple of 256 the legacy type
    llama.cpp falls back to (``tensor_type_fallback`` in llama-quant.cpp), keeping the rule.
    A recipe keeps its input scheme; only its weight falls back."""
    weight = getattr(scheme, "weight", None)
    if weight is not None:
        return dataclasses.replace(scheme, weight=fit_width(weight, in_features))
    if not getattr(scheme, "super_block", 0) or in_features % QK_K == 0:
        return scheme
    # the legacy types have no ``fit`` rule: plain ranges, as before it existed
    return scheme.parse(FALLBACK[scheme.bits]).replace(rule="absmax" if scheme.rule == "fit" else scheme.rule)


# --------------------------------------------------------------------- the family
RULES = ("absmax", "fit", "search")  # plain ranges, the few-candidate fit, the full search
# the rule of the q2_k ... q6_k presets (and so of the llama.cpp mixes): what --no-search and the data-free
# streaming path's --no-search use; --search switches every scheme to ``search``
DEFAULT_RULE = "fit"
KQUANT_NAMES = tuple(f"q{b}_k" for b in KTYPES)


class KQuantFamily:
    """llama.cpp's Q2_K ... Q6_K: integer elements under integer sub-block scales under fp16 super-block scales."""

    name = "kquant"
    elements = ("int",)

    def claims(self, elem: str, super_block: int) -> bool:
        return bool(super_block)

    def weight_presets(self) -> dict[str, dict[str, Any]]:
        return {f"q{b}_k": {"elem": "int", "bits": b, "group_size": kt.sub, "sym": kt.sym, "scale": "fp16",
                            "super_block": QK_K, "rule": DEFAULT_RULE} for b, kt in KTYPES.items()}

    def input_presets(self) -> dict[str, dict[str, Any]]:
        return {}

    def check(self, s: Scheme) -> None:
        check(s.rule in RULES, f"K-quants take rule {', '.join(RULES)}, not {s.rule}")
        integer.FAMILY.check(s if s.rule != "fit" else dataclasses.replace(s, rule="absmax"))
        kt = KTYPES.get(s.bits) if s.elem == "int" else None
        check(s.super_block == QK_K and kt is not None and (s.group_size, s.sym, s.scale) == (kt.sub, kt.sym, "fp16")
              and s.full_range, f"super-block schemes are llama.cpp's K-quants only ({', '.join(KQUANT_NAMES)}); "
              "their sub-block, symmetry and scales are fixed")

    def check_input(self, s: Any) -> None:
        raise SchemeError("K-quants are weight formats; inputs cannot use them")

    def check_width(self, s: Scheme, in_features: int, where: str) -> None:
        if in_features % QK_K:
            raise SchemeError(
                f"{s.name} needs rows that are a multiple of {QK_K} weights; {where} has "
                f"{in_features} input columns. llama.cpp falls back to {FALLBACK_GGUF[s.bits]} for such "
                f"tensors: use {FALLBACK[s.bits]} for this layer (the K-quant mixes such as "
                f"{s.name}_m do so by themselves)"
            )
        blocks.check_width(s, in_features, where)

    scale_noun = "super-block scales"

    def scale_capacity(self, s: Scheme) -> float:
        """The largest fp16 super-block scale times the largest sub-scale code."""
        kt = ktype(s.bits)
        return 65504.0 * max(abs(kt.sc_lo), kt.sc_hi)

    def needed_scale(self, w: torch.Tensor, s: Scheme) -> float:
        """The sub-block scale the largest weight needs (asymmetric: the min code under dmin)."""
        kt = ktype(s.bits)
        levels = max(abs(kt.qmin), kt.qmax) if kt.sym else 1
        return float(w.abs().max()) / levels

    def wider_scale(self, s: Scheme) -> str | None:
        return None  # fp16 super-block scales are part of the format

    def lost_rows(self, w: torch.Tensor, s: Scheme) -> int:
        return 0

    def bits_per_weight(self, s: Scheme, in_features: int | None, count_scales: bool) -> float:
        """llama.cpp's bytes per 256-weight super-block, scales included."""
        return ktype(s.bits).bits_per_weight if count_scales else float(s.bits)

    def storage_bits(self, s: Scheme, shape: tuple[int, int], count_scales: bool) -> int:
        out, cols = shape
        return int(self.bits_per_weight(s, cols, True) * out * cols) if count_scales else s.bits * out * cols

    def grid(self, s: Scheme) -> torch.Tensor:
        kt = ktype(s.bits)
        return torch.arange(2**s.bits, dtype=torch.float32) + kt.qmin

    def elem_max(self, s: Any) -> float:
        raise SchemeError("K-quants are weight formats; inputs cannot use them")

    def round_input(self, t: torch.Tensor, s: Any) -> torch.Tensor:
        raise SchemeError("K-quants are weight formats; inputs cannot use them")

    def quantize(self, w: torch.Tensor, s: Scheme, imp: torch.Tensor | None = None,
                 tensor_scale: torch.Tensor | None = None) -> QTensor:
        """``rule='search'`` = weighted least squares + refined double quantization, ``fit`` = a few refitted
        range candidates (`lowbit.formats.kquant_fit`), both importance-weighted when ``imp`` is given;
        ``absmax`` = plain ranges."""
        kt = ktype(s.bits)
        parts = quantize_parts(w, kt, imp if s.rule in ("search", "fit") else None, search=s.rule == "search",
                               codes_dtype=torch.uint8, fit=s.rule == "fit")
        codes, sc, m, sup = parts_to_tensors(parts, kt)
        return QTensor(codes, sc, m, sup, tuple(w.shape), s)

    def dequantize(self, q: QTensor, dtype: torch.dtype) -> torch.Tensor:
        w = dequantize(q.codes, q.scales, q.zeros, q.tensor_scale, ktype(q.scheme.bits))
        return from_groups(w, q.shape[1]).to(dtype)

    def packed_shapes(self, shape: tuple[int, int], s: Scheme) -> dict[str, tuple[int, ...]]:
        out, cols = shape
        kt = ktype(s.bits)
        if cols % QK_K:
            raise CheckpointError(f"{s.name} weight of {cols} columns: K-quant rows are multiples of 256")
        nsub, nsup = cols // kt.sub, cols // QK_K
        d = {"codes": (out, packing.packed_bytes(nsub * kt.sub, kt.bits)), "scales": (out, nsub),
             "tensor_scale": (out, nsup, kt.nsuper_scales)}
        return d | ({} if kt.sym else {"zeros": (out, nsub)})

    def pack(self, q: QTensor) -> dict[str, torch.Tensor]:
        """Codes bit-packed, sub-scale codes int8 (they span -128..127 at most), min codes uint8,
        super-block scales fp16: every value stored exactly, nothing recomputed on load."""
        out = q.shape[0]
        d = {"codes": packing.pack(q.codes.reshape(out, -1), q.scheme.bits),
             "scales": q.scales.to(torch.int8), "tensor_scale": q.tensor_scale.to(torch.float16)}
        if q.zeros is not None:
            d["zeros"] = q.zeros.to(torch.uint8)
        return d

    def unpack(self, d: dict[str, torch.Tensor], shape: tuple[int, int], s: Scheme) -> QTensor:
        kt = ktype(s.bits)
        out, cols = shape
        nsub = cols // kt.sub
        dtypes = {"codes": torch.uint8, "scales": torch.int8, "tensor_scale": torch.float16, "zeros": torch.uint8}
        want = {k: (dtypes[k], shp) for k, shp in self.packed_shapes(shape, s).items()}
        extra = sorted(set(d) - set(want))
        if extra:
            raise CheckpointError(f"stored {s.name} weight has unexpected parts {extra}; the file was edited")
        for k, (dt, shp) in want.items():
            t = d.get(k)
            if t is None or t.dtype != dt or tuple(t.shape) != shp:
                got = "missing" if t is None else f"{t.dtype} {tuple(t.shape)}"
                raise CheckpointError(f"{s.name} {k} is {got}, expected {dt} {shp} for shape {shape}")
        codes = packing.unpack(d["codes"], kt.bits, nsub * kt.sub).reshape(out, nsub, kt.sub)
        sc = d["scales"].float()
        m = d["zeros"].float() if "zeros" in d else None
        if codes.numel() and (int(codes.max()) > kt.qmax - kt.qmin or int(sc.min()) < kt.sc_lo or
                              int(sc.max()) > kt.sc_hi or (m is not None and int(m.max()) > kt.m_hi)):
            raise CheckpointError(f"{s.name} codes out of range; the file was edited or damaged")
        return QTensor(codes, sc, m, d["tensor_scale"].float(), (out, cols), s)


FAMILY = KQuantFamily()
