"""The searched K-quant rounding in fewer passes: `kquants`' reference search, value for value.

The reference (`kquants.sub_block_params` + `kquants.double_quantize`) forms every candidate's
weighted sums and errors from scratch: about 35 elementwise passes over the weights per range
candidate and 10 per stored-grid candidate, with the element weights multiplied in even when they
are all ones (the data-free path), each pass into a fresh tensor. This path does the same
arithmetic with less work:

- what no candidate changes is formed once per slice: ``x + min`` of the range candidates (the
  min is ``-lo`` or 0 for all of them), ``sum(w*x)``, ``sum(w)``, and ``x + min`` of the stored
  grid while only its scale codes move;
- a range candidate's error reuses the codes its least-squares refit was computed from (the
  reference rounds them twice);
- weights that are all ones are not multiplied in (``1 * v == v`` exactly), a zero min is not
  subtracted (``v - 0 == v``);
- the per-sub-block error of the best stored grid is carried through the scale search instead of
  recomputed for the last code refinement, and the final codes are rounded without their error;
- every pass writes into a buffer of the slice's shape reused by all candidates.

Every float that decides a comparison is produced by the same torch operation on operands of the
same values, shape and layout as in the reference, so sums add in the same order and the codes,
scale codes and super-block scales are identical (tests/test_kquant_search.py compares the two on
random tensors bit for bit; tests/test_kquants.py compares the result with llama.cpp's).
"""

from __future__ import annotations

import torch

from lowbit.formats import kquants as kq


