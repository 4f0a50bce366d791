"""The ``fit`` K-quant rounding: a few range candidates, each refitted by least squares and judged from its sums.

lowbit's two older K-quant rules sit either side of llama.cpp's own quantizer on a random-normal
checkpoint (benchmarks/results/bigmodel.md, session 4): plain ranges (``absmax``) are cheap but 1.21x
llama.cpp's weight error on Q4_K, the full search (``search``, `lowbit.formats.kquant_search`) is 0.97x
its error at 4-5x its time per weight. Profiling where the search's accuracy comes from (session 5):

- the sub-block search is most of it, and a handful of range candidates already gives most of that:
  Q6_K gets 0.966x llama.cpp's error from two candidates, the search's 21 give 0.888x;
- an error judged *from the candidate's sums* costs nothing extra: for codes ``q`` held fixed, the
  error of any ``(scale s, min mn)`` is ``Sxx + s^2 Sqq + mn^2 Sw - 2 s mn Sq - 2 s Sqx + 2 mn Sx``
  (weighted sums over the sub-block), so the least-squares refit needs no second rounding pass
  (``Sxx`` is common to all candidates and left out); for symmetric types the refit's error is
  ``Sxx - Sqx^2 / Sqq`` (the candidate with the largest ``Sqx^2 / Sqq`` wins);
- one re-rounding of the winner under its refitted scale and min, refitted again (a Lloyd step),
  is worth more on Q4_K than two more range candidates;
- the stored-grid refinement (7 super-block scales x +-1 codes judged on the stored weight) is the
  most expensive part and buys ~3 % on Q4_K, nothing on Q6_K. Here the +-1 code moves are judged
  by the quadratic growth of each sub-block's error with its scale and min, ``[ds, dm] H [ds, dm]``
  with ``H`` the candidate's sums (``Sqq, -Sq, Sw``): a surrogate on per-sub-block numbers, no pass
  over the weights (worth ~1 % on Q4_K).

Cost (one 4096 x 4096 matrix, one thread): what is left are ~20-30 elementwise passes over the weights
(4 range candidates and one re-rounding for the asymmetric types, 2 for Q6_K, 1 for Q3_K,
then the final codes). Torch's own costs decided the rest: slices of 256K weights (a slice pays a few
hundred small per-sub-block operations; at 16K weights those cost more than the passes), the choice
among candidates as a fold of ``where`` (``argmin`` over a leading dimension of 2-5 was 100x slower),
and the sums of integer codes (``Sq``, ``Sqq``) as a matrix-vector product, which is exact in any order,
while ``Sqx`` and ``Sx`` use torch's row sum: BLAS's summation order depends on the address and the
number of rows, torch's row sum does not, so the result is a function of each row alone. The final
codes are the nearest ones under the stored (double-quantized) scales, as every lowbit K-quant rule
makes them (`kquants.final_codes`): the same in the streamed and in-model paths.
"""

from __future__ import annotations

import torch

from lowbit.formats import kquants as kq

# range candidates: the plain scale divided by f (f > 1 clips the range's ends); asymmetric types
# spread over [lo, hi], symmetric ones map the largest-magnitude value to qmin; 1.0 first
# Q3_K: one candidate (0.976x llama.cpp's error; a second, 0.970x, costs 25 % more and llama.cpp's Q3_K is its
# cheapest quantizer)
FACTORS = {2: (1.0, 0.925, 0.975, 1.025), 3: (1.0,), 4: (1.0, 0.925, 0.975, 1.025),
           5: (1.0, 0.925, 0.975, 1.025), 6: (1.0, 0.975)}
LLOYD = {2: 1, 3: 0, 4: 1, 5: 1, 6: 0}  # re-roundings of the winner under its refit
REFINE = {2: True, 3: False, 4: True, 5: True, 6: False}  # +-1 code moves (none measured on Q3_K / Q6_K)


def _sums(q: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None, buf: torch.Tensor,
          out: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]) -> None:
    """``sum w q`` (when ``out[0]`` is given), ``sum w q^2``, ``sum w q x`` per sub-block (rows of ``q``) into ``out``.

    Unweighted, the first two are sums of small integers, exact in any order, so a matrix-vector
    product does them (BLAS's order depends on alignment and row count, which cannot change an
    exact sum); ``sum q x`` is not exact and uses torch's row sum, whose order is the row's own.
    """
    sq, sqq, sqx = out
    if w is None:
        ones = torch.ones(q.shape[-1])
        if sq is not None:
            torch.mv(q, ones, out=sq)
        torch.mv(torch.mul(q, q, out=buf), ones, out=sqq)
        torch.sum(torch.mul(q, x, out=buf), -1, out=sqx)
        return
    wq = torch.mul(q, w, out=buf)
    if sq is not None:
        torch.sum(wq, -1, out=sq)
    torch.sum(wq * q, -1, out=sqq)
    torch.sum(wq.mul_(x), -1, out=sqx)


