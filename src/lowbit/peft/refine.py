"""QWHA initialisation: choose coefficient positions and solve their values.

For a layer with quantization error ``E = W_fp - dequant(W_q)`` and calibration
second moment ``XtX = sum x x^T`` (from the *calibration* split only), the adapter
``Delta_W = F H^-1`` should minimise the layer-output error ``||X (E - Delta_W)^T||^2``.
In the WHT domain that is, for each row i with positions S_i,

    G = H^-1 XtX H^-T = H^T XtX H / n^2,      b_i = H^-1 XtX e_i = H^T XtX e_i / n
    x_i = argmin_x  || R (e_i - H^-T[:, S_i] x) ||^2  =>  G[S_i, S_i] x_i = b_i[S_i]

(``R^T R = XtX``; we never need R itself). Positions are the top-k_i of
``G_jj * C_ij^2`` (output-space energy of each error coefficient, ``C = E H``) with k_i
from AdaAlloc. Without calibration data the values are the error coefficients
themselves (the weight-space optimum for the chosen positions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.peft.adaalloc import allocate
from lowbit.transforms.hadamard import pad_last, plan_width, wht

SOLVE_CHUNK = 1 << 24  # elements of the batched k x k systems solved at once


@dataclass(frozen=True)
class QWHAInit:
    """Positions and values of a QWHA adapter (flat, row-major by row)."""

    rows: torch.Tensor
    cols: torch.Tensor
    values: torch.Tensor
    counts: torch.Tensor  # per-row budget k_i


def damped(xtx: torch.Tensor, damp: float = 1e-4) -> torch.Tensor:
    """``XtX + damp * mean(diag) * I`` so every sub-system is well posed."""
    eps = damp * float(torch.diagonal(xtx).mean().clamp_min(1e-12))
    return xtx + eps * torch.eye(xtx.shape[0], dtype=xtx.dtype, device=xtx.device)


def error_spectrum(err: torch.Tensor, n: int) -> torch.Tensor:
    """``C = E H`` row by row (so that ``E = C H^-1``), padded to width n."""
    return wht(pad_last(err.double(), n), transpose=True)


def wht_gram(xtx: torch.Tensor, n: int) -> torch.Tensor:
    """``H^T XtX H / n^2`` for a (padded) ``XtX``: the Gram matrix of the WHT basis on the data."""
    x = torch.zeros(n, n, dtype=torch.float64, device=xtx.device)
    d = xtx.shape[0]
    x[:d, :d] = xtx.double()
    m = wht(x, transpose=True)  # XtX H
    return wht(m.T.contiguous(), transpose=True).T / n**2


def select_positions(score: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row i the ``counts[i]`` columns of highest ``score``; returns flat (rows, cols)."""
    order = torch.argsort(score, dim=1, descending=True)
    keep = torch.arange(score.shape[1], device=score.device)[None, :] < counts[:, None].to(score.device)
    rows = torch.arange(score.shape[0], device=score.device)[:, None].expand_as(order)
    return rows[keep], order[keep]


def solve_rows(gram: torch.Tensor, rhs: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
               counts: torch.Tensor) -> torch.Tensor:
    """Solve ``G[S_i, S_i] x_i = rhs_i[S_i]`` for every row, batched by padded size.

    Rows are bucketed by k_i rounded up to a power of two (few buckets, at most 2x
    padding), each bucket solved in chunks of at most ``SOLVE_CHUNK`` elements; padded
    slots get an identity row and a zero right-hand side, so they solve to 0.
    """
    starts = torch.cumsum(counts, 0) - counts
    values = torch.zeros(rows.numel(), dtype=torch.float64, device=gram.device)
    ridge = 1e-9 * float(torch.diagonal(gram).mean().clamp_min(1e-300))
    nonzero = counts > 0
    size = torch.where(nonzero, 2 ** torch.ceil(torch.log2(counts.clamp_min(1).double())).long(), 0)
    for k in torch.unique(size[nonzero]).tolist():
        members = torch.nonzero(size == k).flatten()
        for chunk in torch.split(members, max(1, SOLVE_CHUNK // (k * k))):
            _solve_chunk(gram, rhs, cols, starts[chunk], counts[chunk], chunk, k, ridge, values)
    return values


def _solve_chunk(gram, rhs, cols, starts, counts, chunk, k, ridge, values) -> None:
    slot = torch.arange(k, device=gram.device)
    valid = slot[None, :] < counts[:, None]
    flat = torch.where(valid, starts[:, None] + slot[None, :], torch.zeros_like(valid, dtype=torch.long))
    idx = torch.where(valid, cols[flat], torch.zeros_like(flat))
    g = gram[idx[:, :, None], idx[:, None, :]]
    pair = valid[:, :, None] & valid[:, None, :]
    eye = torch.eye(k, dtype=g.dtype, device=g.device).expand_as(g)
    g = torch.where(pair, g + ridge * eye, eye)
    b = torch.where(valid, torch.gather(rhs[chunk], 1, idx), torch.zeros((), dtype=rhs.dtype))
    x = torch.linalg.solve(g, b.unsqueeze(-1)).squeeze(-1)
    values[flat[valid]] = x[valid]


def init_qwha(err: torch.Tensor, budget: int, xtx: torch.Tensor | None = None, k_min: int = 1,
              damp: float = 1e-4, refine: bool = True) -> QWHAInit:
    """AdaAlloc + position selection (+ least-squares refinement when ``xtx`` is given)."""
    out_features, in_features = err.shape
    n = plan_width(in_features).n
    c = error_spectrum(err, n)
    counts = allocate(c.norm(dim=1), budget, n, k_min)
    if xtx is None:
        rows, cols = select_positions(c.square(), counts)
        return QWHAInit(rows, cols, c[rows, cols].float(), counts)
    xd = damped(xtx.double(), damp)
    gram = wht_gram(xd, n)
    rows, cols = select_positions(torch.diagonal(gram)[None, :] * c.square(), counts)
    if not refine:
        return QWHAInit(rows, cols, c[rows, cols].float(), counts)
    rhs = error_spectrum(err.double() @ xd, n) / n
    values = solve_rows(gram, rhs, rows, cols, counts)
    return QWHAInit(rows, cols, values.float(), counts)