class _Slice:
    """One slice of weights ``x [rows, nsup, nsb, sub]`` (contiguous), its element weights and work buffers."""

    def __init__(self, x: torch.Tensor, wt: torch.Tensor, kt: kq.KType, unit: bool):
        self.x, self.wt, self.kt, self.unit = x, wt, kt, unit
        self.q, self.d, self.t = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)

    def codes(self, xm: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`kq.element_codes` from ``x + min`` already formed: ``((x + mn) * inv(s)).round().clamp()``."""
        inv = torch.where(s != 0, 1.0 / s, torch.zeros_like(s))
        return torch.mul(xm, inv.unsqueeze(-1), out=out).round_().clamp_(self.kt.qmin, self.kt.qmax)

    def error(self, q: torch.Tensor, s: torch.Tensor, mn: torch.Tensor | None, out: torch.Tensor | None = None
              ) -> torch.Tensor:
        """``sum(wt * (q*s - mn - x)^2)`` per sub-block, as `kq._err` / `kq.final_error` form it; ``mn`` None: zero."""
        d = torch.mul(q, s.unsqueeze(-1), out=self.d)
        if mn is not None:
            d.sub_(mn.unsqueeze(-1))
        d.sub_(self.x).mul_(d)
        if not self.unit:
            d.mul_(self.wt)
        return d.sum(-1) if out is None else torch.sum(d, -1, out=out)

    def plus(self, mn: torch.Tensor | None) -> torch.Tensor:
        """``x + mn`` into the spare buffer (``x + 0`` for the symmetric types: the reference adds a zero min too)."""
        if mn is None:
            return torch.add(self.x, 0.0, out=self.t)
        return torch.add(self.x, mn.unsqueeze(-1), out=self.t)


def _first_min(errs: torch.Tensor) -> torch.Tensor:
    """Index (keepdim) of the candidate a sequential ``if e < best: take it`` over ``errs [n, ...]`` keeps.

    That fold keeps the first of equal errors and never takes a NaN, nor anything after a NaN start;
    ``argmin`` returns the first minimum, so NaNs become +inf (and everything after a NaN start too).
    """
    nan = errs.isnan()
    errs = errs.masked_fill(nan | nan[0], float("inf"))
    errs[0] = errs[0].masked_fill(nan[0], 0.0)
    return errs.argmin(0, keepdim=True)


def sub_block_params(x: torch.Tensor, wt: torch.Tensor, kt: kq.KType, unit: bool, steps: int = 20
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`kq.sub_block_params` (``search=True``): the same ``(scale, min)`` per sub-block.

    unit: ``wt`` is all ones (no importance), so its products are skipped. The per-sub-block
    arithmetic of all candidates (their scales, the least-squares refits, the choice) runs batched
    over a leading candidate dimension; the passes over the weights run one candidate at a time,
    on a slice that stays in cache (a batch of all 21 candidates' weights ran 1.7x slower).
    """
    sl = _Slice(x, wt, kt, unit)
    lo, hi, ext, best_s, best_m = kq.range_params(x, kt)
    m0 = best_m  # every range candidate's min: -lo, or zeros
    m_err = None if kt.sym else m0
    xm0 = x + m0.unsqueeze(-1)
    init = sl.error(sl.codes(xm0, best_s, sl.q), best_s, m_err)
    sw = wt.sum(-1)
    sx = x.sum(-1) if unit else (wt * x).sum(-1)
    # the reference divides by each Python float f; torch rounds it to float32 first, as this tensor holds it
    f = torch.tensor([0.9 + 0.4 * k / steps for k in range(steps + 1)]).view(-1, *([1] * lo.dim()))
    s0 = ext / kt.qmin / f if kt.sym else ((hi - lo) / kt.qmax / f).clamp_min(0)
    inv0 = torch.where(s0 != 0, 1.0 / s0, torch.zeros_like(s0))
    e0, e1, sq, sqq, sqx = (torch.empty_like(s0) for _ in range(5))
    for k in range(len(s0)):
        q = torch.mul(xm0, inv0[k].unsqueeze(-1), out=sl.q).round_().clamp_(kt.qmin, kt.qmax)
        sl.error(q, s0[k], m_err, out=e0[k])
        if unit:
            torch.sum(q, -1, out=sq[k])
            torch.sum(torch.mul(q, q, out=sl.t), -1, out=sqq[k])
            torch.sum(torch.mul(q, x, out=sl.t), -1, out=sqx[k])
        else:
            wq = torch.mul(wt, q, out=sl.d)
            torch.sum(wq, -1, out=sq[k])
            torch.sum(torch.mul(wq, q, out=sl.t), -1, out=sqq[k])
            torch.sum(torch.mul(wq, x, out=sl.t), -1, out=sqx[k])
    s1, m1 = kq.lsq_from_sums(sw, sq, sx, sqq, sqx, kt.sym)
    inv1 = torch.where(s1 != 0, 1.0 / s1, torch.zeros_like(s1))
    for k in range(len(s1)):
        xm1 = xm0 if kt.sym else torch.add(x, m1[k].unsqueeze(-1), out=sl.t)
        q = torch.mul(xm1, inv1[k].unsqueeze(-1), out=sl.q).round_().clamp_(kt.qmin, kt.qmax)
        sl.error(q, s1[k], None if kt.sym else m1[k], out=e1[k])
    # the reference's order: the start, then per k the range candidate and its refit
    order = lambda first, a, b: torch.cat([first.unsqueeze(0), torch.stack((a, b), 1).flatten(0, 1)])  # noqa: E731
    pick = _first_min(order(init, e0, e1))
    s = order(best_s, s0, s1).gather(0, pick).squeeze(0)
    mn = order(best_m, m0.expand_as(m1), m1).gather(0, pick).squeeze(0)
    return s, mn


class _Grid:
    """The stored grid's error and codes for one slice: scale ``d*sc`` and min ``dmin*m`` per sub-block."""

    def __init__(self, sl: _Slice):
        self.sl = sl
        self.x0 = None if not sl.kt.sym else sl.x + 0.0  # symmetric: x + (zero min), the same for every grid

    def plus(self, dmin: torch.Tensor | None, m: torch.Tensor | None) -> torch.Tensor:
        if m is None:
            return self.x0
        return self.sl.plus(dmin.unsqueeze(-1) * m)

    def error(self, xm: torch.Tensor, d: torch.Tensor, sc: torch.Tensor, dmin: torch.Tensor | None,
              m: torch.Tensor | None) -> torch.Tensor:
        """`kq.final_error`'s error; ``xm`` = ``x + dmin*m`` from `plus`."""
        ds = d.unsqueeze(-1) * sc
        dm = None if m is None else dmin.unsqueeze(-1) * m
        return self.sl.error(self.sl.codes(xm, ds, self.sl.q), ds, dm)

    def codes(self, d: torch.Tensor, sc: torch.Tensor, dmin: torch.Tensor | None, m: torch.Tensor | None
              ) -> torch.Tensor:
        """`kq.final_codes` (signed), in a fresh tensor."""
        return self.sl.codes(self.plus(dmin, m), d.unsqueeze(-1) * sc, torch.empty_like(self.sl.x))

    def refine_codes(self, d, sc, dmin, m, start: torch.Tensor | None = None):
        """`kq._refine_codes`; ``start``: the error of ``(d, sc, dmin, m)`` when already known."""
        kt = self.sl.kt
        xm = self.plus(dmin, m)
        best_e = self.error(xm, d, sc, dmin, m) if start is None else start
        for step in (-1, 1):
            cand = (sc + step).clamp(kt.sc_lo, kt.sc_hi)
            e = self.error(xm, d, cand, dmin, m)
            better = e < best_e
            best_e, sc = torch.where(better, e, best_e), torch.where(better, cand, sc)
        if m is not None:
            for step in (-1, 1):
                cand = (m + step).clamp(0, kt.m_hi)
                e = self.error(self.plus(dmin, cand), d, sc, dmin, cand)
                better = e < best_e
                best_e, m = torch.where(better, e, best_e), torch.where(better, cand, m)
        return sc, m, best_e


def double_quantize(x: torch.Tensor, wt: torch.Tensor, s: torch.Tensor, mn: torch.Tensor, kt: kq.KType,
                    unit: bool) -> kq.KParts:
    """`kq.double_quantize` (``refine=True``): the same parts."""
    grid = _Grid(_Slice(x, wt, kt, unit))
    d0, sc0 = kq.quantize_codes(s, kt.sc_lo, kt.sc_hi, kt.sym)
    dmin0, m0 = (None, None) if kt.sym else kq.quantize_codes(mn, 0, kt.m_hi, False)
    best = (d0, sc0, dmin0, m0)
    best_e = grid.error(grid.plus(dmin0, m0), d0, sc0, dmin0, m0)  # per sub-block, of `best` throughout
    tot = best_e.sum(-1)
    for f in kq.REFINE_FACTORS:
        d = kq._f16(d0 * f)
        inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
        sc = (s * inv.unsqueeze(-1)).round().clamp(kt.sc_lo, kt.sc_hi)
        sc, m, e = grid.refine_codes(d, sc, best[2], best[3])
        better = e.sum(-1) < tot
        tot = torch.where(better, e.sum(-1), tot)
        b = better.unsqueeze(-1)
        best = (torch.where(better, d, best[0]), torch.where(b, sc, best[1]), best[2],
                None if m is None else torch.where(b, m, best[3]))
        best_e = torch.where(b, e, best_e)
    sc, m, _ = grid.refine_codes(best[0], best[1], best[2], best[3], start=best_e)
    q = grid.codes(best[0], sc, best[2], m)
    return kq.KParts(q - kt.qmin, sc, m, best[0], best[2])