def _asym_err(s, mn, sw, sx, sq, sqq, sqx):
    """The weighted error of ``x ~ s q - mn`` less ``Sxx`` (the same for every candidate), from the sums."""
    return s * s * sqq + mn * mn * sw - 2 * s * mn * sq - 2 * s * sqx + 2 * mn * sx


def _pick(e: torch.Tensor, *vals: torch.Tensor) -> list[torch.Tensor]:
    """Per column of ``e [n, M]`` the first smallest candidate (NaN never wins), and ``vals [n, M]`` at it.

    A fold of ``torch.where`` over the few candidates: ``argmin`` over a short leading dimension
    is 100x slower in torch than these comparisons of ``[M]`` vectors.
    """
    best = e[0].nan_to_num(float("inf"), float("inf"), float("-inf"))
    out = [v[0] for v in vals]
    for i in range(1, e.shape[0]):
        b = e[i] < best
        best = torch.where(b, e[i], best)
        out = [torch.where(b, v[i], o) for v, o in zip(vals, out, strict=True)]
    return out


def _asym_fit(x: torch.Tensor, wt: torch.Tensor | None, kt: kq.KType):
    """``(s, mn, sw, sq, sqq)`` per sub-block (row) of ``x [M, sub]``: the best range candidate or refit.

    ``wt``: element weights ``[M, sub]`` or None (all ones). Every candidate's codes are summed once
    (``Sq, Sqq, Sqx``); its range scale and its least-squares refit are judged from those sums.
    """
    lo = x.amin(-1).clamp_(max=0)
    hi = x.amax(-1)
    span = hi - lo
    sw = torch.full_like(lo, float(kt.sub)) if wt is None else wt.sum(-1)
    sx = x.sum(-1) if wt is None else (wt * x).sum(-1)
    facs = FACTORS[kt.bits]
    n = len(facs)
    q, buf = torch.empty_like(x), torch.empty_like(x)
    base = torch.sub(x, lo.unsqueeze(-1), out=torch.empty_like(x))
    sq, sqq, sqx = (torch.empty(n + 1, *lo.shape) for _ in range(3))
    rspan = torch.where(span > 0, 1.0 / span, torch.zeros_like(span)).unsqueeze(-1)
    for k, f in enumerate(facs):
        torch.mul(base, rspan * (kt.qmax * f), out=q).round_()
        if f > 1:  # f <= 1 never rounds past qmax: x - lo <= hi - lo
            q.clamp_(max=kt.qmax)
        _sums(q, x, wt, buf, (sq[k], sqq[k], sqx[k]))
    s, mn = kq.lsq_from_sums(sw, sq[:n], sx, sqq[:n], sqx[:n], False)
    # candidate n: the plain range under codes of f = 1 (the refit's fallback where its fit is degenerate)
    sq[n], sqq[n], sqx[n] = sq[0], sqq[0], sqx[0]
    s = torch.cat([s, (span / kt.qmax).unsqueeze(0)])
    mn = torch.cat([mn, (-lo).unsqueeze(0)])
    best = _pick(_asym_err(s, mn, sw, sx, sq, sqq, sqx), s, mn, sq, sqq, sqx)
    for _ in range(LLOYD[kt.bits]):
        s, mn = best[0], best[1]
        inv = torch.where(s != 0, 1.0 / s, torch.zeros_like(s))
        torch.add(x, mn.unsqueeze(-1), out=q).mul_(inv.unsqueeze(-1)).round_().clamp_(0, kt.qmax)
        _sums(q, x, wt, buf, (sq[0], sqq[0], sqx[0]))
        s1, m1 = kq.lsq_from_sums(sw, sq[0], sx, sqq[0], sqx[0], False)
        take = _asym_err(s1, m1, sw, sx, sq[0], sqq[0], sqx[0]) < _asym_err(s, mn, sw, sx, *best[2:])
        best = [torch.where(take, a, b) for a, b in zip((s1, m1, sq[0], sqq[0], sqx[0]), best, strict=True)]
    return best[0], best[1], sw, best[2], best[3]


