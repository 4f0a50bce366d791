"""QAT quantizers Q_b(W; alpha) with learnable per-row scales and the clipped STE.

Each quantizer is a frozen dataclass with four jobs: initialise the per-row scale
``alpha [out, 1]``, fake-quantize in the forward pass (values on the grid, gradients
through the rounding), say which entries are in range, and turn the trained latent
weight into an exact `QTensor` so the result saves and evaluates like a PTQ model.

- `Sign` (1-bit): ``sign(W) * alpha``.
- `StretchedElastic` (ternary, 2-bit): ``(round(clamp(W/alpha, -.99, .99) * n - s) + s) / n``.
- `LSQ` (3/4-bit): ``round(clamp(W/alpha, -2^(b-1), 2^(b-1)-1)) * alpha``, step gradient
  scaled by ``1/sqrt(in_features * Qp)`` (the row's weights share one step).
- `SchemeFakeQuant`: any lowbit `Scheme` (group INT, NVFP4...) through ``formats.qdq``;
  its scales follow the weights (no learnable alpha).

The clipped STE: the weight gradient is 1 inside the clipping range and 0 outside;
the scale gets the LSQ gradient, which autograd derives from the expressions below.

Storage (exact, per row, fp32 scales): sign -> int2 codes {-1, +1}; ternary -> int2
codes {-1, 0, 1} with scale 2*alpha/3; 2-bit -> asymmetric int2 with zero point 1.5
and scale alpha/2; LSQ b-bit -> symmetric int b with scale alpha.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.errors import SchemeError
from lowbit.formats import QTensor, Scheme, qdq, quantize

_EPS = 1e-8


class _RowSTE(torch.autograd.Function):
    """``alpha * L(clamp(w / alpha, lo, hi))`` with the clipped STE, in few weight-sized passes.

    Autograd through the plain expression keeps ~10 weight-sized temporaries per layer and
    replays each op backwards; on CPU that was about half of a QAT step's non-GEMM time.
    With ``x = w / alpha`` and ``y`` the output (which the following GEMM keeps alive anyway):
    ``dW = g * [lo <= x <= hi]`` and ``dalpha = gscale * (sum_row(g * y) / alpha -
    sum_row(dW * x))``, the same as autograd derives from the expression (tests compare
    the two); the row sums are dot products, so no product tensor is built.
    """

    @staticmethod
    def forward(ctx, w, alpha, levels, lo, hi, gscale):  # noqa: ANN001, ANN205 - autograd signature
        y = levels((w / alpha).clamp_(lo, hi)).mul_(alpha)
        ctx.save_for_backward(w, alpha, y)
        ctx.levels, ctx.lo, ctx.hi, ctx.gscale = levels, lo, hi, gscale
        return y

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        w, alpha, y = ctx.saved_tensors
        x = w / alpha
        if ctx.lo == -ctx.hi:
            inside = x.abs() <= ctx.hi
        else:
            inside = (x >= ctx.lo) & (x <= ctx.hi)
        gw = torch.where(inside, g, 0.0)
        ga = None
        if ctx.needs_input_grad[1]:
            gy, gx = _row_dot(g, y), _row_dot(gw, x)
            ga = (gy / alpha - gx).mul_(ctx.gscale)
            if ga.shape != alpha.shape:
                ga = ga.sum_to_size(alpha.shape)
        return gw if ctx.needs_input_grad[0] else None, ga, None, None, None, None


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``(a * b).sum(1, keepdim=True)`` without building the product tensor."""
    return torch.linalg.vecdot(a, b, dim=1).unsqueeze(1)


def row_ste(w: torch.Tensor, alpha: torch.Tensor, levels, lo: float, hi: float,  # noqa: ANN001
            gscale: float = 1.0) -> torch.Tensor:
    """Fake-quantize with a per-row scale; ``levels`` maps a clamped ratio to its grid value."""
    return _RowSTE.apply(w, alpha, levels, lo, hi, gscale)


def _per_row(scheme_bits: int, sym: bool) -> Scheme:
    return Scheme(elem="int", bits=scheme_bits, group_size=-1, sym=sym, scale="fp32")


