"""SignRound through llama.cpp's K-quant double-quantized scales (Q2_K ... Q6_K).

The rounder starts from the RTN result of `lowbit.formats.kquants` (V2: the importance-
weighted search; V1: plain sub-block ranges) and learns, besides the per-weight rounding
offsets ``V``, a factor on every sub-block's scale and min. The tuned float sub-block
scale ``d * sc0 * f`` is what gets quantized (straight-through rounding) to the 4/6/8-bit
scale code under the super-block's fp16 ``d``, and likewise the min under ``dmin``; the
weight is then ``(d*sc) * clip(round((w + dmin*m) / (d*sc) + V)) - dmin*m`` in ggml's fp32
order, so ``export()`` gives the `QTensor` whose dequantization equals ``forward()`` and
whose GGUF blocks are exact. With ``V = 0`` and the factors at 1 it is exactly the RTN
result it started from.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.formats import QTensor, Scheme
from lowbit.formats.kquants import QK_K, KParts, ktype, parts_to_tensors, quantize_parts
from lowbit.nn import round_ste


class KQuantRounder(nn.Module):
    """Learnable rounding of one ``[out, in]`` weight (in a multiple of 256) to a K-quant scheme."""

    def __init__(self, w: torch.Tensor, scheme: Scheme, imp: torch.Tensor | None = None, v2: bool = False) -> None:
        super().__init__()
        self.scheme, self.shape, self.v2 = scheme, tuple(w.shape), v2
        self.kt = kt = ktype(scheme.bits)
        out, cols = w.shape
        fit = not v2 and scheme.rule == "fit"
        p = quantize_parts(w, kt, imp if v2 else None, search=v2 or scheme.rule == "search", fit=fit)
        self.register_buffer("x", w.detach().float().reshape(out, cols // QK_K, kt.nsub, kt.sub))
        self.register_buffer("d", p.d)
        self.register_buffer("sc0", p.sc)
        self.register_buffer("dmin", p.dmin if p.dmin is not None else torch.zeros_like(p.d))
        self.register_buffer("m0", p.m if p.m is not None else torch.zeros_like(p.sc))
        self.v = nn.Parameter(torch.zeros_like(self.x))
        self.fs = nn.Parameter(torch.ones_like(p.sc))
        self.fm = nn.Parameter(torch.ones_like(p.sc))

    def clamp_(self) -> None:
        with torch.no_grad():
            self.fs.clamp_(0.0, 2.0)
            self.fm.clamp_(0.0, 2.0)

    def _codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Sub-block scale and min codes: the tuned float values rounded (STE) onto the stored grid."""
        kt = self.kt
        sc = round_ste(self.sc0 * self.fs).clamp(kt.sc_lo, kt.sc_hi)
        m = round_ste(self.m0 * self.fm).clamp(0, kt.m_hi)
        return sc, m

    def _levels(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        kt = self.kt
        sc, m = self._codes()
        ds = self.d.unsqueeze(-1) * sc
        dm = self.dmin.unsqueeze(-1) * m if not kt.sym else torch.zeros_like(ds)
        inv = torch.where(ds != 0, 1.0 / ds, torch.zeros_like(ds))
        q = round_ste((self.x + dm.unsqueeze(-1)) * inv.unsqueeze(-1) + self.v).clamp(kt.qmin, kt.qmax)
        return q, ds, dm, sc, m

    def forward(self) -> torch.Tensor:
        q, ds, dm, _, _ = self._levels()
        w = ds.unsqueeze(-1) * q
        if not self.kt.sym:
            w = w - dm.unsqueeze(-1)
        return w.reshape(self.shape)

    def export(self) -> QTensor:
        with torch.no_grad():
            q, _, _, sc, m = self._levels()
            kt = self.kt
            parts = KParts(q - kt.qmin, sc, None if kt.sym else m, self.d.clone(),
                           None if kt.sym else self.dmin.clone())
            codes, sc_t, m_t, sup = parts_to_tensors(parts, kt)
            return QTensor(codes, sc_t, m_t, sup, self.shape, self.scheme)