def _sym_fit(x: torch.Tensor, wt: torch.Tensor | None, kt: kq.KType):
    """``(s, sqq)`` per sub-block (row) of ``x [M, sub]``: the refit of the range candidate explaining most of ``Sxx``."""
    lo, hi = x.amin(-1), x.amax(-1)
    ext = torch.where(-lo > hi, lo, hi)  # the value of largest magnitude (its sign is the scale's)
    facs = FACTORS[kt.bits]
    q, buf = torch.empty_like(x), torch.empty_like(x)
    sqq, sqx = torch.empty(len(facs), *lo.shape), torch.empty(len(facs), *lo.shape)
    rext = torch.where(ext != 0, kt.qmin / ext, torch.zeros_like(ext)).unsqueeze(-1)
    for k, f in enumerate(facs):
        torch.mul(x, rext * f, out=q).round_()
        # |x * inv| <= |qmin| * f: ext lands on qmin * f >= qmin when f <= 1, the other side on at most
        # |qmin| * f, which rounds past qmax only when |qmin| * f > qmax + 1/2
        if f > 1:
            q.clamp_(kt.qmin, kt.qmax)
        elif -kt.qmin * f > kt.qmax + 0.5:
            q.clamp_(max=kt.qmax)
        _sums(q, x, wt, buf, (None, sqq[k], sqx[k]))
    ok = sqq > 0
    den = torch.where(ok, sqq, torch.ones_like(sqq))
    e = torch.where(ok, -(sqx * sqx) / den, torch.zeros_like(sqq))
    return _pick(e, torch.where(ok, sqx / den, torch.zeros_like(sqq)), sqq)


def _surrogate(s, mn, d, sc, dmin, m, sw, sq, sqq):
    """Growth of each sub-block's error when its (scale, min) move to the stored ``(d*sc, dmin*m)``, codes held."""
    ds = d.unsqueeze(-1) * sc - s
    if m is None:
        return ds * ds * sqq
    dm = dmin.unsqueeze(-1) * m - mn
    return ds * ds * sqq - 2 * ds * dm * sq + dm * dm * sw


def _refine(s, mn, d, sc, dmin, m, hess, kt: kq.KType):
    """Scale codes, then min codes, moved by -1 / +1 where the surrogate says the error shrinks."""
    best = _surrogate(s, mn, d, sc, dmin, m, *hess)
    for step in (-1, 1):
        c = (sc + step).clamp(kt.sc_lo, kt.sc_hi)
        e = _surrogate(s, mn, d, c, dmin, m, *hess)
        b = e < best
        best, sc = torch.where(b, e, best), torch.where(b, c, sc)
    if m is not None:
        for step in (-1, 1):
            c = (m + step).clamp(0, kt.m_hi)
            e = _surrogate(s, mn, d, sc, dmin, c, *hess)
            b = e < best
            best, m = torch.where(b, e, best), torch.where(b, c, m)
    return sc, m


def quantize_slice(x: torch.Tensor, wt: torch.Tensor | None, kt: kq.KType) -> kq.KParts:
    """The K-quant parts of ``x [rows, nsup, nsb, sub]``; ``wt`` the element weights (None: all ones)."""
    shape = x.shape[:-1]
    xr = x.reshape(-1, kt.sub)
    wr = None if wt is None else wt.expand_as(x).reshape(-1, kt.sub)
    if kt.sym:
        s, sqq = _sym_fit(xr, wr, kt)
        s, mn, hess = s.reshape(shape), None, (None, None, sqq.reshape(shape))
    else:
        s, mn, sw, sq, sqq = _asym_fit(xr, wr, kt)
        s, mn, hess = s.reshape(shape), mn.reshape(shape), tuple(t.reshape(shape) for t in (sw, sq, sqq))
    d, sc = kq.quantize_codes(s, kt.sc_lo, kt.sc_hi, kt.sym)
    dmin, m = (None, None) if kt.sym else kq.quantize_codes(mn, 0, kt.m_hi, False)
    if REFINE[kt.bits]:
        sc, m = _refine(s, mn, d, sc, dmin, m, hess, kt)
    # kq.final_codes: ((x + dmin*m) * (1 / (d*sc))).round().clamp()
    ds = d.unsqueeze(-1) * sc
    inv = torch.where(ds != 0, 1.0 / ds, torch.zeros_like(ds)).unsqueeze(-1)
    q = x * inv if m is None else (x + (dmin.unsqueeze(-1) * m).unsqueeze(-1)).mul_(inv)
    q = q.round_().clamp_(kt.qmin, kt.qmax)
    # unsigned codes q - qmin: for the symmetric types through int8, shifted as bytes (a pass over 1 byte per weight)
    codes = q.to(torch.uint8) if not kt.qmin else q.to(torch.int8).view(torch.uint8).add_(-kt.qmin)
    return kq.KParts(codes, sc, m, d, dmin)