def _qtensor(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: Scheme) -> QTensor:
    """Integer levels ``q [out, in]`` and per-row scale ``[out, 1]`` -> per-row QTensor."""
    out, cols = q.shape
    codes = (q - scheme.qmin).to(torch.uint8).reshape(out, 1, cols)
    z = None if zero is None else zero.reshape(out, 1).float()
    return QTensor(codes, scale.reshape(out, 1).float(), z, None, (out, cols), scheme)


def _sign_levels(x: torch.Tensor) -> torch.Tensor:
    """Ratio -> +-1 (zero counts as +1, matching `Sign.levels`)."""
    return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)


@dataclass(frozen=True)
class Sign:
    """1-bit: sign(W) * alpha, alpha initialised to mean |W_r|."""

    name: str = "sign"
    learnable: bool = True

    @property
    def bits(self) -> float:
        return 1.0

    def init_scale(self, w: torch.Tensor) -> torch.Tensor:
        return w.abs().mean(1, keepdim=True).clamp_min(_EPS)

    def fake(self, w: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        return row_ste(w, alpha, _sign_levels, -1.0, 1.0)

    def levels(self, w: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        return torch.where(w >= 0, 1.0, -1.0)

    def to_qtensor(self, w: torch.Tensor, alpha: torch.Tensor) -> QTensor:
        return _qtensor(self.levels(w, alpha), alpha, None, _per_row(2, True))


@dataclass(frozen=True)
class StretchedElastic:
    """Ternary (bits=1.58, levels {-2/3, 0, 2/3}*alpha) or 2-bit (levels {+-1/4, +-3/4}*alpha)."""

    ternary: bool = False
    learnable: bool = True

    @property
    def name(self) -> str:
        return "ternary" if self.ternary else "seq2"

    @property
    def bits(self) -> float:
        return 1.58 if self.ternary else 2.0

    @property
    def n(self) -> float:
        return 1.5 if self.ternary else 2.0

    @property
    def shift(self) -> float:
        return 0.0 if self.ternary else 0.5

    def init_scale(self, w: torch.Tensor) -> torch.Tensor:
        return w.abs().amax(1, keepdim=True).clamp_min(_EPS)

    def fake(self, w: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        return row_ste(w, alpha, self._grid, -0.99, 0.99)

    def _grid(self, x: torch.Tensor) -> torch.Tensor:
        """In place: clamped ratio -> (round(x*n - s) + s) / n."""
        return x.mul_(self.n).sub_(self.shift).round_().add_(self.shift).div_(self.n)

    def levels(self, w: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        """Integer k with value (k + shift) / n * alpha."""
        return torch.round(torch.clamp(w / alpha, -0.99, 0.99) * self.n - self.shift)

    def to_qtensor(self, w: torch.Tensor, alpha: torch.Tensor) -> QTensor:
        k = self.levels(w, alpha)
        if self.ternary:
            return _qtensor(k, alpha / self.n, None, _per_row(2, True))
        zero = torch.full((w.shape[0], 1), 1.5)
        return _qtensor(k + 2, alpha / self.n, zero, _per_row(2, False))  # (u - 1.5) * alpha/2


@dataclass(frozen=True)
class LSQ:
    """Symmetric b-bit with a learnable per-row step alpha, init max|W_r| / (2^(b-1)-1)."""

    nbits: int = 4
    learnable: bool = True

    def __post_init__(self) -> None:
        if not 2 <= self.nbits <= 8:
            raise SchemeError(f"LSQ needs 2..8 bits, got {self.nbits}")

    @property
    def name(self) -> str:
        return f"lsq{self.nbits}"

    @property
    def bits(self) -> float:
        return float(self.nbits)

    @property
    def qn(self) -> int:
        return 2 ** (self.nbits - 1)

    @property
    def qp(self) -> int:
        return 2 ** (self.nbits - 1) - 1

    def init_scale(self, w: torch.Tensor) -> torch.Tensor:
        return (w.abs().amax(1, keepdim=True) / self.qp).clamp_min(_EPS)

    def fake(self, w: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        return row_ste(w, alpha, torch.round_, -self.qn, self.qp, 1.0 / (w.shape[1] * self.qp) ** 0.5)

    def levels(self, w: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
        return torch.round(torch.clamp(w / alpha, -self.qn, self.qp))

    def to_qtensor(self, w: torch.Tensor, alpha: torch.Tensor) -> QTensor:
        return _qtensor(self.levels(w, alpha), alpha, None, _per_row(self.nbits, True))


@dataclass(frozen=True)
class SchemeFakeQuant:
    """Any lowbit Scheme via ``qdq`` with the identity STE; scales are re-derived from W."""

    scheme: Scheme
    learnable: bool = False

    @property
    def name(self) -> str:
        return f"fake:{self.scheme.name}"

    @property
    def bits(self) -> float:
        return float(self.scheme.bits)

    def init_scale(self, w: torch.Tensor) -> torch.Tensor:
        return w.abs().amax(1, keepdim=True).clamp_min(_EPS)  # only sizes relative noise

    def fake(self, w: torch.Tensor, alpha: torch.Tensor | None) -> torch.Tensor:
        with torch.no_grad():
            delta = qdq(w.detach().float(), self.scheme).to(w.dtype) - w.detach()
        return w + delta

    def to_qtensor(self, w: torch.Tensor, alpha: torch.Tensor | None) -> QTensor:
        return quantize(w.detach().float(), self.scheme)


Quantizer = Sign | StretchedElastic | LSQ | SchemeFakeQuant
KINDS = ("auto", "sign", "ternary", "seq", "lsq", "fake")
_ALIASES = {"w1": "sign", "sign": "sign", "w1.58": "ternary", "ternary": "ternary", "t": "ternary"}


def resolve(scheme: str, kind: str = "auto") -> Quantizer:
    """The QAT quantizer for a scheme name.

    ``w1``/``sign`` -> 1-bit sign; ``w1.58``/``ternary`` -> ternary stretched elastic;
    with ``auto``: per-row ``w2`` -> 2-bit stretched elastic, per-row ``w3``/``w4`` -> LSQ,
    anything else `Scheme.parse` accepts (``w2g64``, ``nvfp4``...) -> fake quantization.
    An explicit ``kind`` that cannot express the scheme is an error, never a silent switch.
    """
    if kind not in KINDS:
        raise SchemeError(f"unknown QAT quantizer {kind!r}; choose one of {KINDS}")
    text = scheme.strip().lower() if isinstance(scheme, str) else scheme
    alias = _ALIASES.get(text) if isinstance(text, str) else None
    if alias is not None:
        if kind not in ("auto", alias, "seq" if alias == "ternary" else alias):
            raise SchemeError(f"{scheme!r} is a {alias} scheme; the {kind} quantizer cannot express it — "
                              f"use --quantizer auto or {alias}")
        return Sign() if alias == "sign" else StretchedElastic(ternary=True)
    s = _parse(scheme)
    per_row_int = s.family.name == "int" and s.group_size == -1 and s.sym
    if kind == "auto":
        if per_row_int and s.bits == 2:
            return StretchedElastic()
        if per_row_int and s.bits in (3, 4):
            return LSQ(s.bits)
        return SchemeFakeQuant(s)
    if kind == "fake":
        return SchemeFakeQuant(s)
    if kind == "seq":
        _need(per_row_int and s.bits == 2, s, "stretched elastic", "w2 (per row) or ternary")
        return StretchedElastic()
    if kind == "lsq":
        _need(per_row_int, s, "LSQ", "w3 or w4 (symmetric, per row)")
        return LSQ(s.bits)
    _need(False, s, kind, "w1 / sign")
    raise AssertionError  # unreachable


def _parse(scheme: str | Scheme) -> Scheme:
    try:
        return Scheme.parse(scheme)
    except SchemeError as e:
        raise SchemeError(f"{e}; QAT also accepts w1 (sign) and w1.58 / ternary") from None


def _need(ok: bool, s: Scheme, what: str, expressible: str) -> None:
    if not ok:
        raise SchemeError(f"the {what} quantizer cannot express scheme {s.name} (it learns one scale per row); "
                          f"use {expressible}, or --quantizer fake for group-wise and FP formats")
