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


def round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (torch.round(x) - x).detach()


def grad_scale(x: torch.Tensor, g: float) -> torch.Tensor:
    """Value of ``x`` forward, gradient times ``g`` backward (LSQ step-size gradient scale)."""
    return (x - x * g).detach() + x * g


def _per_row(scheme_bits: int, sym: bool) -> Scheme:
    return Scheme(elem="int", bits=scheme_bits, group_size=-1, sym=sym, scale="fp32")


def _qtensor(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: Scheme) -> QTensor:
    """Integer levels ``q [out, in]`` and per-row scale ``[out, 1]`` -> per-row QTensor."""
    out, cols = q.shape
    codes = (q - scheme.qmin).to(torch.uint8).reshape(out, 1, cols)
    z = None if zero is None else zero.reshape(out, 1).float()
    return QTensor(codes, scale.reshape(out, 1).float(), z, None, (out, cols), scheme)


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
        x = torch.clamp(w / alpha, -1.0, 1.0)
        s = torch.where(x >= 0, 1.0, -1.0).to(x.dtype)
        return (x + (s - x).detach()) * alpha

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
        x = torch.clamp(w / alpha, -0.99, 0.99)
        return (round_ste(x * self.n - self.shift) + self.shift) / self.n * alpha

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
        a = grad_scale(alpha, 1.0 / (w.shape[1] * self.qp) ** 0.5)
        return round_ste(torch.clamp(w / a, -self.qn, self.qp)) * a

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
    per_row_int = s.elem == "int" and s.group_size == -1 and s.sym
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
